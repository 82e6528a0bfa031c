"""Greedy decoding through the engine equals the naive oracle token for token (fp32), for every method and both
architectures; EOS and max_new_tokens are honoured exactly; SpecStats obeys its invariants."""

from __future__ import annotations

import pytest

from retrospec.config import SamplingConfig
from retrospec.decode import autoregressive_generate, speculative_generate
from retrospec.drafters import REGISTRY
from retrospec.drafters.base import DecodeContext, chain_room
from retrospec.tree import children_lists, merge_sequences, within_depth
from retrospec.types import DraftTree, SpecStats

GREEDY = SamplingConfig(temperature=0.0)

N_NEW = 48
PROMPT = [5, 17, 3, 42, 8, 17, 3, 42, 8, 61, 5, 17]  # repeats, so prompt lookup finds n-gram matches


def run(target, drafter, prompt=PROMPT, max_new_tokens=N_NEW, eos_ids=frozenset(), sampling=GREEDY):
    """Run the engine to the end; returns (all generated ids, SpecStats, list of per-step chunks)."""
    stats = SpecStats(method=getattr(drafter, "name", "?"))
    chunks = list(speculative_generate(target, drafter, prompt, sampling=sampling, max_new_tokens=max_new_tokens,
                                       eos_ids=eos_ids, stats=stats))
    return [t for c in chunks for t in c], stats, chunks


def oracle(model, prompt=PROMPT, max_new_tokens=N_NEW, eos_ids=frozenset()):
    return autoregressive_generate(model, prompt, sampling=GREEDY, max_new_tokens=max_new_tokens, eos_ids=eos_ids)


def check_stats(stats: SpecStats, out: list[int], chunks: list[list[int]], truncated_by_eos: bool = False) -> None:
    assert stats.new_tokens == len(out)
    assert stats.target_calls == len(chunks)  # the prefill, then one target forward per verification step
    assert stats.mean_accepted_tokens == pytest.approx(stats.new_tokens / stats.target_calls)
    assert 0 <= stats.accepted_tokens <= stats.drafted_tokens
    if stats.drafted_tokens:
        assert stats.acceptance_rate == pytest.approx(stats.accepted_tokens / stats.drafted_tokens)
    else:
        assert stats.acceptance_rate == 0.0
    # every step commits its accepted tokens plus one recovered/bonus token; only EOS may cut a step short
    # (max_new_tokens is respected through the draft budget)
    if truncated_by_eos:
        assert stats.new_tokens <= stats.target_calls + stats.accepted_tokens
    else:
        assert stats.new_tokens == stats.target_calls + stats.accepted_tokens
        assert all(len(c) >= 1 for c in chunks)
    drafted, accepted = stats.per_position_drafted, stats.per_position_accepted
    assert len(drafted) == len(accepted)
    assert sum(accepted) == stats.accepted_tokens
    assert all(a <= d for a, d in zip(accepted, drafted))
    assert all(x >= y for x, y in zip(drafted, drafted[1:]))  # a step that drafted depth d+1 drafted depth d
    assert all(x >= y for x, y in zip(accepted, accepted[1:]))
    if drafted:
        assert drafted[0] <= stats.target_calls  # every verification call may follow a draft
    rates = stats.per_position_acceptance
    assert all(0.0 <= r <= 1.0 for r in rates)
    d = stats.to_dict()
    assert d["mean_accepted_tokens"] == stats.mean_accepted_tokens and d["new_tokens"] == stats.new_tokens


@pytest.fixture
def make_model(arch):
    from conftest import tiny_llama, tiny_qwen2

    return tiny_llama if arch == "llama" else tiny_qwen2


@pytest.fixture
def expected(target):
    return oracle(target)


# ----------------------------------------------------------------------------------------------------------------
# every method equals the oracle


def test_ar(target, expected):
    out, stats, chunks = run(target, REGISTRY["ar"]())
    assert out == expected
    check_stats(stats, out, chunks)
    assert stats.mean_accepted_tokens == 1.0 and stats.target_calls == N_NEW
    assert stats.drafted_tokens == 0 and stats.accepted_tokens == 0 and stats.acceptance_rate == 0.0
    assert all(len(c) == 1 for c in chunks)


