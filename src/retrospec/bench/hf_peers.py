"""Hugging Face's own speculative decoding, run on the same models and prompts as our methods.

- ``hf-assisted``: ``generate(assistant_model=draft)`` with our gamma, a constant schedule and the assistant's
  dynamic confidence cut-off disabled (the configuration that matches our ``sd``).
- ``hf-assisted-default``: the same with transformers' default assistant settings (20 tokens, confidence 0.4).
- ``hf-pld``: ``generate(prompt_lookup_num_tokens=k)`` with our k and our maximum n-gram size.
- ``hf-ar``: plain ``generate()`` (greedy or sampled like the run), transformers' own decoding loop with its
  ``DynamicCache``: the peer of our ``ar``, which decodes through our engine (``fastpath``).

A draft with a reduced vocabulary (``draft_vocab.json``) is handed to transformers as an equivalent full-vocabulary
model (``full_vocab_draft``): the same blocks, input rows gathered so every target id reads what our drafter feeds
it, and head rows scattered with zero rows elsewhere. Greedy proposals are then identical to ours whenever the best
in-vocabulary logit is positive (zero rows give logit 0); transformers pays for the full-width head, which is
exactly what it cannot avoid with such a draft.

Statistics come from public PyTorch forward hooks on the target and the draft (no patching): the number of target
forward calls, the tokens each verification call scored (drafted tokens), and time spent inside model forwards.
Decode time = generate() wall time minus the first target forward (the prompt), as for our own methods.
"""

from __future__ import annotations

import contextlib
import copy
import weakref

import torch

from ..config import SamplingConfig
from ..fastpath import device_clock
from ..models.vocab import VocabMap
from ..types import SpecStats

HF_METHODS = ("hf-ar", "hf-assisted", "hf-assisted-default", "hf-pld")


class ForwardProbe:
    """Counts calls, input lengths and time inside a module's forward via hooks."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.lengths: list[int] = []  # input length of each call
        self.durations: list[float] = []  # seconds inside each call
        self._t, self._handles = 0.0, []
        self.clock = device_clock(next(module.parameters()).device)  # waits for CUDA: the work, not its launches

    def _pre(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.lengths.append(int(ids.shape[1]) if ids is not None else 0)
        self._t = self.clock()

    def _post(self, module, args, kwargs, output):
        self.durations.append(self.clock() - self._t)

    @property
    def seconds(self) -> float:
        return sum(self.durations)

    def __enter__(self):
        self._handles = [self.module.register_forward_pre_hook(self._pre, with_kwargs=True),
                         self.module.register_forward_hook(self._post, with_kwargs=True)]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()


@contextlib.contextmanager
def _assistant_config(draft: torch.nn.Module, **settings):
    saved = draft.generation_config
    cfg = copy.deepcopy(saved)
    for k, v in settings.items():
        setattr(cfg, k, v)
    draft.generation_config = cfg
    try:
        yield
    finally:
        draft.generation_config = saved


@torch.inference_mode()
def run_hf(method: str, target, draft, prompt_ids: list[int], *, sampling: SamplingConfig, max_new_tokens: int,
           eos_ids: frozenset[int], pad_id: int | None, gamma: int, pld_k: int,
           pld_ngram: int) -> tuple[list[int], SpecStats, float]:
    """Run one HF peer; returns (generated ids, stats, seconds inside model forwards during decoding)."""
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # generate() warns about config plumbing that is not ours to fix
    gen_kwargs = dict(max_new_tokens=max_new_tokens, do_sample=not sampling.greedy,
                      eos_token_id=sorted(eos_ids) or None, pad_token_id=pad_id)
    if not sampling.greedy:
        gen_kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None)
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    ids = torch.tensor([prompt_ids], device=next(target.parameters()).device)
    mask = torch.ones_like(ids)
    stats = SpecStats(method=method, prompt_tokens=len(prompt_ids))
    probes = [ForwardProbe(target)] + ([ForwardProbe(draft)] if method.startswith("hf-assisted") else [])
    extra, ctx = {}, contextlib.nullcontext()
    if method == "hf-pld":
        extra = dict(prompt_lookup_num_tokens=pld_k, max_matching_ngram_size=pld_ngram)
    elif method in ("hf-assisted", "hf-assisted-default"):
        extra = dict(assistant_model=draft)
        # hf-assisted: our gamma, constant; hf-assisted-default: None = let transformers fill in its own defaults
        # (5.23: 20 tokens, constant, confidence 0.4)
        ours = method == "hf-assisted"
        ctx = _assistant_config(draft, num_assistant_tokens=gamma if ours else None,
                                num_assistant_tokens_schedule="constant" if ours else None,
                                assistant_confidence_threshold=0.0 if ours else None)
    elif method != "hf-ar":
        raise ValueError(method)
    config = GenerationConfig(**gen_kwargs)
    with ctx, contextlib.ExitStack() as stack:
        for p in probes:
            stack.enter_context(p)
        t0 = probes[0].clock()
        out = target.generate(input_ids=ids, attention_mask=mask, generation_config=config, **extra)
        total = probes[0].clock() - t0
    tp = probes[0]
    new = out[0, len(prompt_ids):].tolist()
    stats.new_tokens = len(new)
    stats.target_calls = len(tp.lengths)
    # first call scores the prompt (+ candidates for assisted decoding); later calls score 1 + candidates
    stats.drafted_tokens = max(0, tp.lengths[0] - len(prompt_ids)) + sum(n - 1 for n in tp.lengths[1:])
    stats.accepted_tokens = max(0, stats.new_tokens - stats.target_calls)
    stats.prefill_s = tp.durations[0]
    stats.decode_s = max(1e-9, total - stats.prefill_s)
    forward_s = sum(p.seconds for p in probes) - stats.prefill_s
    return new, stats, forward_s


# per draft module (weak: a freed draft leaves no entry, and a new module at a reused address is not mistaken for it)
_FULL_VOCAB: "weakref.WeakKeyDictionary[torch.nn.Module, dict[int, torch.nn.Module]]" = weakref.WeakKeyDictionary()


def full_vocab_draft(draft, target_vocab: int) -> torch.nn.Module:
    """The transformers model to give HF's assisted generation for ``draft`` (a ``LoadedModel``); built once per
    draft module and target vocabulary."""
    if getattr(draft, "vocab_map", None) is None:
        return draft.model
    built = _FULL_VOCAB.setdefault(draft.model, {})
    if target_vocab not in built:
        from transformers import AutoModelForCausalLM

        vmap = VocabMap(draft.vocab_map.cpu(), target_vocab)
        cfg = copy.deepcopy(draft.model.config)
        cfg.vocab_size, cfg.tie_word_embeddings = target_vocab, False
        full = AutoModelForCausalLM.from_config(cfg, dtype=next(draft.model.parameters()).dtype)
        state = {k: v for k, v in draft.model.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k}
        full.load_state_dict(state, strict=False)
        with torch.no_grad():
            rows = vmap.to_draft.to(draft.model.get_input_embeddings().weight.device)  # [V]
            full.get_input_embeddings().weight.copy_(draft.model.get_input_embeddings().weight[rows])
            head = draft.model.get_output_embeddings().weight  # [Vd, H]
            full.get_output_embeddings().weight.copy_(vmap.scatter(head.T.cpu(), fill=0.0).T)  # [V, H], zero rows
        full.generation_config = copy.deepcopy(draft.model.generation_config)
        built[target_vocab] = full.to(draft.model.get_input_embeddings().weight.device).eval()  # the draft's device
    return built[target_vocab]
