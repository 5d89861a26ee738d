"""The inference engine: model families, loaders, tokenizer, caches and generation."""
