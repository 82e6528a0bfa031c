"""int8 storage (``models.quant``): the round trip stays within half a scale step per weight, zero rows and 1-D
tensors are handled, malformed packed dicts are refused with one line, and matrices take ~1/4 of their float32
bytes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save

from retrospec.errors import RetrospecError
from retrospec.models.quant import SCALE_SUFFIX, is_packed, max_abs_difference, pack_int8, unpack_int8

torch.set_num_threads(1)


def sample_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(48, 64, generator=g)
    w[3] = 0.0  # a zero row
    w[5] *= 1e-6  # a tiny row (LoRA B-like): its scale must not underflow
    w[7, 11] = 40.0  # an outlier: only its own row gets a coarse grid
    return {"lin.weight": w, "lin.bias": torch.randn(48, generator=g), "norm.weight": 1 + torch.randn(64, generator=g),
            "conv.weight": torch.randn(8, 3, 5, generator=g), "lora_B.weight": 1e-3 * torch.randn(64, 8, generator=g),
            "half.weight": torch.randn(16, 32, generator=g).to(torch.bfloat16), "count": torch.arange(5)}


def test_round_trip_within_half_a_step():
    state = sample_state()
    packed = pack_int8(state)
    assert is_packed(packed) and not is_packed(state)
    for name in ("lin.weight", "conv.weight", "lora_B.weight", "half.weight"):
        q, s = packed[name], packed[name + SCALE_SUFFIX]
        assert q.dtype == torch.int8 and q.shape == state[name].shape and int(q.abs().max()) <= 127
        assert s.shape == (state[name].shape[0],) and bool((s > 0).all())
        w = state[name].float().reshape(q.shape[0], -1)
        assert bool((s.float() >= w.abs().amax(1) / 127).all())  # rounded up: nothing clipped
        assert bool((s.float() <= (w.abs().amax(1) / 127) * (1 + 2 ** -7) + (w.abs().amax(1) == 0)).all())
    out = unpack_int8(packed)
    assert set(out) == set(state)
    for name in ("lin.weight", "conv.weight", "lora_B.weight", "half.weight"):
        s = packed[name + SCALE_SUFFIX].float()
        err = (out[name] - state[name].float()).reshape(s.shape[0], -1).abs()
        assert out[name].dtype == torch.float32 and out[name].shape == state[name].shape
        assert bool((err <= s[:, None] / 2 * (1 + 1e-5)).all()), name
    w = state["lin.weight"]
    assert torch.equal(out["lin.weight"][3], torch.zeros(64)) and packed["lin.weight.int8_scale"][3] == 1
    assert (out["lin.weight"][5] - w[5]).abs().max() <= w[5].abs().max() / 254 * 1.01  # a tiny row: same precision
    assert torch.isfinite(out["lin.weight"]).all()
    for name in ("lin.bias", "norm.weight"):  # 1-D: float16
        assert packed[name].dtype == torch.float16 and name + SCALE_SUFFIX not in packed
        torch.testing.assert_close(out[name], state[name], atol=0, rtol=2 ** -11)
    assert torch.equal(out["count"], state["count"]) and out["count"].dtype == torch.int64
    assert unpack_int8(packed, dtype=torch.bfloat16)["lin.weight"].dtype == torch.bfloat16
    assert max_abs_difference(state, out) == pytest.approx(
        max(float((out[k] - state[k].float()).abs().max()) for k in state if state[k].is_floating_point()))
    assert sample_state()["lin.weight"].equal(state["lin.weight"])  # the input is not modified


def test_byte_size_about_a_quarter_of_float32():
    state = {"a": torch.randn(256, 512), "b": torch.randn(512, 256)}
    fp32 = len(save(state))
    int8 = len(save(pack_int8(state)))
    assert 0.24 < int8 / fp32 < 0.27


def test_malformed_packed_dicts_are_refused():
    packed = pack_int8({"w": torch.randn(4, 6), "b": torch.randn(4)})
    cases = {
        "has no tensor": {k: v for k, v in packed.items() if k != "w"},
        "has no scale": {k: v for k, v in packed.items() if k != "w.int8_scale"},
        "expected one floating value per row": packed | {"w.int8_scale": torch.ones(3, dtype=torch.bfloat16)},
        "not int8": packed | {"w": torch.randn(4, 6)},
        "zero, negative or non-finite": packed | {"w.int8_scale": torch.tensor([1.0, 0.0, 1.0, 1.0])},
    }
    for fragment, bad in cases.items():
        with pytest.raises(RetrospecError, match=fragment) as err:
            unpack_int8(bad)
        assert "\n" not in str(err.value)
    with pytest.raises(RetrospecError, match="NaN"):
        pack_int8({"w": torch.tensor([[1.0, float("nan")]])})
    with pytest.raises(RetrospecError, match="reserved"):
        pack_int8({"w.int8_scale": torch.ones(2, 2)})
    with pytest.raises(RetrospecError, match="float16"):
        pack_int8({"b": torch.tensor([1e6])})
