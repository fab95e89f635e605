"""Generated tokens, corpora (tokenized once to a memory-mapped cache), batches and packing."""
