"""Tree verification and the KV cache: a tree forward scores every node exactly as a chain forward of its path would,
``Verifier.commit`` of a non-contiguous accepted path leaves the cache a fresh prefill would build, and
``KVCache.crop`` / ``keep`` behave."""

from __future__ import annotations

import pytest
import torch

from retrospec.errors import RetrospecError
from retrospec.kv import KVCache
from retrospec.tree import merge_sequences
from retrospec.types import DraftTree
from retrospec.verify import Verifier

ATOL = 1e-4
PROMPT = [5, 17, 3, 42, 8, 61, 29, 11, 70]
ROOT = 33
#                 node: 0   1   2   3   4   5   6   7   8   9
TREE_TOKENS = [12, 40, 7, 12, 9, 55, 3, 81, 40, 2]
TREE_PARENTS = [-1, -1, 0, 0, 1, 2, 2, 4, -1, 6]  # three root children (40 twice: at node 1 and node 8)


def path_to(parents: torch.Tensor, node: int) -> list[int]:
    """Node indices from the root's child down to ``node``."""
    path, par = [], parents.tolist()
    while node >= 0:
        path.append(node)
        node = par[node]
    return path[::-1]



def make_tree() -> DraftTree:
    return DraftTree(torch.tensor(TREE_TOKENS), torch.tensor(TREE_PARENTS))


@torch.inference_mode()
def chain_forward(model, ids: list[int]):
    """Fresh forward, no cache: (logits [T, V], last hidden state [T, H])."""
    out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0], out.hidden_states[-1][0]


