"""The decoder's forward without the per-module machinery: the same operations on the same weights, fewer calls.

Why: once the matmuls read their weights at memory speed, what is left of a step is dispatch — transformers'
forward runs each decoder layer through module calls, decorators, keyword plumbing and output recorders, ~2,500
small operator calls per step for a 30-layer model, 40-60 % of a one-token step on a 2-core CPU with weight-only
matmuls. ``LeanDecoder`` runs the same layer math as a plain loop over the layers' weights:

    x = embed(ids); cos, sin = rotary(x, position_ids)          # the model's own rotary module (every rope type)
    per layer:  h = rmsnorm(x); q, k, v = proj(h)                # x, h [T, H]; q [1, heads, T, head_dim] reshaped
                (Qwen3: q, k = q_norm(q), k_norm(k))
                q, k = rope(q, k, cos, sin); k, v = cache.update(k, v, layer)
                x = x + o_proj(attention(q, k, v))               # the engine's attention (``prefix_block``)
                x = x + down(silu(gate(rmsnorm(x))) * up(rmsnorm(x)))
    out = norm(x)                                                # [T, H] = transformers' last_hidden_state

Every operation is the one transformers' Llama-family layer applies, in the same order and dtype, with fewer
dispatches where a probe shows the same bits: a plain ``nn.Linear`` is the ``mm``/``addmm`` its ``F.linear`` ends in
(``project``; other layers are their own ``forward``), an RMSNorm torch's fused ``F.rms_norm`` (else the module),
rotary ``x * cos + x.roll(d / 2) * signed_sin`` (``_rope``: 4 kernels instead of 7). The result equals the module
forward bitwise in the tests' families (asserted with ``torch.equal`` for Llama, Qwen2 and Qwen3, in float32 and the
weight-only formats). Nothing of transformers is copied or patched: this is our loop over its public modules.

Weight-only formats also join the projections that share an input (q/k/v; gate/up) into one kernel call each
(``fuse``: kept only where the joined call gives each part's bits, checked at build), 4 matmul calls a layer
instead of 7: with 4-bit weights a small projection's call costs several times its memory traffic.

Scope (``LeanDecoder.supports``): model types in ``LEAN_MODEL_TYPES`` with full attention in every layer (no sliding
window), SiLU-gated MLPs, no tensor-parallel split, an attention implementation whose function is the engine's
``prefix_block``, and a masks the engine passes itself (none, or a 4D tree mask). Anything else runs as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import prefix_block
from ..weight_only import WeightOnlyLinear
from . import compiled
from .aot import MAX_ROWS

LEAN_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def fuse(linears: list[torch.nn.Module]) -> WeightOnlyLinear | None:
    """One weight-only layer computing ``linears`` (same format, same input) side by side: [..., in] -> [..., sum of
    outs], or None where they cannot be joined or the joined layer does not give each part's bits (checked on a
    probe: the kernels compute each output column alone, so it does wherever the packing concatenates by rows).
    Costs a second copy of those weights; saves per-call overhead and one activation cast per part."""
    first = linears[0]
    if not all(type(m) is WeightOnlyLinear and m.fmt == first.fmt and m.in_features == first.in_features
               for m in linears):
        return None
    if any(m.bias is not None for m in linears) and not all(m.bias is not None for m in linears):
        return None
    scale_dim = 1 if first.fmt == "int4" else 0  # int4: [in / GROUP, out, 2] | int8, w8a8: [out] | w4a8: by tile
    joined = WeightOnlyLinear(first.fmt, first.in_features, sum(m.out_features for m in linears),
                              torch.cat([m.qweight for m in linears]),
                              torch.cat([m.scales for m in linears], dim=scale_dim).contiguous(),
                              None if first.bias is None else torch.cat([m.bias for m in linears]))
    probe = torch.randn(3, first.in_features, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        if not torch.equal(joined(probe), torch.cat([m(probe) for m in linears], dim=-1)):
            return None
    return joined


def project(linear: torch.nn.Module):
    """A callable computing ``linear`` on 2D rows [M, in] -> [M, out]: for a plain ``nn.Linear`` the one BLAS call
    ``F.linear`` reaches (``mm``, or ``addmm`` with a bias, on the transposed weight view), without its dispatch
    through ``linear`` / ``matmul`` / reshapes (~3 us of a ~12 us call for a one-row projection); kept only where a
    probe gives the module's bits. Any other layer (prepacked, weight-only) is its own forward."""
    if type(linear) is not torch.nn.Linear:
        return linear.forward
    wt, bias = linear.weight.t(), linear.bias  # a view: no copy
    fn = (lambda x: torch.mm(x, wt)) if bias is None else (lambda x: torch.addmm(bias, x, wt))
    with torch.inference_mode():
        for rows in (1, 3):
            probe = torch.randn(rows, linear.in_features, generator=torch.Generator().manual_seed(rows))
            probe = probe.to(device=linear.weight.device, dtype=linear.weight.dtype)
            if not torch.equal(fn(probe), linear(probe.unsqueeze(0))[0]):
                return linear.forward
    return fn