def test_sd_different_draft(target, draft, expected):
    out, stats, chunks = run(target, REGISTRY["sd"](draft_model=draft, gamma=4, adaptive=False))
    assert out == expected
    check_stats(stats, out, chunks)
    assert stats.drafted_tokens > 0
    assert stats.acceptance_rate < 0.5  # an unrelated random draft is mostly rejected
    assert max(len(c) for c in chunks) <= 5  # at most gamma accepted + 1
    assert all(d <= stats.target_calls for d in stats.per_position_drafted)
    assert len(stats.per_position_drafted) == 4


def test_sd_self_draft_accepts_everything(target, expected):
    gamma = 4
    out, stats, chunks = run(target, REGISTRY["sd"](draft_model=target, gamma=gamma, adaptive=False))
    assert out == expected
    check_stats(stats, out, chunks)
    assert stats.accepted_tokens == stats.drafted_tokens > 0 and stats.acceptance_rate == 1.0
    assert stats.per_position_accepted == stats.per_position_drafted
    # 48 tokens = steps of gamma + 1 tokens (the last one shortened by the budget); the first step's root is the
    # last prompt token, so no call is spent on a prefill-only token
    assert [len(c) for c in chunks] == [gamma + 1] * 9 + [3]
    assert stats.mean_accepted_tokens == pytest.approx(N_NEW / 10)


@pytest.mark.parametrize("self_draft", [True, False], ids=["self", "other"])
def test_sd_adaptive_gamma(target, draft, expected, self_draft):
    drafter = REGISTRY["sd"](draft_model=target if self_draft else draft, gamma=2, adaptive=True)
    out, stats, chunks = run(target, drafter)
    assert out == expected
    check_stats(stats, out, chunks)
    if self_draft:  # gamma grows 2 -> 4 -> 6 -> 8 ... while everything is accepted
        assert stats.acceptance_rate == 1.0
        assert len(stats.per_position_drafted) >= 8
        assert drafter.gamma > 2
    else:
        assert drafter.gamma >= 1
        assert stats.drafted_tokens > 0


def test_pld(target, expected):
    out, stats, chunks = run(target, REGISTRY["pld"](gamma=5))
    assert out == expected
    check_stats(stats, out, chunks)
    assert stats.drafted_tokens > 0  # the prompt repeats itself: lookup always finds something to propose
    assert len(stats.per_position_drafted) <= 5


def test_sharpened_repetitive_output_pld_speeds_up(make_model):
    """A sharpened random model loops, prompt lookup then drafts the loop and tau > 1."""
    from conftest import sharpen

    model = sharpen(make_model(seed=3), 8.0)
    want = oracle(model)
    out, stats, chunks = run(model, REGISTRY["pld"](gamma=5))
    assert out == want
    check_stats(stats, out, chunks)
    assert len(set(want[-6:])) == 1  # the output ends in a loop (deterministic: fixed seed)
    assert stats.mean_accepted_tokens > 1.0 and stats.accepted_tokens > 0


# ----------------------------------------------------------------------------------------------------------------
# EOS and max_new_tokens


@pytest.mark.parametrize("method", ["ar", "sd-self", "sd", "pld"])
def test_eos_stops_generation(target, draft, expected, method):
    eos = expected[4]  # the oracle emits this token at step 5 at the latest
    want = oracle(target, eos_ids=frozenset({eos}))
    assert want[-1] == eos and len(want) <= 5 and eos not in want[:-1]
    drafter = {
        "ar": lambda: REGISTRY["ar"](),
        "sd-self": lambda: REGISTRY["sd"](draft_model=target, gamma=4),
        "sd": lambda: REGISTRY["sd"](draft_model=draft, gamma=4),
        "pld": lambda: REGISTRY["pld"](gamma=5),
    }[method]()
    out, stats, chunks = run(target, drafter, eos_ids=frozenset({eos, target.config.vocab_size + 7}))
    assert out == want
    check_stats(stats, out, chunks, truncated_by_eos=True)


def test_eos_in_middle_of_accepted_chain(target):
    """With a self draft every step commits gamma + 1 tokens; an EOS inside a step cuts the step there."""
    long = oracle(target, max_new_tokens=20)
    eos = long[7]  # inside the second step (tokens 0..4 come from the first step)
    want = oracle(target, eos_ids=frozenset({eos}))
    out, stats, chunks = run(target, REGISTRY["sd"](draft_model=target, gamma=4), eos_ids=frozenset({eos}))
    assert out == want and out[-1] == eos
    check_stats(stats, out, chunks, truncated_by_eos=True)