def fresh_cache(model, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    v = Verifier(model)
    v.prefill(ids)
    return [(k.clone(), val.clone()) for k, val in v.kv.layer_tensors()]


def assert_cache_equal(got, want, atol=1e-5):
    assert len(got) == len(want) > 0
    for (k, v), (k2, v2) in zip(got, want):
        assert k.shape == k2.shape and v.shape == v2.shape
        torch.testing.assert_close(k, k2, atol=atol, rtol=1e-4)
        torch.testing.assert_close(v, v2, atol=atol, rtol=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# (a) tree forward == per-path chain forwards


def test_tree_forward_equals_chain_forwards(target):
    tree = make_tree()
    assert not tree.is_chain
    v = Verifier(target, want_hidden=True)
    v.prefill(PROMPT)
    logits = v.score(ROOT, tree)  # [1 + N, V]
    hidden = v.last_hidden  # [1 + N, H]
    assert logits.shape == (1 + len(tree), target.config.vocab_size)
    ref_logits, ref_hidden = chain_forward(target, PROMPT + [ROOT])
    torch.testing.assert_close(logits[0], ref_logits[-1], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(hidden[0], ref_hidden[-1], atol=ATOL, rtol=1e-4)
    for i in range(len(tree)):
        path = [TREE_TOKENS[j] for j in path_to(tree.parents, i)]
        ref_logits, ref_hidden = chain_forward(target, PROMPT + [ROOT] + path)
        torch.testing.assert_close(logits[i + 1], ref_logits[-1], atol=ATOL, rtol=1e-4, msg=f"node {i}")
        torch.testing.assert_close(hidden[i + 1], ref_hidden[-1], atol=ATOL, rtol=1e-4, msg=f"node {i}")
    torch.testing.assert_close(logits[1 + 1], logits[1 + 8], atol=ATOL, rtol=1e-4)  # duplicate siblings agree
    # the same token at a different depth / under a different parent gives a different row: the mask matters
    assert not torch.allclose(logits[1 + 0], logits[1 + 3], atol=1e-3)  # token 12 at depth 1 vs depth 2


def test_chain_score_equals_chain_forward(target):
    v = Verifier(target)
    v.prefill(PROMPT)
    chain = [4, 90, 4, 16]
    logits = v.score(ROOT, DraftTree.chain(chain))
    ref, _ = chain_forward(target, PROMPT + [ROOT] + chain)
    torch.testing.assert_close(logits, ref[len(PROMPT):], atol=ATOL, rtol=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# (b) commit of a non-contiguous path == fresh prefill; later steps still match the oracle


@pytest.mark.parametrize("accepted_leaf", [7, 9, 8, None], ids=["path-1-4-7", "path-0-2-6-9", "node-8", "none"])
def test_commit_non_contiguous_path_equals_fresh_prefill(target, accepted_leaf):
    tree = make_tree()
    v = Verifier(target)
    v.prefill(PROMPT)
    logits = v.score(ROOT, tree)
    path = [] if accepted_leaf is None else path_to(tree.parents, accepted_leaf)
    if accepted_leaf in (7, 9):
        assert path != list(range(len(path)))  # really non-contiguous in node order
    v.commit(path)
    committed = PROMPT + [ROOT] + [TREE_TOKENS[i] for i in path]
    assert len(v.kv) == len(committed)
    assert_cache_equal(v.kv.layer_tensors(), fresh_cache(target, committed))

    # the next step: a chain below the next root, scored against a fresh forward of the whole sequence
    nxt = int(logits[(path[-1] + 1) if path else 0].argmax())
    chain = [int(t) for t in torch.randint(0, target.config.vocab_size, (3,), generator=torch.Generator().manual_seed(1))]
    got = v.score(nxt, DraftTree.chain(chain))
    ref, _ = chain_forward(target, committed + [nxt] + chain)
    torch.testing.assert_close(got, ref[len(committed):], atol=ATOL, rtol=1e-4)
    v.commit([0, 1])  # contiguous: a crop
    committed += [nxt] + chain[:2]
    assert_cache_equal(v.kv.layer_tensors(), fresh_cache(target, committed))


def test_repeated_tree_steps_follow_the_oracle(target):
    """Several tree steps in a row, each committing a random root-to-node path: after each commit the cache equals a
    fresh prefill, and every scored row equals a chain forward of its path."""
    g = torch.Generator().manual_seed(3)
    vocab = target.config.vocab_size
    v = Verifier(target)
    committed = list(PROMPT)
    first = v.prefill(committed)
    root = int(first.argmax())
    for step in range(5):
        seqs = [torch.randint(0, vocab, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
                for _ in range(4)]
        tree = merge_sequences(seqs)
        logits = v.score(root, tree)
        leaf = int(torch.randint(-1, len(tree), (1,), generator=g))
        path = [] if leaf < 0 else path_to(tree.parents, leaf)
        toks = tree.tokens.tolist()
        for i in set(path + [len(tree) - 1]):
            ref, _ = chain_forward(target, committed + [root] + [toks[j] for j in path_to(tree.parents, i)])
            torch.testing.assert_close(logits[i + 1], ref[-1], atol=ATOL, rtol=1e-4, msg=f"step {step} node {i}")
        v.commit(path)
        committed += [root] + [toks[j] for j in path]
        assert_cache_equal(v.kv.layer_tensors(), fresh_cache(target, committed))
        root = int(logits[(path[-1] + 1) if path else 0].argmax())


# ----------------------------------------------------------------------------------------------------------------
# (c) KVCache.crop / keep


def test_kv_crop(target):
    ids = PROMPT + [1, 2, 3, 4, 5]
    v = Verifier(target)
    v.prefill(ids)
    full = [(k.clone(), val.clone()) for k, val in v.kv.layer_tensors()]
    assert len(v.kv) == len(ids)
    v.kv.crop(len(ids) + 5)  # longer than the cache: no-op
    assert len(v.kv) == len(ids)
    v.kv.crop(6)
    assert len(v.kv) == 6
    assert_cache_equal(v.kv.layer_tensors(), [(k[..., :6, :], val[..., :6, :]) for k, val in full], atol=0)
    # re-feeding the dropped tokens rebuilds the same cache and the same logits
    logits = v.score(ids[6], DraftTree.chain(ids[7:]))
    v.commit(list(range(len(ids) - 7)))
    assert_cache_equal(v.kv.layer_tensors(), full)
    ref, _ = chain_forward(target, ids)
    torch.testing.assert_close(logits, ref[6:], atol=ATOL, rtol=1e-4)
    v.kv.crop(0)
    assert len(v.kv) == 0
    v.prefill(ids[:4])
    assert_cache_equal(v.kv.layer_tensors(), fresh_cache(target, ids[:4]))


def test_kv_keep_contiguous_is_crop_and_gather_is_exact(target):
    ids = PROMPT + [1, 2, 3, 4, 5, 6]
    a, b = KVCache(target), KVCache(target)
    with torch.inference_mode():
        target(input_ids=torch.tensor([ids]), past_key_values=a.cache, use_cache=True)
        target(input_ids=torch.tensor([ids]), past_key_values=b.cache, use_cache=True)
    start = len(PROMPT)
    a.keep(start, [0, 1, 2])
    b.crop(start + 3)
    assert_cache_equal(a.layer_tensors(), b.layer_tensors(), atol=0)
    c = KVCache(target)
    with torch.inference_mode():
        target(input_ids=torch.tensor([ids]), past_key_values=c.cache, use_cache=True)
    full = [(k.clone(), v.clone()) for k, v in c.layer_tensors()]
    c.keep(start, [0, 2, 5])
    assert len(c) == start + 3
    idx = torch.tensor(list(range(start)) + [start, start + 2, start + 5])
    assert_cache_equal(c.layer_tensors(), [(k[..., idx, :], v[..., idx, :]) for k, v in full], atol=0)


def test_kv_grows_past_initial_capacity(make_long_model):
    """A prompt longer than the preallocated buffer, then tree steps: still equal to fresh computation."""
    model = make_long_model
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, model.config.vocab_size, (300,), generator=g).tolist()
    v = Verifier(model)
    v.prefill(prompt)
    tree = make_tree()
    logits = v.score(ROOT, tree)
    for i in (7, 9):
        ref, _ = chain_forward(model, prompt + [ROOT] + [TREE_TOKENS[j] for j in path_to(tree.parents, i)])
        torch.testing.assert_close(logits[i + 1], ref[-1], atol=ATOL, rtol=1e-4)
    path = path_to(tree.parents, 9)
    v.commit(path)
    committed = prompt + [ROOT] + [TREE_TOKENS[j] for j in path]
    assert_cache_equal(v.kv.layer_tensors(), fresh_cache(model, committed))


@pytest.fixture
def make_long_model(arch):
    from conftest import tiny_llama, tiny_qwen2

    return (tiny_llama if arch == "llama" else tiny_qwen2)(seed=0, layers=1, hidden=16, max_pos=1024)


def sliding_qwen2(window: int = 4):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, use_sliding_window=True,
                      sliding_window=window, max_window_layers=1)  # layer 0 full attention, layer 1 sliding window
    return Qwen2ForCausalLM(cfg).eval()


def test_sliding_window_cache_crops_past_the_window():
    """A sliding-window config keeps transformers' own cache layers: crop works even past the window (rejected
    draft tokens can be rolled back), and a non-contiguous tree keep is refused with a clear error."""
    model = sliding_qwen2()
    ids = PROMPT + [1, 2, 3]  # 12 tokens, window 4
    kv = KVCache(model)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids[:9]]), past_key_values=kv.cache, use_cache=True)
        model(input_ids=torch.tensor([ids[9:]]), past_key_values=kv.cache, use_cache=True)
    assert len(kv) == len(ids)
    kv.crop(len(ids) - 3)  # drop 3 tokens: the window is already full
    assert len(kv) == len(ids) - 3
    with torch.inference_mode():
        got = model(input_ids=torch.tensor([ids[-3:]]), position_ids=torch.arange(len(ids) - 3, len(ids))[None],
                    past_key_values=kv.cache, use_cache=True).logits[0]
    ref, _ = chain_forward(model, ids)
    torch.testing.assert_close(got, ref[-3:], atol=ATOL, rtol=1e-4)
    kv.crop(len(kv))  # trims the window layer back to its window, changes nothing visible
    assert len(kv) == len(ids)
    with pytest.raises(RetrospecError, match="full-attention"):
        kv.keep(2, [0, 2])


