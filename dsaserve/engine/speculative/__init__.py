"""Speculative decoding: MTP drafting, verifying drafts by rejection sampling, and their counters."""
