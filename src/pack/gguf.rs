//! GGUF reader (llama architecture). Not written yet.
