"""Sampling: per-request logits edits and token draws, a layer below the engine (imports nothing from it)."""
