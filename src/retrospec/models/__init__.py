"""Models: loading checkpoints (``loading``), named models (``named``), GGUF import (``gguf``).

Everything the rest of the package imports from ``retrospec.models`` is re-exported here. Layering inside the
package: ``loading`` -> ``named`` -> ``gguf`` -> ``files`` (each uses only what is to its right); nothing here
imports the engine.
"""

from .gguf import import_gguf
from .loading import (DRAFT_VOCAB_FILE, DTYPES, LoadedModel, check_same_vocab, load_model, model_dir,
                      load_options, placement, resolve_device, resolve_dtype)
from .named import (DEFAULT_TARGET, NAMED, ZOO_DIR, NamedModel, default_target, known_names, lookup, model_home,
                    paired_draft, paired_longspec, longspec_dir, resolve_name)

__all__ = ["LoadedModel", "load_model", "model_dir", "check_same_vocab", "DRAFT_VOCAB_FILE", "DTYPES",
           "load_options", "placement", "resolve_device", "resolve_dtype", "ZOO_DIR", "NAMED",
           "NamedModel", "known_names", "lookup", "model_home", "resolve_name", "DEFAULT_TARGET", "default_target",
           "paired_draft", "paired_longspec", "longspec_dir", "import_gguf"]
