"""KV-cache adapters: the only package that touches ``transformers`` cache internals."""

from .cache import KVCache

__all__ = ["KVCache"]
