"""Running Hugging Face models for the core: KV caches, the target session, model drafters."""
