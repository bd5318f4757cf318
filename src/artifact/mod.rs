//! The `.ninfer` container.
