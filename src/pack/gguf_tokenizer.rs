//! Rebuilds a Hugging Face tokenizer.json from GGUF metadata. Not written yet.
