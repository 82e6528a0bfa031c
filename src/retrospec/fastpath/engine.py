"""The engine's private fast copy of a model: what the verifier (and drafters that run a model) call.

Why: a verification step should cost about one decode step. On CPU the copy gets there with ``attention.
prefix_block`` (set on its own config) and decoder linears prepacked / the head in the layout ``fastpath.plan``
measured fastest (families whose logits are plain ``lm_head(last_hidden_state)``), never touching the caller's
model. ``engine_for`` caches the ``EngineModel`` weakly per model while its weights stay the same; the copy is a
``deepcopy`` with every parameter and buffer memoised to itself (shared weights: only packed copies cost memory).

On CUDA the copy verifies through ``attention.hybrid_tree`` (LongSpec's hybrid tree attention, its tree part the
Triton kernel) when Triton is installed, the kernel passed its self-check on that device and dtype
(``hybrid_tree.triton_ready``), and ``hybrid_min_length`` measured it faster than sdpa from some cache length on;
shorter caches still go to sdpa inside it. Otherwise a CUDA model runs as it is.

Exact verification (``row_exact``): when every matmul of the copy gives a row the same bits whatever the number of
rows in the call (measured at build, ``fastpath.rows``: weight-only and 16-bit kernels here; float32 BLAS is not), the
copy's attention computes each verified row alone over the keys a one-token step at its position reads
(``prefix_block.ROW_EXACT``), so a k-token verification's logits are bitwise those of k one-token steps and every
lossless method is token-identical to ``ar`` in that format, near-ties included.

Invariants (tested): the caller's model is unchanged; the copy's logits equal the plain forward's within float
tolerance, and greedy decoding through it is token-identical to the oracle. A model the copy cannot be built for
(no ``get_decoder``, another device, attention other than ``sdpa``) runs as it is.
"""

from __future__ import annotations

import copy
import functools
import itertools
import statistics
import sys
import time
import types
import warnings
import weakref
from collections.abc import Callable

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..attention import hybrid_tree, prefix_block
from ..weight_only import WeightOnlyLinear
from . import aot, compiled
from .draft import draft_choice, pack_linears, row_product
from .lean import LeanDecoder
from .linear import head_logits, kernel_available, kernel_prefetch, kernel_streamed, pack_weight
from .plan import ROWS, Plan, attention_prefetch, attention_shape, forced_plan, linear_layers, load_or_measure, \
    median_ms, mode, model_plan_key
from .rows import linear_modules, rows_invariant

CROSSOVER_LENGTHS = (256, 1024, 4096, 16384)  # cache lengths at which hybrid tree attention is timed against sdpa

PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})  # logits = lm_head(last_hidden_state)
_ENGINES: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[str, bool, bool], tuple[tuple, EngineModel]]]" = \
    weakref.WeakKeyDictionary()  # model -> (attention, draft, programs) -> (fingerprint, engine)


def _plain_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    cfg = getattr(model, "config", None)
    if getattr(cfg, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES or not hasattr(model, "get_decoder"):
        return None
    head = model.get_output_embeddings()
    if not isinstance(head, (torch.nn.Linear, WeightOnlyLinear)) or head.bias is not None:
        return None
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
        return None
    return head


def _fingerprint(model: torch.nn.Module) -> tuple:
    return tuple((id(p), p.data_ptr(), p._version, p.dtype) for p in model.parameters())


def _private_copy(model: torch.nn.Module) -> torch.nn.Module:
    """New modules and config over the same weight tensors (every parameter and buffer memoised to itself)."""
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _on_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


@functools.cache
@torch.inference_mode()
def hybrid_min_length(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                      queries: int = 8) -> int | None:
    """The fewest cached keys from which ``hybrid_tree`` measured faster than sdpa with the 4D mask transformers
    passes, for a ``queries``-token verification of one attention layer of this shape on ``device``: the shortest of
    ``CROSSOVER_LENGTHS`` from which it wins at every longer one; None when it never does. Once per process."""
    gen = torch.Generator().manual_seed(0)
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)
    causal = torch.ones(queries, queries, dtype=torch.bool, device=device).triu(1)  # [q, q] hidden entries
    wins = []
    for length in CROSSOVER_LENGTHS:
        query = torch.randn(1, heads, queries, head_dim, generator=gen).to(device, dtype)  # [1, h, q, d]
        key, value = (torch.randn(1, kv_heads, length, head_dim, generator=gen).to(device, dtype) for _ in "kv")
        mask = torch.zeros(1, 1, queries, length, dtype=dtype, device=device)  # [1, 1, q, L] additive
        mask[..., length - queries:].masked_fill_(causal, torch.finfo(dtype).min)
        sdpa, hybrid = (median_ms(lambda f=f: f(module, query, key, value, mask, scaling=0.125), device=device)
                        for f in (sdpa_attention_forward, hybrid_tree.hybrid_tree_attention))
        wins.append(hybrid < sdpa)
    best = None
    for length, win in zip(reversed(CROSSOVER_LENGTHS), reversed(wins)):
        if not win:
            break
        best = length
    return best


