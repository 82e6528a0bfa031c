"""LongSpec's draft block: one decoder layer that reads the target's own KV cache.

Paper: Yang et al., "LongSpec: Long-Context Lossless Speculative Decoding with Efficient Drafting and
Verification" (sail-sg, 2025). The draft is ONE decoder block between the target's frozen token embedding and its
frozen LM head, shaped like a layer of the target (hidden size, GQA heads, head size, RMSNorm eps, MLP, RoPE), so
its memory does not grow with the context:

    x  = embed(ids)                  # the target's embedding module: a shared reference, not a copy
    x += SelfAttn(norm1(x))          # own q/k/v/o; RoPE at the token's absolute position; sliding window
    x += feat_in(norm_f(g))          # optional (``features``): the feature g of the position before, see below
    x += CrossAttn(norm2(x))         # own q_proj (+ RoPE at the token's position) and o_proj; keys / values are
                                     # the target's LAST-LAYER K/V exactly as cached (post-RoPE), no projection
    x += MLP(norm3(x))
    logits = lm_head(x)              # the target's head (or its rows for a draft vocabulary); no final norm

Visibility rules (explicit functions, tested):
- ``self_visible``: a query at absolute position t sees draft keys at positions s with t - window < s <= t. A
  full-sequence forward adds causality by index; at inference a tree's tokens also need ancestry (``DraftState``).
- ``cross_visible``: a query at position t sees the target's K/V at positions s <= t - shift. At inference
  shift = 1: the target cache holds exactly the committed tokens, all before the root, so every tree node sees the
  whole cache. Training may draw shift in [1, 4] (an int, or a tensor broadcastable to the [b, L] positions).
A query with no visible key gets a zero attention output (then o_proj), not NaN.

Target features (optional, ``features=(i, j, ...)``; EAGLE-3: Li et al., "EAGLE-3: Scaling up Inference
Acceleration of Large Language Models via Training-Time Test", 2025): the block also reads, at each drafted position,
a feature g [H] of the position before it. For a token right after the committed prefix (depth 1), g =
``target_feature`` = fuse(the target's outputs of decoder layers i, j, ..., each RMS-normalised) at the last
committed position (low, mid and high layers fused by one linear map); below a drafted token, g = that token's own
block output (``run``'s last return: the residual stream the head reads). The feature enters after the
self-attention, so a token's self-attention keys/values still depend on the token and its position only (the ring
needs no features), and ``feat_in`` starts at zero (``add_features``): a block given features starts as the block
it was.

Draft vocabulary (FR-Spec: Zhao et al., "FR-Spec: Accelerating Large-Vocabulary Language Models via
Frequency-Ranked Speculative Sampling", 2025): on a small target the head dominates a draft token's cost.
``set_vocab(ids)`` restricts the logits to the head rows of ``ids`` [K]: ``run`` returns logits [b, L, K]
(``token_ids`` maps a column back to a target id) and q = 0 on every other token, which rejection sampling treats
exactly. The rows are a non-persistent buffer; the ids are saved beside the weights (``checkpoint``).

Invariants:
- ``state_dict()`` holds only the block's own weights: the embedding and head are held outside the module tree
  (``embed_tokens`` / ``lm_head`` properties), so they are never saved, trained or moved with the block.
- A token's self-attention keys/values depend only on the token and its position (one layer), so committing tokens
  to the inference state (``DraftState.append``) needs no attention at all.
- Nothing here copies transformers modeling code: the target family's public ``*RotaryEmbedding``,
  ``apply_rotary_pos_emb``, ``*RMSNorm`` and ``*MLP`` are imported and called.
"""

from __future__ import annotations

import copy
import importlib

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import RetrospecError
from ...kv import KeyBuffer
from ..loading import as_module

DEFAULT_WINDOW = 512
ROPE_TABLE_MAX = 1 << 16  # positions the rotary table holds at most (cos and sin: 32 MiB at head size 64, float32)
# model_type -> class-name prefix in transformers.models.<type>.modeling_<type> (Llama-style decoder layers)
FAMILIES = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}


