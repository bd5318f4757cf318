//! Hugging Face directory reader. Not written yet.