def test_eos_on_first_token(target, expected):
    out, stats, chunks = run(target, REGISTRY["sd"](draft_model=target, gamma=4), eos_ids=frozenset({expected[0]}))
    assert out == [expected[0]] and stats.target_calls == 1 and chunks == [[expected[0]]]


@pytest.mark.parametrize("max_new", [1, 2, 3, 7, 13, 41])
def test_max_new_tokens_is_exact(target, draft, expected, max_new):
    for drafter in (REGISTRY["ar"](), REGISTRY["sd"](draft_model=target, gamma=4), REGISTRY["pld"](gamma=5),
                    REGISTRY["sd"](draft_model=draft, gamma=3, adaptive=True)):
        out, stats, chunks = run(target, drafter, max_new_tokens=max_new)
        assert out == expected[:max_new], drafter
        check_stats(stats, out, chunks)


def test_max_position_embeddings_stops(make_model):
    """Generation stops when the model has no position left, even if max_new_tokens allows more."""
    model = make_model(seed=0, max_pos=len(PROMPT) + 10)
    want = oracle(model, max_new_tokens=10)
    out, stats, chunks = run(model, REGISTRY["sd"](draft_model=model, gamma=4), max_new_tokens=30)
    assert out == want
    assert len(PROMPT) + len(out) <= model.config.max_position_embeddings


# ----------------------------------------------------------------------------------------------------------------
# a tree drafter


class OracleTreeDrafter:
    """Test drafter: a small tree with the true continuation in one branch (not the first one), a junk branch, and
    a branch that follows the truth for a while and then goes wrong. Non-chain trees, non-contiguous accepted paths."""

    name = "oracle-tree"
    needs: frozenset[str] = frozenset()

    def __init__(self, full: list[int], vocab: int, depth: int = 4, truth: bool = True):
        self.full = full  # prompt + the oracle's continuation
        self.vocab = vocab
        self.depth = depth
        self.truth = truth
        self.trees: list[DraftTree] = []
        self.expect_accepted: list[int] = []

    def prefill(self, ctx: DecodeContext) -> None:
        self.trees, self.expect_accepted = [], []

    def propose(self, ctx: DecodeContext, budget: int) -> DraftTree:
        n = len(ctx.tokens)
        assert ctx.tokens == self.full[:n]  # greedy engine committed exactly the oracle's tokens so far
        true = self.full[n : n + chain_room(ctx, self.depth)]  # no deeper than the loop would keep
        if not true or budget <= 0:
            self.trees.append(DraftTree.empty())
            self.expect_accepted.append(0)
            return self.trees[-1]
        junk = [(t + 1) % self.vocab for t in true]
        half = true[:2] + [(t + 3) % self.vocab for t in true[2:]]
        seqs = [junk, true, half] if self.truth else [junk, [(t + 5) % self.vocab for t in true]]
        tree = merge_sequences(seqs, max_nodes=budget)
        self.trees.append(tree)
        # greedy verification must accept exactly the part of the true continuation that made it into the tree
        kids, toks, node, depth = children_lists(tree.parents), tree.tokens.tolist(), -1, 0
        while depth < len(true):
            node = next((c for c in kids[node + 1] if toks[c] == true[depth]), None)
            if node is None:
                break
            depth += 1
        self.expect_accepted.append(depth)
        return tree

    def observe(self, accepted: int, drafted: int) -> None:
        pass


@pytest.mark.parametrize("truth", [True, False], ids=["with-truth", "junk-only"])
def test_tree_drafter(target, expected, truth):
    full = PROMPT + oracle(target, max_new_tokens=N_NEW + 8)
    drafter = OracleTreeDrafter(full, target.config.vocab_size, truth=truth)
    out, stats, chunks = run(target, drafter)
    assert out == expected
    check_stats(stats, out, chunks)
    assert any(not t.is_chain for t in drafter.trees)
    assert len(drafter.trees) == stats.target_calls
    assert stats.accepted_tokens == sum(drafter.expect_accepted)
    assert [len(c) for c in chunks] == [a + 1 for a in drafter.expect_accepted]
    if truth:
        assert stats.mean_accepted_tokens > 1.0
        assert max(len(c) for c in chunks) == 5  # 4 accepted (a non-contiguous path in node order) + bonus
    else:
        assert stats.accepted_tokens == 0 and stats.mean_accepted_tokens == 1.0