class EngineModel:
    """One model as the engine runs it: ``forward`` -> (logits [T, V], last hidden states [T, H] or None)."""

    def __init__(self, model: torch.nn.Module, how: str = "auto", remeasure: bool = False,
                 attention: str = "prefix_block", draft: bool = False, linears: str | None = None,
                 programs: bool = True):
        """``linears``: a draft's linear path forced (``fastpath.draft.CHOICES``; None: measured, see
        ``_programs_pay``). ``programs=False``: no compiled layers (a draft run over a cache they do not run over)."""
        self.source = model
        self.draft = draft
        self.mode = how
        self.attention = attention
        self.plan: Plan | None = None
        self.module = model  # what is called: the private copy, or the caller's model when nothing applies
        self.decoder: torch.nn.Module | None = None  # set when the head is applied here (plain-head families)
        self.head_weight: torch.Tensor | None = None  # [V, H]
        self.head_packed: torch.Tensor | None = None
        self.head_fn: Callable[[torch.Tensor], torch.Tensor] | None = None  # a weight-only or draft head: as it is
        self.hybrid_min_length: int | None = None
        self.row_exact = False  # every verified row computed as a one-token step computes it (see rows_invariant)
        self.lean: LeanDecoder | None = None  # the decoder's forward as a plain loop (``fastpath.lean``) where it applies
        self.compiled: dict = {}  # whether its layers run as compiled programs, and why (``fastpath.compiled.build``)
        device = next(model.parameters()).device
        if _on_cuda(device) and how != "off" and attention == "prefix_block" and not draft:
            self._hybrid_tree_copy(model, device)
            return
        if (how == "off" or device.type != "cpu" or _plain_head(model) is None
                or getattr(model.config, "_attn_implementation", None) not in ("sdpa", prefix_block.ATTN_NAME)):
            self.mode = "off"
            return
        with torch.inference_mode(False), torch.no_grad():
            clone = _private_copy(model)
            if attention == "prefix_block" and not prefix_block.enable(clone):
                self.mode = "off"
                return
            decoder, head = clone.get_decoder(), _plain_head(clone)
            forced, linears = linears, linear_layers(decoder)
            pack_dtype = None
            if isinstance(head, WeightOnlyLinear):  # a weight-only model: its own kernels, nothing to pack
                self.plan, self.head_fn = Plan(source=f"weight-only:{head.fmt}"), head
            elif draft:  # a draft model: its linears, and apart its head, each in the path measured fastest for
                # drafts at every row count (fastpath.draft; the head's shape favours other paths, integer formats
                # among them)
                choice = forced or draft_choice([m.weight for m in linears], remeasure=remeasure)
                if forced is None and programs and how == "auto" and choice.startswith("packed") and _programs_pay(
                        model, choice, remeasure):
                    choice = "kernel"  # its layers compiled around the f32 kernel beat them prepacked, eager
                head_choice = draft_choice([head.weight], remeasure=remeasure, quantized=True)
                self.plan = Plan(packed_rows=list(ROWS) if choice.startswith("packed") else [],
                                 kernel=choice == "kernel", source=f"draft:{choice},head:{head_choice}")
                self.head_fn = row_product(head.weight, head_choice)
                pack_dtype = torch.bfloat16 if choice == "packed-bf16" else None
            elif how == "auto":
                shape = attention_shape(clone.config) if attention == "prefix_block" else None
                self.plan = load_or_measure(linears, head.weight, remeasure=remeasure, attention=shape,
                                            layers=int(getattr(clone.config, "num_hidden_layers", 1) or 1))
                if self.plan.uses_kernel:
                    kernel_streamed(self.plan.streamed)  # the kernel's loop order measured for these shapes
                    kernel_prefetch(self.plan.prefetch)
                if shape is not None:
                    attention_prefetch(self.plan.attention_ahead)
            else:
                self.plan = forced_plan(how)
            if self.plan.packed_rows:  # the copy's own decoder linears; the caller's modules are untouched
                pack_linears(decoder, "packed-bf16" if pack_dtype else "packed", max(self.plan.packed_rows))
            elif self.plan.kernel:
                pack_linears(decoder, "kernel")
            self.head_weight = getattr(head, "weight", None)
            if "packed" in self.plan.head.values():
                self.head_packed = pack_weight(head.weight, pack_dtype)
            if attention == "prefix_block" and not draft:  # exact verification where the matmuls allow it
                self.row_exact = rows_invariant([*linear_modules(decoder), self.logits_of], head.in_features,
                                                clone.get_input_embeddings().weight.dtype)
                setattr(clone.config, prefix_block.ROW_EXACT, self.row_exact)
        self.module, self.decoder = clone, decoder
        if LeanDecoder.supports(decoder):
            self.lean = LeanDecoder(decoder)
            if how != "off" and programs:
                self.lean.compiled, self.compiled = compiled.build(self.lean, decoder, self.row_exact, _say, draft)

    def logits_of(self, rows: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, V] logits, as ``forward`` computes them (the plan's layout for T rows)."""
        if self.head_fn is not None:
            return self.head_fn(rows)
        layout = self.plan.head_layout(rows.shape[0]) if self.plan is not None else "linear"
        return head_logits(rows, self.head_weight, layout, self.head_packed)

    def _hybrid_tree_copy(self, model: torch.nn.Module, device: torch.device) -> None:
        """CUDA: the copy in hybrid tree attention from the measured crossover on (see the module docstring);
        mode ``off`` (the model as it is) when Triton fails its self-check or hybrid never wins."""
        self.mode = "off"
        cfg, dtype = model.config, next(model.parameters()).dtype
        heads = getattr(cfg, "num_attention_heads", None)
        if not heads or not getattr(cfg, "hidden_size", None):  # not a shape the timing can stand in for
            return
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        if (getattr(cfg, "_attn_implementation", None) != "sdpa"
                or not hybrid_tree.triton_ready(device, dtype, head_dim, head_dim)):  # use_triton's cache key
            return
        try:
            min_length = hybrid_min_length(heads, kv_heads, head_dim, dtype, device)
        except Exception as exc:  # out of memory at 16K keys, a kernel that fails at a length: keep the model as it is
            warnings.warn(f"hybrid tree attention not timed on {device}: {type(exc).__name__}: {exc}; verifying "
                          "with the model's own attention", RuntimeWarning, stacklevel=2)
            return
        if min_length is None:
            return
        with torch.inference_mode(False), torch.no_grad():
            clone = _private_copy(model)
        if not hybrid_tree.enable(clone):
            return
        setattr(clone.config, hybrid_tree.MIN_LENGTH, min_length)
        self.module, self.mode, self.hybrid_min_length = clone, "hybrid-tree", min_length

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                cache, *, want_hidden: bool | tuple[int, ...] = False, last_only: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids/position_ids [1, T]; logits [T, V] (or [1, V] with ``last_only``); hidden when asked: ``want_hidden``
        True gives the last layer's (normed) [T, H], a tuple of decoder layer indices their outputs [T, n, H].
        One unpadded sequence only: prefix + block attention never sees a padding mask (padded batches call
        ``module`` of an engine built with ``attention="sdpa"``, see ``batched``)."""
        if ids.shape[0] != 1:
            raise ValueError("EngineModel.forward runs one sequence; use engine_for(model, attention='sdpa').module "
                             "for padded batches")
        layers = want_hidden if isinstance(want_hidden, tuple) else ()
        kwargs = dict(input_ids=ids, position_ids=position_ids, attention_mask=attention_mask, past_key_values=cache,
                      use_cache=True, output_hidden_states=bool(want_hidden))

        def picked(states) -> torch.Tensor | None:  # transformers' hidden_states: entry i + 1 is layer i's output
            if not want_hidden:
                return None
            return torch.stack([states[i + 1][0] for i in layers], 1) if layers else states[-1][0]

        if self.decoder is None:
            out = self.module(**kwargs, logits_to_keep=1 if last_only else 0)
            return out.logits[0], picked(out.hidden_states)
        if self.lean is not None and (attention_mask is None or attention_mask.dim() == 4):
            hidden, wanted = self.lean(ids, position_ids, attention_mask, cache, want_layers=layers)  # [T, H]
            rows = hidden[-1:] if last_only else hidden
            if layers:
                return self.logits_of(rows), torch.stack([wanted[i] for i in layers], 1)  # [T, n, H]
            return self.logits_of(rows), (hidden if want_hidden else None)
        out = self.decoder(**kwargs)
        hidden = out.last_hidden_state[0]  # [T, H]
        rows = hidden[-1:] if last_only else hidden
        return self.logits_of(rows), picked(out.hidden_states)

    def describe(self) -> dict:
        """What runs, for reports: mode, attention, the packed row counts and head layouts, where the plan came from."""
        d = {"mode": self.mode, "attention": getattr(self.module.config, "_attn_implementation", None),
             "row_exact": self.row_exact, "loop": "lean" if self.lean is not None else "modules"}
        if self.lean is not None and self.lean.compiled is not None:
            d["loop"] = "compiled"
        if self.compiled:
            d["compiled"] = self.compiled
        if self.hybrid_min_length is not None:
            d["hybrid_min_length"] = self.hybrid_min_length
        if self.plan is not None:
            d.update(packed_rows=self.plan.packed_rows, kernel=self.plan.kernel, head=self.plan.head,
                     plan=self.plan.source, plan_seconds=round(self.plan.seconds, 2))
            if self.plan.uses_kernel:
                d.update(streamed=self.plan.streamed, prefetch=self.plan.prefetch)
            if self.plan.ms.get("attention_ahead"):
                d["attention_ahead"] = self.plan.attention_ahead
        return d


def _programs_pay(model: torch.nn.Module, choice: str, remeasure: bool = False) -> bool:
    """Whether a draft model's layers compiled around the f32 kernel (``fastpath.compiled``, wanted for drafts of
    any depth) beat its layers eager with prepacked linears (``choice``, which the programs do not express): a draft
    is called once per drafted token, so its per-operation cost may outweigh the matmul path measured alone. Timed
    once per machine and model shape (one-token steps over a 300-token cache, interleaved) and cached."""
    cfg = model.config
    layers, hidden = getattr(cfg, "num_hidden_layers", 0), getattr(cfg, "hidden_size", 0)
    if not (kernel_available(model.get_input_embeddings().weight) and compiled.wanted(layers, hidden, draft=True)):
        return False
    name = aot.key("draft-paths", (model_plan_key(model), choice))
    verdict = compiled.timed_verdict(name, lambda: _draft_paths_ms(model, choice), redo=remeasure)
    return verdict["compiled_ms"] < verdict["eager_ms"]


@torch.inference_mode()
def _draft_paths_ms(model: torch.nn.Module, choice: str, context: int = 300, reps: int = 15) -> tuple[float, float]:
    """Median ms of a one-token step of ``model`` as a draft engine: (eager with ``choice`` linears, compiled around
    the f32 kernel), timed in turn; the second is infinite where the programs were not kept."""
    from ..kv.cache import KVCache

    engines = [EngineModel(model, "auto", draft=True, linears=c) for c in (choice, "kernel")]
    if engines[1].lean is None or engines[1].lean.compiled is None:
        return 1.0, float("inf")
    device = next(model.parameters()).device
    ids = torch.randint(0, int(model.config.vocab_size), (1, context), device=device)
    caches = [KVCache(model) for _ in engines]
    for engine, kv in zip(engines, caches):
        engine.forward(ids, torch.arange(context, device=device)[None], None, kv.cache, last_only=True)
    one, at = ids[:, :1], torch.tensor([[context]], device=device)
    times: list[list[float]] = [[], []]
    for rep in range(reps + 1):
        for i, (engine, kv) in enumerate(zip(engines, caches)):
            t0 = time.perf_counter()
            engine.forward(one, at, None, kv.cache, last_only=True)
            if rep:
                times[i].append((time.perf_counter() - t0) * 1e3)
            kv.crop(context)
    return statistics.median(times[0]), statistics.median(times[1])


def engine_for(model: torch.nn.Module, how: str | None = None, remeasure: bool = False,
               attention: str = "prefix_block", draft: bool = False, programs: bool = True) -> EngineModel:
    """The cached ``EngineModel`` of ``model`` (built on first use; rebuilt when its weights change).
    ``how`` defaults to ``RETROSPEC_FASTPATH`` (see ``fastpath.plan``). ``attention="sdpa"`` keeps transformers'
    attention (padding masks respected: batched generation); the default is the decode loop's prefix + block.
    ``draft=True``: the engine of a DRAFT model, its matmuls in the path ``fastpath.draft`` measured fastest for
    drafts (possibly bfloat16; never use it for a model whose logits are the target's p). ``programs=False``: no
    compiled layers, for a caller whose cache they do not run over (they run over the engine's ``KVCache``)."""
    how = how or mode()
    fp = (how, _fingerprint(model))
    slot = _ENGINES.setdefault(model, {})
    hit = slot.get((attention, draft, programs))
    if hit is not None and hit[0] == fp and not remeasure:
        return hit[1]
    engine = EngineModel(model, how, remeasure=remeasure, attention=attention, draft=draft, programs=programs)
    slot[(attention, draft, programs)] = (fp, engine)
    return engine
