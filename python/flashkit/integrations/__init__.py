"""flashkit inside other libraries (Hugging Face transformers: flashkit.integrations.transformers)."""