def feature_layers_for(num_layers: int) -> tuple[int, ...]:
    """Low, middle and high decoder layers of a target with ``num_layers`` layers whose outputs a block's feature
    fuses, as EAGLE-3 picks them (2, L / 2, L - 3 on a deep target); fewer on a shallow one (always below the last)."""
    picks = (2, num_layers // 2, num_layers - 3) if num_layers >= 6 else tuple(range(num_layers - 1))
    return tuple(sorted(set(picks)))


def self_visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[..., L] query positions, [..., S] key positions (-1 = empty slot) -> [..., L, S] bool:
    key s is visible to query t iff 0 <= s <= t and s > t - window."""
    t, s = q_pos[..., :, None], k_pos[..., None, :]
    return (s >= 0) & (s <= t) & (s > t - window)


def cross_visible(q_pos: torch.Tensor, length: int, shift: int | torch.Tensor = 1) -> torch.Tensor:
    """[b, L] query positions -> [b, L, length] bool: the target's K/V at position s is visible to the query at
    position t iff s <= t - shift (``shift``: an int, or a tensor broadcastable to [b, L])."""
    limit = q_pos - torch.as_tensor(shift, device=q_pos.device)  # [b, L]
    return torch.arange(length, device=q_pos.device) <= limit[..., None]


def grouped_attention(q: torch.Tensor, k, v, allowed, scale: float, stacked: bool | None = None) -> torch.Tensor:
    """Softmax attention with grouped key/value heads and an explicit visibility mask, through PyTorch's
    ``scaled_dot_product_attention``.

    q [b, h, L, d]; k, v [b, kvh, S, d] (query head i reads key/value head i // (h / kvh), as transformers'
    repeat_kv); allowed [b, L, S] bool (None: every key visible, no mask built). ``k``, ``v`` and ``allowed`` may
    each be a tuple of pieces along the key axis (S = the pieces' sum), joined here: the pieces are the draft's own
    window-bounded keys (a ring buffer, tentative tokens, new tokens); the target's (possibly long) cache always comes
    whole. No key is repeated: on the CPU, PyTorch's kernels read the grouped heads in place (``enable_gqa``);
    elsewhere, where a backend may repeat them, a group's query heads are stacked along the query axis instead
    (``stacked``: None = by the device; True / False force one way). Returns [b, L, h * d]; a query with no visible
    key gets zeros (in training too: such a row attends to every key and its output is then zeroed, so no backend's
    NaN reaches a gradient)."""
    key, value, mask = _joined(k, 2), _joined(v, 2), _joined(allowed, -1)
    b, h, n, d = q.shape
    kvh = key.shape[1]
    seen = None if mask is None else mask.any(-1, keepdim=True)  # [b, L, 1]
    if mask is not None:
        mask = mask | ~seen
    if stacked is None:
        stacked = q.device.type != "cpu"
    if not stacked:
        out = F.scaled_dot_product_attention(q, key, value, None if mask is None else mask[:, None], scale=scale,
                                             enable_gqa=h != kvh)  # [b, h, L, d]
        if seen is not None:
            out = out.masked_fill(~seen[:, None], 0.0)  # rows with nothing visible: zeros
        return out.transpose(1, 2).reshape(b, n, h * d)
    rep = h // kvh
    qg = q.reshape(b, kvh, rep * n, d)  # [b, kvh, rep * L, d]: a group's query heads one after another
    out = F.scaled_dot_product_attention(qg, key, value, None if mask is None else mask.repeat(1, rep, 1)[:, None],
                                         scale=scale)
    if seen is not None:
        out = out.masked_fill(~seen.repeat(1, rep, 1)[:, None], 0.0)
    return out.view(b, h, n, d).transpose(1, 2).reshape(b, n, h * d)


def _joined(x, dim: int) -> torch.Tensor | None:
    """A tensor, or a tuple of pieces along ``dim`` joined into one."""
    if not isinstance(x, tuple):
        return x
    return x[0] if len(x) == 1 else torch.cat(x, dim)


def _pieces(x) -> tuple[torch.Tensor, ...]:
    """A tensor, or a tuple of pieces along the key axis, as a tuple of pieces."""
    return x if isinstance(x, tuple) else (x,)


def _linears(**shapes: tuple[int, int, bool]) -> nn.Module:
    """A module holding ``nn.Linear(in, out, bias)`` per name (in order), as the target's attention names them."""
    mod = nn.Module()
    for name, (n_in, n_out, bias) in shapes.items():
        mod.add_module(name, nn.Linear(n_in, n_out, bias=bias))
    return mod


class LongSpecDraft(nn.Module):
    """The draft block for one target (see the module docstring). Build it with ``for_target``."""

    def __init__(self, config, embed_tokens: nn.Module, lm_head: nn.Module, window: int = DEFAULT_WINDOW,
                 intermediate_size: int | None = None, features: tuple[int, ...] | None = None):
        super().__init__()
        if window < 1:
            raise RetrospecError(f"LongSpec window must be >= 1, got {window}")
        if intermediate_size is not None and intermediate_size != config.intermediate_size:
            if intermediate_size < 1:
                raise RetrospecError(f"LongSpec intermediate size must be >= 1, got {intermediate_size}")
            config = copy.copy(config)  # the block's own MLP width; the target's config object is untouched
            config.intermediate_size = int(intermediate_size)
        prefix = FAMILIES.get(getattr(config, "model_type", None))
        if prefix is None:
            raise RetrospecError(f"LongSpec drafts for Llama-style targets ({', '.join(FAMILIES)}); this target is "
                                 f"{getattr(config, 'model_type', None)!r}")
        fam = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
        self.config = config  # the target's config (the block mirrors one of its layers), MLP width possibly own
        self.window = int(window)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        hidden, eps = config.hidden_size, config.rms_norm_eps
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # (q/k/v bias, o bias) as the target family's attention has them (Qwen2: biased q/k/v, plain o)
        qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        o_bias = config.model_type != "qwen2" and qkv_bias
        self._apply_rope = fam.apply_rotary_pos_emb  # (q, k, cos, sin) -> (q, k)
        self.rotary = getattr(fam, f"{prefix}RotaryEmbedding")(config)  # buffers only (not in the state dict)
        self._rope_table: tuple | None = None  # (cos, sin [P, d] of positions 0..P-1, what they were computed for)
        norm = getattr(fam, f"{prefix}RMSNorm")
        self.norm1 = norm(hidden, eps=eps)
        self.self_attn = _linears(q_proj=(hidden, q_dim, qkv_bias), k_proj=(hidden, kv_dim, qkv_bias),
                                  v_proj=(hidden, kv_dim, qkv_bias), o_proj=(q_dim, hidden, o_bias))
        self.norm2 = norm(hidden, eps=eps)
        # queries and output only: keys and values are the target's cached last-layer K/V
        self.cross_attn = _linears(q_proj=(hidden, q_dim, qkv_bias), o_proj=(q_dim, hidden, o_bias))
        self.norm3 = norm(hidden, eps=eps)
        self.mlp = getattr(fam, f"{prefix}MLP")(config)  # gate / up / down with the config's activation
        self._norm_cls = norm
        self.features: tuple[int, ...] = ()  # target decoder layers fused into the feature (empty: no features)
        if features:
            self.add_features(features)
        self._shared = (embed_tokens, lm_head)  # a tuple: nn.Module does not register (or save) these
        self.register_buffer("vocab", None, persistent=False)  # [K] target ids of the draft vocabulary (or None)
        self.register_buffer("head_rows", None, persistent=False)  # [K, H] rows of the head for ``vocab``
        # the same logits computed another way (a prepacked product: ``fastpath.draft``, on a drafter's private
        # copy of the block), or None: ``head`` multiplies by the rows itself
        self.head_fn = None
        # ``run``'s drafting calls computed another way (one compiled program: ``fastpath.compiled_block``, on a
        # drafter's private copy), called as program(block, ids, positions, own_allowed, past, past_allowed, target)
        self.program = None

    @property
    def embed_tokens(self) -> nn.Module:
        return self._shared[0]

    @property
    def lm_head(self) -> nn.Module:
        return self._shared[1]

    @classmethod
    def for_target(cls, target, window: int = DEFAULT_WINDOW, init: str = "random",
                   intermediate_size: int | None = None, features: tuple[int, ...] | None = None) -> "LongSpecDraft":
        """A block for ``target`` (a causal LM or ``LoadedModel``) on its device and dtype, sharing its embedding and
        head; ``intermediate_size``: the MLP width (default the target's, the paper's shape). ``init``: "random"
        (normal(0, initializer_range), as transformers initialises layers) or "identity" (the same, with every
        residual branch's output projection zeroed: logits = lm_head(embed(ids))). ``features``: target decoder
        layers whose outputs the block reads (module docstring; None: none)."""
        target = as_module(target)
        ref = target.get_input_embeddings().weight
        block = cls(target.config, target.get_input_embeddings(), target.get_output_embeddings(), window,
                    intermediate_size, features)
        block.to(device=ref.device, dtype=ref.dtype)
        block.reset_parameters(init)
        return block.eval()

    def add_features(self, layers) -> None:
        """Give the block target features from decoder ``layers`` (distinct indices, each below the target's last
        layer): ``fuse`` [H, n * H], ``norm_f``, ``feat_in`` [H, H] zero (the block computes what it did before),
        on the block's device and dtype."""
        layers = tuple(int(i) for i in layers)
        last = int(getattr(self.config, "num_hidden_layers", 0)) - 1
        if self.features:
            raise RetrospecError(f"this LongSpec block already reads target features (layers {self.features})")
        if not layers or len(set(layers)) != len(layers) or min(layers) < 0 or max(layers) >= last:
            raise RetrospecError(f"feature layers are distinct decoder layer indices in [0, {last}) (the last "
                                 f"layer's output is the head's input, normed), got {layers}")
        hidden = self.config.hidden_size
        ref = self.norm1.weight
        self.fuse = nn.Linear(len(layers) * hidden, hidden, bias=False).to(ref.device, ref.dtype)
        self.norm_f = self._norm_cls(hidden, eps=self.config.rms_norm_eps).to(ref.device, ref.dtype)
        self.feat_in = nn.Linear(hidden, hidden, bias=False).to(ref.device, ref.dtype)
        with torch.no_grad():
            self.fuse.weight.normal_(0.0, getattr(self.config, "initializer_range", 0.02))
            self.feat_in.weight.zero_()
        self.features = layers

    def target_feature(self, layer_states: torch.Tensor) -> torch.Tensor:
        """The target's outputs of the ``features`` layers [..., n, H] (in that order) -> the fused feature [..., H]:
        each layer's output RMS-normalised (a residual stream carries a few huge channels), then ``fuse``."""
        states = torch.nn.functional.rms_norm(layer_states, layer_states.shape[-1:], eps=self.config.rms_norm_eps)
        return self.fuse(states.flatten(-2))

    @torch.no_grad()
    def reset_parameters(self, init: str = "random") -> None:
        if init not in ("random", "identity"):
            raise ValueError(f"init must be 'random' or 'identity', got {init!r}")
        std = getattr(self.config, "initializer_range", 0.02)
        for mod in self.modules():
            if isinstance(mod, nn.Linear):
                mod.weight.normal_(0.0, std)
                if mod.bias is not None:
                    mod.bias.zero_()
        for norm in (self.norm1, self.norm2, self.norm3, *((self.norm_f,) if self.features else ())):
            norm.weight.fill_(1.0)
        if init == "identity":
            for lin in (self.self_attn.o_proj, self.cross_attn.o_proj, self.mlp.down_proj,
                        *((self.feat_in,) if self.features else ())):
                lin.weight.zero_()
                if lin.bias is not None:
                    lin.bias.zero_()

    @torch.no_grad()
    def set_vocab(self, ids) -> None:
        """Draft over the target ids ``ids`` (a sequence or [K] tensor of distinct ids) only; None: the full head."""
        if ids is None:
            self.vocab, self.head_rows = None, None
            return
        weight = self.lm_head.weight  # [V, H]
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).to(weight.device)
        if (ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= weight.shape[0]
                or ids.unique().numel() != ids.numel()):
            raise RetrospecError(f"a draft vocabulary holds distinct target ids in [0, {weight.shape[0]}); got "
                                 f"{ids.numel()} ids")
        if getattr(self.lm_head, "bias", None) is not None:
            raise RetrospecError("a draft vocabulary needs a head without bias")
        self.vocab = ids
        self.head_rows = weight.detach()[ids].clone()  # [K, H]

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.weight.shape[0] if self.vocab is None else int(self.vocab.numel())

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [..., K] (K = the draft vocabulary, or the target's V) of block outputs ``x`` [..., H]."""
        if self.head_fn is not None:
            return self.head_fn(x)
        return self.lm_head(x) if self.head_rows is None else x @ self.head_rows.T

    def token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Target token ids of logit columns (identity without a draft vocabulary)."""
        return columns if self.vocab is None else self.vocab[columns]

    def uses(self, target) -> bool:
        """True when this block reads ``target``'s own embedding and head modules."""
        target = as_module(target)
        return self.embed_tokens is target.get_input_embeddings() and self.lm_head is target.get_output_embeddings()

    # ------------------------------------------------------------------------------------------------------------
    # computation

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The family's rotary cos, sin [b, L, d] (``x``'s dtype) at ``positions`` [b, L]: rows of a table of
        positions 0..P-1 the rotary embedding computed once (grown by doubling), or the rotary embedding itself where
        its frequencies depend on the sequence (``dynamic``, ``longrope``) or a position is past ``ROPE_TABLE_MAX``."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        if getattr(self.rotary, "rope_type", "default") in ("dynamic", "longrope") or need > ROPE_TABLE_MAX:
            return self.rotary(x, positions)
        freq = getattr(self.rotary, "inv_freq", None)  # a module moved or cast since: its frequencies are new tensors
        stamp = (x.dtype, x.device, None if freq is None else freq.data_ptr())
        table = self._rope_table
        if table is None or table[0].shape[0] < need or table[2] != stamp:
            size = min(ROPE_TABLE_MAX, max(need, 1024, 2 * table[0].shape[0] if table is not None else 0))
            with torch.inference_mode(False), torch.no_grad():  # a plain tensor, usable in training too
                cos, sin = self.rotary(x, torch.arange(size, device=x.device)[None])  # [1, P, d]
            table = self._rope_table = (cos[0], sin[0], stamp)
        return table[0][positions], table[1][positions]

    def _heads(self, lin: nn.Linear, h: torch.Tensor, n_heads: int) -> torch.Tensor:
        b, n, _ = h.shape
        return lin(h).view(b, n, n_heads, self.head_dim).transpose(1, 2)  # [b, heads, L, d]

    def token_kv(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Self-attention keys (post-RoPE) and values of tokens ``ids`` [b, L] at ``positions`` [b, L]; each
        [b, kv_heads, L, head_dim]. They depend on nothing else (one layer), so committing needs no attention."""
        h = self.norm1(self.embed_tokens(ids))  # [b, L, H]
        cos, sin = self.rope(h, positions)  # [b, L, d]
        k = self._heads(self.self_attn.k_proj, h, self.num_kv_heads)
        return self._apply_rope(k, k, cos, sin)[1], self._heads(self.self_attn.v_proj, h, self.num_kv_heads)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, own_allowed: torch.Tensor,
            past: tuple[torch.Tensor, torch.Tensor] | KeyBuffer | None = None, past_allowed: torch.Tensor | None = None,
            target_kv: tuple[torch.Tensor, torch.Tensor] | KeyBuffer | None = None,
            cross_allowed: torch.Tensor | None = None,
            feature: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block over new tokens ``ids`` [b, L] at ``positions`` [b, L].

        Self-attention keys: ``past`` (k, v) [b, kv_heads, P, d] of earlier tokens (a ring buffer, tentative
        tokens), visible per ``past_allowed`` [b, L, P], then the new tokens' own, visible per ``own_allowed``
        [b, L, L]; k, v and ``past_allowed`` may each be a tuple of pieces along P (``grouped_attention``), or
        ``past`` a ``KeyBuffer`` (P = its ``filled``) that receives the new tokens' keys and values.
        Cross-attention: ``target_kv`` (k, v) [b, kv_heads, T, d], or a ``KeyBuffer`` holding T = ``filled``
        positions (read in place), visible per ``cross_allowed`` [b, L, T] (None: every entry visible to every new
        token). ``feature`` [b, L, H]: each new token's feature g (a block with ``features``; None: none given,
        nothing added). Returns (logits [b, L, K] (K: ``draft_vocab_size``), the new tokens' self-attention k and v
        [b, kv_heads, L, d], their outputs [b, L, H]: the feature of a token drafted below each). A drafting call
        (one sequence, both key sets ``KeyBuffer``s, every cached position visible, no feature, as many tokens as
        ``program.takes``) runs ``program`` where one is set."""
        b, n = ids.shape
        if isinstance(target_kv, KeyBuffer):
            if (self.program is not None and b == 1 and isinstance(past, KeyBuffer) and target_kv.filled > 0
                    and cross_allowed is None and feature is None and past.k.shape[0] == target_kv.k.shape[0] == 1
                    and self.program.takes(n)):
                return self.program(self, ids, positions, own_allowed, past, past_allowed, target_kv)
            target_kv = (target_kv.k[:, :, :target_kv.filled], target_kv.v[:, :, :target_kv.filled])
        x = self.embed_tokens(ids)  # [b, L, H]
        cos, sin = self.rope(x, positions)  # [b, L, d]
        h = self.norm1(x)
        q = self._heads(self.self_attn.q_proj, h, self.num_heads)  # [b, heads, L, d]
        k = self._heads(self.self_attn.k_proj, h, self.num_kv_heads)  # [b, kv_heads, L, d]
        v = self._heads(self.self_attn.v_proj, h, self.num_kv_heads)
        q, k = self._apply_rope(q, k, cos, sin)
        keys, values, allowed = (k,), (v,), (own_allowed,)
        if isinstance(past, KeyBuffer):  # the new keys written after the earlier ones; attention reads them in place
            end = past.filled + n
            past.k[:, :, past.filled:end], past.v[:, :, past.filled:end] = k, v
            keys, values = past.k[:, :, :end], past.v[:, :, :end]
            allowed = (*_pieces(past_allowed), own_allowed)
        elif past is not None:  # the earlier keys first, in pieces as given (grouped_attention joins them)
            keys, values = (*_pieces(past[0]), k), (*_pieces(past[1]), v)
            allowed = (*_pieces(past_allowed), own_allowed)
        x = x + self.self_attn.o_proj(grouped_attention(q, keys, values, allowed, self.scaling))
        if self.features and feature is not None:
            x = x + self.feat_in(self.norm_f(feature))
        h = self.norm2(x)
        if target_kv is not None and target_kv[0].shape[2] > 0:
            qc = self._heads(self.cross_attn.q_proj, h, self.num_heads)
            qc = self._apply_rope(qc, qc, cos, sin)[0]  # the target's keys carry RoPE at their own positions
            attn = grouped_attention(qc, target_kv[0], target_kv[1], cross_allowed, self.scaling)
        else:  # no target context: nothing visible, a zero attention output
            attn = h.new_zeros(b, n, self.num_heads * self.head_dim)
        x = x + self.cross_attn.o_proj(attn)
        x = x + self.mlp(self.norm3(x))
        return self.head(x), k, v, x

    def forward(self, input_ids: torch.Tensor, target_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                position_ids: torch.Tensor | None = None, shift: int | torch.Tensor = 1,
                feature: torch.Tensor | None = None) -> torch.Tensor:
        """Full-sequence forward (training, references): ``input_ids`` [b, L] -> logits [b, L, K].

        Self-attention: causal by index and ``self_visible`` by position (sliding window). ``target_kv``: the
        target's last-layer (keys, values) [b, kv_heads, T, d] of the same sequence, entry j = token j of
        ``input_ids``; the query at index i sees entries j <= i - shift. Visibility is by INDEX, not by position:
        with anchor-offset ``position_ids`` [b, L] (default 0..L-1) the two differ, and comparing cache indices
        with positions would show a query the target's K/V of tokens after it. ``feature`` [b, L, H]: see ``run``."""
        b, n = input_ids.shape
        idx = torch.arange(n, device=input_ids.device)[None].expand(b, n)  # [b, L]
        if position_ids is None:
            position_ids = idx
        causal = torch.ones(n, n, dtype=torch.bool, device=input_ids.device).tril()
        own = self_visible(position_ids, position_ids, self.window) & causal  # [b, L, L]
        cross = None if target_kv is None else cross_visible(idx, target_kv[0].shape[2], shift)
        return self.run(input_ids, position_ids, own, target_kv=target_kv, cross_allowed=cross, feature=feature)[0]