def rms_params(norm: torch.nn.Module) -> tuple[torch.Tensor | None, float | None]:
    """(weight [H], eps) where torch's one fused ``F.rms_norm`` gives ``norm``'s bits on a probe here (it does on the
    CPUs tried: same float32 reduction), else (None, None)."""
    weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if weight is None or eps is None or weight.dim() != 1:
        return None, None
    probe = torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    with torch.inference_mode():
        if not torch.equal(F.rms_norm(probe, (weight.shape[0],), weight, eps), norm(probe)):
            return None, None
    return weight, eps


def rms_norm(norm: torch.nn.Module):
    """A callable computing ``norm`` (an RMSNorm module): ``F.rms_norm`` where ``rms_params`` allows, else the
    module's own forward."""
    return _norm_call(norm, *rms_params(norm))


def _norm_call(norm: torch.nn.Module, weight: torch.Tensor | None, eps: float | None):
    if weight is None:
        return norm.forward
    shape = (weight.shape[0],)
    return lambda x: F.rms_norm(x, shape, weight, eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` in fewer kernels, bitwise: ``rotate_half(x) = cat(-x2, x1)``
    and ``x.roll(d / 2) = cat(x2, x1)``, so ``rotate_half(x) * sin == x.roll(d / 2) * cat(-sin1, sin2)`` exactly
    (negation commutes with rounding). ``signed_sin`` = ``cat(-sin1, sin2)``, built once per forward."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class _Layer:
    """One decoder layer's pieces, looked up once."""

    __slots__ = ("norm1", "norm2", "q", "k", "v", "o", "gate", "up", "down", "q_norm", "k_norm", "attn", "index",
                 "qkv", "gate_up", "splits", "norm_params", "qkv_modules", "mlp_modules")

    def __init__(self, layer: torch.nn.Module, index: int):
        attn, mlp = layer.self_attn, layer.mlp
        self.attn, self.index = attn, index
        self.norm_params = (rms_params(layer.input_layernorm), rms_params(layer.post_attention_layernorm))
        self.norm1 = _norm_call(layer.input_layernorm, *self.norm_params[0])
        self.norm2 = _norm_call(layer.post_attention_layernorm, *self.norm_params[1])
        self.q, self.k, self.v, self.o = map(project, (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
        self.gate, self.up, self.down = map(project, (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        self.q_norm = attn.q_norm.forward if hasattr(attn, "q_norm") else None
        self.k_norm = attn.k_norm.forward if hasattr(attn, "k_norm") else None
        qkv = fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up = fuse([mlp.gate_proj, mlp.up_proj])
        self.qkv = None if qkv is None else qkv.forward
        self.gate_up = None if gate_up is None else gate_up.forward
        self.qkv_modules = [qkv] if qkv is not None else [attn.q_proj, attn.k_proj, attn.v_proj]  # as computed
        self.mlp_modules = [gate_up] if gate_up is not None else [mlp.gate_proj, mlp.up_proj]
        self.splits = ([attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features],
                       [mlp.gate_proj.out_features, mlp.up_proj.out_features])


class LeanDecoder:
    """``decoder``'s forward as a plain loop (see the module docstring); ``decoder`` is the engine's private copy.
    ``compiled``: each layer as one compiled program (``fastpath.compiled``), when the engine built them; the loop
    then runs them for every forward over its cache that already holds positions (the prefill stays eager)."""

    def __init__(self, decoder: torch.nn.Module):
        cfg = decoder.config
        self.embed = decoder.embed_tokens
        self.rotary = decoder.rotary_emb
        self.norm = rms_norm(decoder.norm)
        self.layers = [_Layer(layer, i) for i, layer in enumerate(decoder.layers[: cfg.num_hidden_layers])]
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.compiled = None  # fastpath.compiled.CompiledLayers

    @staticmethod
    def _attention_bias(attention_mask, rows: int, length: int) -> torch.Tensor:
        """[T, L] 0 / -inf for the compiled layers: causal over the cache, or a 4D tree mask's [1, 1, T, L] block."""
        if attention_mask is None:
            return compiled.chain_bias(rows, length)
        block = attention_mask[0, 0]  # [T, L]
        seen = block if block.dtype == torch.bool else block == 0
        return torch.zeros(rows, length).masked_fill_(~seen, float("-inf"))

    def pre_eager(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, H]; cos / signed sin [1, 1, T, d] -> q [1, heads, T, d], k / v [1, kvh, T, d] (rotary applied)."""
        t = x.shape[0]
        h = layer.norm1(x)
        if layer.qkv is not None and layer.q_norm is None:  # one call, and rotary over q and k heads at once
            qkv = layer.qkv(h).view(1, t, self.heads + 2 * self.kv_heads, self.head_dim).transpose(1, 2)
            qk = qkv[:, : self.heads + self.kv_heads]  # [1, heads + kvh, T, d]
            qk = _rope(qk, cos, sin)  # elementwise: each head's bits as if rotated alone
            return qk[:, : self.heads], qk[:, self.heads:], qkv[:, self.heads + self.kv_heads:]
        if layer.qkv is not None:  # [T, q + k + v features] in one call
            q, k, v = layer.qkv(h).split(layer.splits[0], dim=-1)
        else:
            q, k, v = layer.q(h), layer.k(h), layer.v(h)
        q, k = q.view(1, t, self.heads, self.head_dim), k.view(1, t, self.kv_heads, self.head_dim)
        v = v.view(1, t, self.kv_heads, self.head_dim).transpose(1, 2)  # [1, kvh, T, d]
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [1, heads, T, d], [1, kvh, T, d]
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    @staticmethod
    def post_eager(layer: _Layer, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """x [T, H], the attention's output a [T, heads * d] -> the layer's output [T, H]."""
        x = x + layer.o(a)
        h = layer.norm2(x)
        if layer.gate_up is not None:
            g, u = layer.gate_up(h).split(layer.splits[1], dim=-1)
        else:
            g, u = layer.gate(h), layer.up(h)
        return x + layer.down(F.silu(g) * u)

    @staticmethod
    def supports(decoder: torch.nn.Module) -> bool:
        cfg = getattr(decoder, "config", None)
        if getattr(cfg, "model_type", None) not in LEAN_MODEL_TYPES:
            return False
        if getattr(cfg, "_attn_implementation", None) != prefix_block.ATTN_NAME:
            return False
        if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "pretraining_tp", 1) not in (None, 1):
            return False
        if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
            return False
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) \
                and cfg.model_type == "mistral":
            return False
        layers = getattr(decoder, "layers", None)
        if not layers or not all(hasattr(decoder, n) for n in ("embed_tokens", "rotary_emb", "norm")):
            return False
        for layer in layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if attn is None or mlp is None or not hasattr(layer, "input_layernorm") \
                    or not hasattr(layer, "post_attention_layernorm"):
                return False
            if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")):
                return False
            if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
                return False
            if type(getattr(mlp, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
                return False
        return True

    def __call__(self, ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache,
                 want_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """ids/position_ids [1, T] -> (normed last hidden state [T, H], {layer index: its output [T, H]}).
        ``attention_mask``: None (causal over the cache) or a 4D tree mask [1, 1, T, L]."""
        t = ids.shape[1]
        x = self.embed(ids)  # [1, T, H]
        cos, sin = self.rotary(x, position_ids)  # [1, T, head_dim] each
        x = x[0]  # [T, H]: activations stay 2D (rows) through the layers
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [1, 1, T, head_dim]
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # signed, for ``_rope``
        wanted: dict[int, torch.Tensor] = {}
        fast = self.compiled if self.compiled is not None and t <= MAX_ROWS else None
        if fast is not None:
            cos2, sin2 = cos[0, 0], sin[0, 0]  # [T, head_dim]
        bias = None  # the compiled layers' mask, built at the first layer (it needs the length)
        cached = getattr(cache, "layers", ())  # the cache's layers (transformers may add them on first update)
        for layer in self.layers:
            layer_cache = cached[layer.index] if layer.index < len(cached) else None
            if fast is not None and getattr(layer_cache, "length", 0) > 0 and hasattr(layer_cache, "reserve"):
                if bias is None:
                    bias = self._attention_bias(attention_mask, t, layer_cache.length + t)  # [T, L]
                kbuf, vbuf = layer_cache.reserve(t)  # [1, kvh, C, d]
                x = fast.run_layer(layer.index, x, cos2, sin2, kbuf, vbuf, bias)  # writes [L - T, L)
                layer_cache.advance(t)
            else:  # the prefill, other caches: the eager layer
                q, k, v = self.pre_eager(layer, x, cos, sin)
                k, v = cache.update(k, v, layer.index)
                a, _ = prefix_block.prefix_block_attention(layer.attn, q, k, v, attention_mask,
                                                           scaling=layer.attn.scaling)  # [1, T, heads, d]
                x = self.post_eager(layer, x, a.reshape(t, -1))  # a [T, heads * d]
            if layer.index in want_layers:
                wanted[layer.index] = x
        return self.norm(x), wanted
