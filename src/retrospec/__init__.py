"""retrospec: speculative decoding for Hugging Face causal LMs — draft cheaply, verify with the target.

Public API: ``generate``, ``stream``, ``load_model``; types ``GenerationResult``, ``SpecStats``, ``DraftTree``.
"""

from .api import generate, stream
from .errors import RetrospecError
from .models import LoadedModel, load_model
from .types import DraftTree, GenerationResult, SpecStats

__all__ = ["generate", "stream", "load_model", "LoadedModel", "RetrospecError", "GenerationResult", "SpecStats",
           "DraftTree"]
__version__ = "0.1.0"
