"""Indices to tensors: gather, the reader's re-check, episodes as reads."""
