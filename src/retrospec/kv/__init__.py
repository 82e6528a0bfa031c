"""KV-cache adapters: the only package that touches ``transformers`` cache internals."""

from .cache import KeyBuffer, KVCache

__all__ = ["KVCache", "KeyBuffer"]
