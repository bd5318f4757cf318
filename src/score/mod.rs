//! Window protocol and NLL accumulation.
