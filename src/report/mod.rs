//! report.json and the stdout table.
