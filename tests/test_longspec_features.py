"""LongSpec blocks that read the target's features (EAGLE-3-style fused layer outputs, training-time test).

- a block given features starts out computing what it did (``feat_in`` zero); a corrupt feature list is refused;
- the target's layer outputs handed over by the engine equal transformers' ``hidden_states`` (module and lean loops);
- the ring state with features equals the full-sequence forward: the root reads the target's fused feature, each
  drafted token its parent's output (chains and trees);
- greedy output equals the oracle (chain, tree, with the lookup branch); seeded sampling commits tokens distributed
  as the target's (chi-square); the drafts do depend on the features (power);
- save / load (float32 and int8 storage) keeps the features; distillation with features and training-time test
  (2 passes) saves a block that loads and stays lossless; bad flags are one line.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import sharpen, tiny_llama, tiny_qwen2
from test_engine_sampling import chisq_pvalue
from test_longspec import V, first_pairs
from test_longspec_distill import tiny_corpus

from retrospec.config import SamplingConfig
from retrospec.decode import autoregressive_generate, speculative_generate
from retrospec.drafters.base import DecodeContext
from retrospec.drafters.longspec import LongSpecDrafter
from retrospec.errors import RetrospecError
from retrospec.fastpath import engine_for
from retrospec.kv import KVCache
from retrospec.models import load_model
from retrospec.models.longspec import DraftState, LongSpecDraft, load_longspec, save_longspec
from retrospec.sampling import probs_from_logits
from retrospec.train.longspec import draft_logits, feature_passes, target_logits
from retrospec.train.longspec_distill import DistillConfig, check_config, distill_longspec
from retrospec.types import SpecStats
from retrospec.verify import Verifier

torch.set_num_threads(1)

GREEDY = SamplingConfig(temperature=0.0)
PROMPT = [5, 17, 3, 42, 8, 17, 3, 42, 8, 61, 5, 17]
ALPHA = 1e-3


def featured(target, layers=(0, 1), window: int = 8, std: float = 0.1, seed: int = 0) -> LongSpecDraft:
    """A block reading ``layers`` with every weight random (so the features change the logits)."""
    block = LongSpecDraft.for_target(target, window=window, features=layers)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g) if "norm" in name
                    else std * torch.randn(p.shape, generator=g))
    return block


@pytest.fixture(params=["llama", "qwen2"])
def target3(request):
    return (tiny_llama if request.param == "llama" else tiny_qwen2)(layers=3)


def test_added_features_start_as_the_block_was(target3):
    block = LongSpecDraft.for_target(target3, window=8)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.05 * torch.randn(p.shape))
        ids, kv = torch.tensor([PROMPT]), target_logits(target3, torch.tensor([PROMPT]), torch.arange(12)[None])[1]
        before = block(ids, kv)
        block.add_features((0, 1))
        states = target_logits(target3, ids, torch.arange(12)[None], layers=(0, 1))[2]  # [1, L, 2, H]
        assert states.shape == (1, 12, 2, 32)
        assert torch.equal(block(ids, kv, feature=block.target_feature(states)), before)
    for bad in ((2,), (0, 0), (-1,), ()):  # the last layer's output is the head's input: not a feature layer
        with pytest.raises(RetrospecError, match="feature layers"):
            LongSpecDraft.for_target(target3, features=bad or None).add_features(bad)
    with pytest.raises(RetrospecError, match="already reads"):
        block.add_features((0,))


@pytest.mark.parametrize("how", ["off", None])
def test_engine_layer_outputs_equal_transformers_hidden_states(target3, how):
    engine = engine_for(target3, how)
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        logits, layers = engine.forward(ids, torch.arange(12)[None], None, KVCache(engine.module).cache,
                                        want_hidden=(1, 0))
        ref = target3(input_ids=ids, output_hidden_states=True)
    assert layers.shape == (12, 2, 32)
    assert torch.allclose(layers[:, 0], ref.hidden_states[2][0], atol=1e-5)
    assert torch.allclose(layers[:, 1], ref.hidden_states[1][0], atol=1e-5)
    assert torch.allclose(logits, ref.logits[0], atol=1e-4)


def test_state_with_features_equals_full_forward(target3):
    """Root: the target's fused feature of the last committed position; a drafted token: its parent's output."""
    block = featured(target3)
    t = 9
    ids = torch.tensor([PROMPT[:t]])
    with torch.no_grad():
        _, cache, states = target_logits(target3, ids, torch.arange(t)[None], layers=block.features)
        root_feature = block.target_feature(states[0, -1])  # [H]
        state = DraftState(block)
        state.append(PROMPT[:t - 1])
        cache = tuple(x[:, :, :t - 1] for x in cache)  # the target cache: every committed token but the root
        rows = [state.speculate([PROMPT[t - 1]], [-1], cache, root_feature=root_feature)[0]]
        rows += list(state.speculate([11, 23], [0, 0], cache, root_feature=root_feature))  # tentative 1, 2
        rows += list(state.speculate([40, 9], [1, 2], cache, root_feature=root_feature))  # 3, 4
        with pytest.raises(ValueError, match="same call"):
            state.speculate([1, 2], [4, 5], cache)
        paths = {0: ([PROMPT[t - 1]], -1), 1: ([11], 0), 2: ([23], 0), 3: ([40], 1), 4: ([9], 2)}
        outs = {}
        for node, (tok, parent) in paths.items():
            path, p = [], node
            while p >= 0:
                path = paths[p][0] + path
                p = paths[p][1]
            seq = torch.tensor([PROMPT[:t - 1] + path])
            feature = torch.zeros(1, seq.shape[1], 32)
            feature[0, -1] = root_feature if parent < 0 else outs[parent]
            logits, x = draft_logits(block, seq, torch.arange(seq.shape[1])[None], cache, 1, feature=feature,
                                     outputs=True)
            outs[node] = x[0, -1]
            assert torch.allclose(rows[node], logits[0, -1], atol=1e-5), node


class Recording(LongSpecDrafter):
    """Keeps (the committed tokens, the root's feature) of every drafting step."""

    def propose(self, ctx, budget):
        tree = super().propose(ctx, budget)
        if budget > 0 and self.root_feature is not None:
            self.seen.append((list(ctx.tokens), self.root_feature.clone()))
        return tree

    def prefill(self, ctx):
        self.seen = []
        super().prefill(ctx)


@pytest.mark.parametrize("mode", [{"gamma": 4}, {"tree": (4, 8, 8)}, {"tree": (4, 8), "lookup": 4}],
                         ids=["chain", "tree", "tree+lookup"])
def test_greedy_equals_oracle_and_features_matter(target3, mode):
    block = featured(target3)
    want = autoregressive_generate(target3, PROMPT, sampling=GREEDY, max_new_tokens=30)
    drafter = Recording(block, **mode)
    assert drafter.needs == {"target_kv", "layer_states"} and drafter.feature_layers == (0, 1)
    stats = SpecStats()
    got = [t for c in speculative_generate(target3, drafter, PROMPT, sampling=GREEDY, max_new_tokens=30,
                                           stats=stats) for t in c]
    assert got == want and stats.new_tokens == stats.target_calls + stats.accepted_tokens
    # each root's feature: the target's fused layer outputs at the row that produced the root
    assert len(drafter.seen) >= 3
    with torch.no_grad():
        for tokens, feature in drafter.seen:
            states = target_logits(target3, torch.tensor([tokens[:-1]]), torch.arange(len(tokens) - 1)[None],
                                   layers=(0, 1))[2]
            assert torch.allclose(feature, block.target_feature(states[0, -1]), atol=1e-4)
    # power: the same block, state and context without the target's features drafts another tree
    verifier = Verifier(target3, want_hidden=(0, 1))
    verifier.prefill(PROMPT[:-1])
    ctx = DecodeContext(tokens=list(PROMPT), prompt_len=len(PROMPT), sampling=GREEDY)
    ctx.target.kv = verifier.kv
    drafter.prefill(ctx)
    trees = []
    for states in (verifier.last_hidden[-1], None):
        ctx.target.layer_states = states
        trees.append(drafter.propose(ctx, 20).tokens.tolist())
    assert trees[0] != trees[1]


def test_sampling_with_features_follows_the_target():
    """Seeded runs at temperature 1 through a feature block's trees: the first two tokens ~ p(x1) p(x2 | x1)."""
    v = V
    target = sharpen(tiny_llama(seed=11, layers=2, hidden=16, vocab=v), 8.0)
    block = featured(target, layers=(0,), window=4, std=0.3)
    prompt = [p % v for p in PROMPT[:4]]
    with torch.inference_mode():
        base = torch.tensor(prompt)
        one = torch.stack([torch.cat([base, torch.tensor([a])]) for a in range(v)])
        p1 = probs_from_logits(target(input_ids=base[None]).logits[0, -1], SamplingConfig(temperature=1.0)).double()
        p2 = probs_from_logits(target(input_ids=one).logits[:, -1], SamplingConfig(temperature=1.0)).double()
    drafter = LongSpecDrafter(block, tree=(4, 6, 6))
    runs = 1_000
    counts = first_pairs(target, drafter, prompt, runs)
    assert chisq_pvalue([(counts, (p1[:, None] * p2).numpy() * runs)]) > ALPHA


@pytest.mark.parametrize("storage", [None, "int8"])
def test_save_load_keeps_the_features(target3, tmp_path, storage):
    block = featured(target3, layers=(1,))
    out = save_longspec(block, target3, tmp_path / "blk", storage=storage)
    assert json.loads((out / "longspec.json").read_text())["block"]["features"] == [1]
    loaded = load_longspec(out, target3)
    assert loaded.features == (1,)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        _, kv, states = target_logits(target3, ids, torch.arange(12)[None], layers=(1,))
        a, b = (m(ids, kv, feature=m.target_feature(states)) for m in (block, loaded))
    assert torch.equal(a, b) if storage is None else torch.allclose(a, b, atol=0.05)
    meta = json.loads((out / "longspec.json").read_text())
    meta["block"]["features"] = "1"
    (out / "longspec.json").write_text(json.dumps(meta))
    with pytest.raises(RetrospecError, match="features"):
        load_longspec(out, target3)


def test_distill_with_features_and_training_time_test(saved_models, tmp_path, cli):
    target = load_model(saved_models.target)
    tiny_corpus(target, tmp_path / "corpus")
    out = tmp_path / "block"
    dc = DistillConfig(target=str(saved_models.target), corpus=str(tmp_path / "corpus"), out=str(out),
                       draft_vocab=24, max_len=48, batch_tokens=96, heldout=0.3, eval_records=4, curve=(),
                       max_positions=256, storage=None, features=(0,), ttt=2, precision="float32")
    manifest = distill_longspec(dc, log=lambda *_: None, target=target)
    assert manifest["steps"] >= 1 and manifest["config"]["ttt"] == 2
    block = load_longspec(out, target)
    assert block.features == (0,) and block.feat_in.weight.abs().sum() > 0  # the feature path trained
    with torch.no_grad():  # two passes: the second reads the first's outputs, and differs from it
        ids = torch.tensor([target.tokenizer.encode("def h(x):\n    return x")])
        pos = torch.arange(ids.shape[1])[None]
        _, kv, states = target_logits(target, ids, pos, layers=(0,))
        one, two = feature_passes(block, ids, pos, kv, states, 1, 2)
        assert not torch.allclose(one, two)
    prompt = target.tokenizer.encode("def h(x):\n    return")
    want = autoregressive_generate(target.model, prompt, sampling=GREEDY, max_new_tokens=16)
    for mode in ({"gamma": 3}, {"tree": (3, 3)}):
        got = [t for c in speculative_generate(target.model, LongSpecDrafter(block, **mode), prompt, sampling=GREEDY,
                                               max_new_tokens=16) for t in c]
        assert got == want
    # the CLI: --ttt needs features; features are layers below the last
    with pytest.raises(RetrospecError, match="--ttt"):
        check_config(DistillConfig(**{**dc.__dict__, "out": str(tmp_path / "x"), "features": None}))
    cli("train", "longspec-distill", "--target", str(saved_models.target), "--corpus", str(tmp_path / "corpus"),
        "--out", str(tmp_path / "y"), "--features", "1", "--max-len", "48", "--batch-tokens", "96"
        ).assert_user_error("feature layers")
    cli("train", "longspec-distill", "--target", str(saved_models.target), "--corpus", str(tmp_path / "corpus"),
        "--out", str(tmp_path / "z"), "--features", "a,b").assert_user_error("layer indices")
