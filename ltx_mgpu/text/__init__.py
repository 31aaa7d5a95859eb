"""Gemma 3 text encoding for LTX-2: loading (gemma, nf4), feature extraction, batching, cache."""