def test_sliding_window_model_speculative_greedy_equals_oracle():
    """End to end: rejected drafts on a sliding-window target are rolled back correctly (greedy == oracle)."""
    from conftest import tiny_qwen2

    from retrospec.config import SamplingConfig
    from retrospec.decode import autoregressive_generate, speculative_generate
    from retrospec.drafters import REGISTRY

    model = sliding_qwen2()
    greedy = SamplingConfig(temperature=0.0)
    want = autoregressive_generate(model, PROMPT, sampling=greedy, max_new_tokens=24)
    for drafter in (REGISTRY["sd"](draft_model=tiny_qwen2(seed=1, layers=1, hidden=16), gamma=3),
                    REGISTRY["sd"](draft_model=model, gamma=3)):
        out = [t for c in speculative_generate(model, drafter, PROMPT, sampling=greedy, max_new_tokens=24) for t in c]
        assert out == want


def test_reserve_then_advance_holds_what_update_holds():
    """``BufferLayer.reserve`` / ``advance`` (the compiled layers write the new keys and values into the buffers
    themselves) leave the layer as ``update`` does, growing past its capacity alike."""
    from retrospec.kv.cache import BufferLayer

    kv_heads, d = 2, 8
    a, b = BufferLayer(initial_capacity=4), BufferLayer(initial_capacity=4)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for t in (3, 1, 5):
            k, v = torch.randn(1, kv_heads, t, d, generator=gen), torch.randn(1, kv_heads, t, d, generator=gen)
            if not a.is_initialized:
                a.update(k, v), b.update(k, v)
                continue
            kbuf, vbuf = a.reserve(t)  # [1, kvh, C, d]
            kbuf[:, :, a.length: a.length + t], vbuf[:, :, a.length: a.length + t] = k, v
            a.advance(t)
            kb, vb = b.update(k, v)
            assert torch.equal(a.keys, kb) and torch.equal(a.values, vb) and a.length == b.length
    assert a.capacity == b.capacity >= 9


