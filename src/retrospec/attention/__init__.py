"""Attention extensions registered through transformers' public ``AttentionInterface`` (no modeling code copied)."""
