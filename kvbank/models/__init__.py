"""Model files (GGUF, Hugging Face folders) and the model code that runs them."""
