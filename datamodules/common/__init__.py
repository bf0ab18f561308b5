"""Data parts shared by every paper: the embedded corpus, the cached tokenizer, local-file loaders, packing."""