@pytest.mark.parametrize("method", ["sd-self", "magicdec"])
def test_draft_chain_stops_after_eos(target, method):
    """A draft LM stops its chain at an EOS token (nothing after it can be committed); the output is unchanged."""
    long = oracle(target, max_new_tokens=20)
    eos = long[3]
    if eos in long[:3]:
        pytest.skip("the oracle repeats this token earlier")
    want = oracle(target, eos_ids=frozenset({eos}))
    # magicdec: sinks + window one key short of the 12-token prompt, so it drafts (a window holding the whole context
    # declines); the key left out does not change this target's next tokens
    drafter = (REGISTRY["sd"](draft_model=target, gamma=8) if method == "sd-self"
               else REGISTRY["magicdec"](target=target, gamma=8, sink=4, window=7))
    out, stats, chunks = run(target, drafter, eos_ids=frozenset({eos}))
    assert out == want and out[-1] == eos
    assert stats.target_calls == 1 and stats.drafted_tokens == 4  # long[0..3], not gamma = 8 tokens
    check_stats(stats, out, chunks, truncated_by_eos=True)


def test_step_timings_wait_for_the_device(monkeypatch):
    """``decode.device_clock``: on CUDA every reading first synchronises the device (so ``verify_s`` and the gate's
    costs measure kernels, not launches); on CPU it is the plain clock and never touches CUDA."""
    import time

    import torch

    from retrospec.decode import device_clock

    assert device_clock(torch.device("cpu")) is time.perf_counter
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    clock = device_clock(torch.device("cuda", 0))
    first, second = clock(), clock()
    assert second >= first and synced == [torch.device("cuda", 0)] * 2


class DeepWideDrafter:
    """Ignores ``max_depth``: a wide tree as deep as the truth allows (the true continuation, each depth's
    siblings junk), so the loop must cut it."""

    name, needs = "deep-wide", frozenset()

    def __init__(self, full: list[int], vocab: int, depth: int = 12, width: int = 3):
        self.full, self.vocab, self.depth, self.width = full, vocab, depth, width
        self.max_depths: list[int | None] = []
        self.trees: list[DraftTree] = []

    def prefill(self, ctx: DecodeContext) -> None:
        self.max_depths, self.trees = [], []

    def propose(self, ctx: DecodeContext, budget: int) -> DraftTree:
        self.max_depths.append(ctx.max_depth)
        true = self.full[len(ctx.tokens): len(ctx.tokens) + self.depth]
        seqs = [true] + [true[:d] + [(true[d] + j) % self.vocab] for d in range(len(true)) for j in
                         range(1, self.width)]
        self.trees.append(merge_sequences(seqs, max_nodes=budget) if true and budget > 0 else DraftTree.empty())
        return self.trees[-1]

    def observe(self, accepted: int, drafted: int) -> None:
        pass


@pytest.mark.parametrize("max_new", [1, 2, 7, 30])
def test_the_loop_cuts_a_tree_at_the_tokens_left_and_keeps_its_width(target, max_new):
    """The new tokens left bound a step's depth (deeper nodes are dropped before verification), not its nodes: a
    drafter that ignores ``max_depth`` still matches the oracle, each step verifies only nodes the step could
    commit, and the last steps keep their width."""
    full = PROMPT + oracle(target, max_new_tokens=max_new + 16)
    drafter = DeepWideDrafter(full, target.config.vocab_size)
    out, stats, chunks = run(target, drafter, max_new_tokens=max_new)
    assert out == full[len(PROMPT): len(PROMPT) + max_new]
    check_stats(stats, out, chunks)
    made = 0
    for step, (room, chunk) in enumerate(zip(drafter.max_depths, chunks)):
        assert room == max_new - made - 1  # the tokens left, less the target's own
        assert len(chunk) == min(room, drafter.depth) + 1  # the whole true path, as deep as the step allows
        made += len(chunk)
    assert len(stats.per_position_drafted) <= max_new - 1  # nothing deeper than a step could commit was verified
    verified = [len(within_depth(t, r)) for t, r in zip(drafter.trees, drafter.max_depths)]
    assert stats.drafted_tokens == sum(verified)  # what each step verified: its draft cut at its depth
    for room, nodes in zip(drafter.max_depths, verified):  # every step: the full width (the true token and two
        assert nodes == drafter.width * min(room, drafter.depth)  # junk siblings per depth), as deep as allowed
