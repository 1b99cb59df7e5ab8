"""Target and draft model definitions (Hugging Face parameter names) and checkpoint loading."""
