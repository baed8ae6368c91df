"""Paged KV memory: blocks, the prefix index, the per-sequence manager and the tensors."""
