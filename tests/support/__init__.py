"""Shared test helpers: tiny checkpoints and a small test builder (the real CPU builder is tested apart)."""
