"""LongSpec's draft model (Yang et al., "LongSpec: Long-Context Lossless Speculative Decoding with Efficient
Drafting and Verification", sail-sg 2025): the one-block draft (``block``), its fixed-size inference state
(``state``) and its checkpoint directory tied to a target (``checkpoint``). Drafting with it is
``retrospec.drafters.longspec``; nothing here imports the engine."""

from .block import DEFAULT_WINDOW, KeyBuffer, LongSpecDraft, cross_visible, grouped_attention, self_visible
from .checkpoint import load_longspec, read_meta, repack_longspec, save_longspec
from .state import DraftState

__all__ = ["DEFAULT_WINDOW", "KeyBuffer", "LongSpecDraft", "DraftState", "cross_visible", "self_visible",
           "grouped_attention", "save_longspec", "load_longspec", "read_meta", "repack_longspec"]
