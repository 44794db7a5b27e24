"""Continuous batching: a paged KV cache, a scheduler and hand-written models that step many requests at once."""