def test_within_depth_drops_deeper_nodes_and_keeps_the_rest_in_order():
    from retrospec.tree import depths, within_depth

    chain = DraftTree.chain([4, 5, 6, 7], torch.eye(8)[[4, 5, 6, 7]])
    cut = within_depth(chain, 2)
    assert cut.is_chain and cut.tokens.tolist() == [4, 5] and torch.equal(cut.draft_probs, torch.eye(8)[[4, 5]])
    assert within_depth(chain, 4) is chain and within_depth(chain, None) is chain
    assert len(within_depth(chain, 0)) == 0
    # root -> 10 -> 11 -> 12, root -> 20 -> 21, 10 -> 13 -> 14 (interleaved, as tries are)
    tree = DraftTree(torch.tensor([10, 20, 11, 21, 13, 12, 14]), torch.tensor([-1, -1, 0, 1, 0, 2, 4]),
                     torch.arange(7.0)[:, None].expand(7, 3).clone())
    cut = within_depth(tree, 2)
    assert cut.tokens.tolist() == [10, 20, 11, 21, 13] and cut.parents.tolist() == [-1, -1, 0, 1, 0]
    assert cut.draft_probs[:, 0].tolist() == [0, 1, 2, 3, 4]  # each node keeps its own q row
    assert int(depths(cut.parents).max()) == 2
    assert within_depth(tree, 3) is tree
    one = within_depth(tree, 1)
    assert one.tokens.tolist() == [10, 20] and one.parents.tolist() == [-1, -1]
