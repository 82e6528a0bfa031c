"""Gating (``retrospec.gating``): the budget decisions on synthetic timings (deterministic: no wall clock), and
the engine with the gate on and off staying token-identical to the oracle."""

from __future__ import annotations

import random

import pytest

from retrospec.config import SamplingConfig
from retrospec.decode import autoregressive_generate, speculative_generate
from retrospec.drafters import REGISTRY
from retrospec.gating import STALL, Gate, GateProfile, profile_for
from retrospec.types import SpecStats

from conftest import sharpen, tiny_llama

PLAIN = 0.010  # seconds per plain decoding step in the synthetic runs
CTX = 100


def simulate(gate: Gate, steps: int, *, natural: int, accept, draft_per_node: float, draft_fixed: float = 0.0,
             verify_per_node: float = 0.001, room: int = 1000) -> list[int]:
    """Drive ``gate`` for ``steps`` steps against a synthetic drafter: it proposes min(budget, natural) nodes in a
    chain, ``accept(step)`` of them are accepted, and the timings follow the given linear costs."""
    budgets = []
    for i in range(steps):
        b = gate.choose(room, CTX + i)
        budgets.append(b)
        nodes = min(b, natural)
        acc = min(nodes, accept(i))
        draft_s = (draft_fixed + draft_per_node * nodes) if b else 0.0
        gate.update(b, nodes, list(range(acc)), draft_s, PLAIN + verify_per_node * nodes, CTX + i)
    gate.finish()
    return budgets


def test_first_step_measures_plain_decoding_then_ramps_up():
    gate = Gate(GateProfile(), "sd")
    budgets = simulate(gate, 8, natural=10, accept=lambda i: 10, draft_per_node=0.0005)
    assert budgets[0] == 0  # nothing known about this target yet: one plain step
    assert budgets[1:4] == [1, 1, 4]  # the ramp (x4) while the drafter fills its budget, its first step timed twice
    assert max(budgets[:6]) >= 10  # 16 > natural: the drafter proposes its own size (10)
    assert all(b >= 10 for b in budgets[8:])  # and keeps it


def test_never_accepted_costly_draft_is_gated_off_and_probed_rarely():
    gate = Gate(GateProfile(), "sd")
    budgets = simulate(gate, 400, natural=5, accept=lambda i: 0, draft_per_node=0.008)
    tail = budgets[50:]
    assert tail.count(0) / len(tail) > 0.9
    probes = [b for b in tail if b]
    assert probes and all(b == 1 for b in probes)  # probes stay small: 2 x best (0), at least 1


def test_gated_off_request_picks_speculation_back_up_when_it_turns_acceptable():
    gate = Gate(GateProfile(), "sd")
    budgets = simulate(gate, 400, natural=5, accept=lambda i: 0 if i < 150 else 5, draft_per_node=0.001)
    assert budgets[100:150].count(0) > 40
    assert all(min(b, 5) == 5 for b in budgets[-100:])  # acceptance returned: the full chain again (5 nodes)


def test_always_accepted_draft_that_is_too_slow_is_not_probed_every_step():
    # MagicDec-like at a context where the draft is nearly the target: every drafted token is accepted, but one costs
    # more than a plain step, so no budget pays, and a fully accepted probe does not climb: twice its draft, all
    # accepted, would still lose to plain steps.
    gate = Gate(GateProfile(), "magicdec")
    budgets = simulate(gate, 300, natural=5, accept=lambda i: 10, draft_per_node=0.012)
    tail = budgets[50:]
    assert tail.count(0) / len(tail) > 0.95, tail
    probes = [b for b in tail if b]
    assert probes and max(probes) == 1, probes  # probed now and then, at the smallest budget


def test_always_accepted_draft_that_could_pay_climbs_after_a_full_probe():
    # the same, with drafting at half a plain step per token: a fully accepted probe climbs (1, 2, 4, ...) to the
    # drafter's size, since a larger all-accepted draft beats plain steps
    gate = Gate(GateProfile(), "magicdec")
    budgets = simulate(gate, 300, natural=5, accept=lambda i: 10, draft_per_node=0.005)
    assert max(budgets[50:]) >= 4, budgets[50:]


def test_cheap_bursty_draft_that_pays_is_never_gated():
    # prompt-lookup-like: the whole draft is accepted on two steps in three, nothing on the third
    rng = random.Random(0)
    gate = Gate(GateProfile(), "pld")
    budgets = simulate(gate, 200, natural=10, accept=lambda i: 0 if rng.random() < 1 / 3 else 10,
                       draft_per_node=0.00001)
    assert budgets[0] == 0 and budgets[1:4] == [1, 1, 4]
    assert min(budgets[10:]) >= 4  # never gated off
    assert sum(min(b, 10) for b in budgets[10:]) / len(budgets[10:]) >= 6


def test_partial_acceptance_shrinks_the_chain_to_what_pays():
    # the first two positions are always accepted, the rest never; drafting costs 60 % of a plain step per node
    gate = Gate(GateProfile(), "sd")
    budgets = simulate(gate, 300, natural=8, accept=lambda i: 2, draft_per_node=0.006)
    assert max(budgets[100:], key=budgets[100:].count) == 2


def test_profile_carries_timings_and_estimates_to_the_next_request():
    prof = GateProfile()
    simulate(Gate(prof, "sd"), 300, natural=5, accept=lambda i: 0, draft_per_node=0.008)
    assert max(prof.carried["sd"]["wgt"]) <= 1.0 + 1e-9  # carried, but worth one step only
    nxt = Gate(prof, "sd")
    assert nxt.choose(100, CTX) == 0  # starts gated (plain timing known, no first measuring step needed)
    other = Gate(prof, "pld")
    assert other.choose(100, CTX) == 1  # another drafter on the same target starts its own ramp
    good = GateProfile()
    simulate(Gate(good, "sd"), 50, natural=5, accept=lambda i: 5, draft_per_node=0.0005)
    assert Gate(good, "sd").choose(100, CTX) >= 5  # a drafter that paid starts at its full draft (5 nodes)


def test_counterfactual_budgets_from_one_tree():
    gate = Gate(GateProfile(), "rest")
    gate.profile.record_verify(CTX, 0, PLAIN)
    gate.update(6, 6, [1, 4], 0.001, PLAIN, CTX)  # accepted path: node 1 then node 4 (parents precede children)
    prior = [0.5 * sum(0.5 ** k for k in range(1, b + 1)) for b in range(7)]
    got = [gate.acc[b] - 0.9 * prior[b] for b in range(1, 7)]
    assert got == pytest.approx([0, 1, 1, 1, 2, 2])  # budget b keeps the accepted nodes with index < b


def test_a_step_cut_by_the_end_of_the_request_teaches_only_its_verification_cost():
    """Near the end the loop cuts a step's depth at the tokens left, so a chain drafter fills less than its budget
    and the whole cut draft is accepted: that says nothing about what the budget buys, so only its verification
    timing counts (without this, a 16-token chain always accepted would read as ~13 tokens a step)."""
    gate = Gate(GateProfile(), "sd")
    gate.profile.record_verify(CTX, 0, PLAIN)
    gate.update(16, 16, list(range(16)), 0.002, PLAIN, CTX)  # a full step at budget 16: learnt
    before = (list(gate.acc), list(gate.nodes), list(gate.wgt), dict(gate.draft_s), gate.top, gate.filled_top)
    gate.update(16, 2, [0, 1], 0.0005, 0.011, CTX + 17, depth_bound=True)  # 3 tokens left: a 2-token draft
    assert (list(gate.acc), list(gate.nodes), list(gate.wgt), dict(gate.draft_s), gate.top,
            gate.filled_top) == before
    assert not gate.last_full  # not taken for a full accept that would double the next probe
    assert gate.profile.verify_cost(CTX + 17, 2) is not None  # its verification timing was recorded


def test_draft_room_bounds_nodes_by_positions_and_depth_by_tokens_left():
    from retrospec.decode import draft_room

    assert draft_room(10, 0, 1000) == (999, 9)  # 10 tokens to go: a path of 9 and the target's own token
    assert draft_room(10, 9, 1000) == (0, 0)  # one token left: the target's own, nothing to draft
    assert draft_room(10, 3, 5) == (4, 4)  # the model's positions bind both
    assert draft_room(10, 0, 1) == (0, 0)
    assert draft_room(10, 10, 1000) == (0, 0)


def test_disabled_gate_hands_over_the_room():
    gate = Gate(GateProfile(), "sd", enabled=False)
    assert [gate.choose(r, CTX) for r in (0, 3, 50)] == [0, 3, 50]


# ---- the engine ------------------------------------------------------------------------------------------------
PROMPT = [5, 17, 3, 42, 8, 17, 3, 42, 8, 61, 5, 17]


@pytest.mark.parametrize("method", ["sd", "pld"])
@pytest.mark.parametrize("gating", [True, False])
def test_greedy_identical_with_and_without_gating(method, gating):
    target = sharpen(tiny_llama(seed=0))
    draft = sharpen(tiny_llama(seed=1, layers=1))
    greedy = SamplingConfig()
    want = autoregressive_generate(target, PROMPT, sampling=greedy, max_new_tokens=40)
    for _ in range(3):  # later requests start from what the profile learned
        drafter = REGISTRY[method](draft_model=draft, gamma=4)
        stats = SpecStats(method=method)
        out = [t for c in speculative_generate(target, drafter, PROMPT, sampling=greedy, max_new_tokens=40,
                                               stats=stats, gating=gating) for t in c]
        assert out == want
        assert stats.gating is gating
        if gating:
            assert sum(stats.draft_shapes.values()) == stats.target_calls
            assert stats.gated_steps <= stats.draft_shapes.get("0", 0)  # the last step may have no room left
            assert set(stats.to_dict()) >= {"gating", "gated_steps", "draft_shapes"}
        else:
            assert stats.draft_shapes == {} and stats.gated_steps == 0
    assert profile_for(target).verify_cost(len(PROMPT), 0) is not None


def test_plain_decoding_is_never_gated():
    target = tiny_llama(seed=0)
    stats = SpecStats(method="ar")
    list(speculative_generate(target, REGISTRY["ar"](), PROMPT, sampling=SamplingConfig(), max_new_tokens=8,
                              stats=stats))
    assert stats.gating is False and stats.draft_shapes == {}


def test_gated_sampling_follows_target_law():
    """Speculative sampling with the gate on: the first three tokens still follow the target's exact law (the
    chi-square machinery of test_engine_sampling), whatever budgets the gate picked along the way."""
    import test_engine_sampling as es

    target = es.tiny(seed=11, scale=8.0)
    draft = es.tiny(seed=12, scale=8.0)
    p1, p2, p3 = es.exact_law(target, es.T1)
    counts, stats = es.sample_runs(target, lambda: REGISTRY["sd"](draft_model=draft, gamma=2), es.T1,
                                   range(7_000_000, 7_002_000), gating=True)
    assert sum(stats.draft_shapes.values()) > 0  # the gate decided every step
    assert es.chisq_pvalue(es.joint_groups(counts.sum(2), p1, p2)) > es.ALPHA
    assert es.chisq_pvalue(es.third_groups(counts, p3)) > es.ALPHA
    q1, q2, _ = es.exact_law(draft, es.T1)  # power: the draft's law is rejected
    assert es.chisq_pvalue(es.joint_groups(counts.sum(2), q1, q2), strict=False) < 1e-6


def test_a_new_context_bucket_borrows_verify_ratios_from_its_neighbour():
    prof = GateProfile()
    prof.record_verify(1000, 0, 0.010)  # bucket of ~1K tokens: a 4-node verify costs 2x a plain step
    prof.record_verify(1000, 4, 0.020)
    prof.record_verify(3000, 0, 0.030)  # a longer context: only a plain step measured so far
    assert prof.verify_cost(3000, 4) == pytest.approx(0.060)  # not the optimistic 0.030
    assert prof.verify_cost(3000, 2) == pytest.approx(0.045)
    assert prof.verify_cost(100_000, 1) is None  # no plain step in that bucket yet


def test_after_a_request_that_did_not_pay_the_next_one_that_does_climbs_back_fast():
    # prompt-lookup-like on a small model: request 1 finds nothing worth verifying, request 2 repeats itself
    prof = GateProfile()
    simulate(Gate(prof, "pld"), 60, natural=10, accept=lambda i: 0, draft_per_node=0.00001, verify_per_node=0.0005)
    budgets = simulate(Gate(prof, "pld"), 60, natural=10, accept=lambda i: 10, draft_per_node=0.00001,
                       verify_per_node=0.0005)
    assert min(budgets[12:]) >= 10, budgets


def test_verify_costs_never_fall_as_nodes_grow():
    """One lucky timing (4 nodes verified faster than the plain step) must not make a draft nothing accepts look
    faster than plain decoding: costs are read on the points' non-decreasing least-squares fit."""
    prof = GateProfile()
    prof.record_verify(300, 0, 0.042)
    prof.record_verify(300, 1, 0.055)
    prof.record_verify(300, 4, 0.040)  # noise: below the plain step and below 1 node
    assert prof.verify_cost(300, 0) == pytest.approx(0.042)
    assert prof.verify_cost(300, 1) == pytest.approx(0.0475)  # 1 and 4 nodes pooled: (0.055 + 0.040) / 2
    assert prof.verify_cost(300, 3) == pytest.approx(0.0475)
    assert prof.verify_cost(300, 16) == pytest.approx(0.0475)  # flat beyond the last point
    costs = [prof.verify_cost(300, n) for n in (0, 0.5, 1, 2, 3, 4, 8)]
    assert costs == sorted(costs)
    prof.record_verify(300, 8, 0.060)  # a later point: the fit is rebuilt
    assert prof.verify_cost(300, 6) == pytest.approx(0.05375)
    gate = Gate(prof, "sd")  # with zero acceptance at budget 4, drafting must not win over a plain step
    gate.context = 300
    for _ in range(20):
        gate.update(4, 4, [], 0.001, 0.040, 300)
    rates = gate.rates()
    assert max(rates, key=lambda b: (rates[b], b)) == 0


def test_ramp_slows_to_2x_where_verifying_more_nodes_is_costly():
    """At a long context each verified node costs a large share of a plain step: the ramp grows 2x there (4 -> 8
    -> 16 ...), where verification is cheap it grows 4x (test_first_step_...). A drafter always right still climbs."""
    costly = simulate(Gate(GateProfile(), "longspec"), 12, natural=64, accept=lambda i: 64, draft_per_node=0.0001,
                      verify_per_node=0.004)
    assert costly[1:4] == [1, 1, 4]  # the first growth (from 1) knows nothing about costs yet: 4x
    assert 8 in costly and 16 in costly and costly.index(8) < costly.index(16), costly  # then 2x
    cheap = simulate(Gate(GateProfile(), "longspec"), 12, natural=64, accept=lambda i: 64, draft_per_node=0.0001,
                     verify_per_node=0.0002)
    assert cheap[1:5] == [1, 1, 4, 16], cheap
    assert max(costly) >= 64 and max(cheap) >= 64  # both reach the drafter's size (64 nodes)


@pytest.mark.parametrize("accepted", [3, 5, 8])
def test_a_request_that_fails_after_a_paying_one_does_not_climb_through_carried_budgets(accepted):
    """Request 1 pays at budgets of 10-20; request 2's drafts are never accepted. Its rejections also lower the
    carried estimates of larger budgets it has not tried (a chain would have stopped at the same node), so it does
    not try them one by one (before: 10, 11, 12, ..., 23, then 64) and is gated off within about a dozen steps.
    Over 20 histories of request 1 (the property, not one lucky sequence)."""
    first_off = []
    for seed in range(20):
        rng = random.Random(seed)
        prof = GateProfile()
        simulate(Gate(prof, "longspec"), 60, natural=64, accept=lambda i: rng.choice([0, accepted, 2 * accepted, 64]),
                 draft_per_node=0.0002, verify_per_node=0.0004)
        budgets = simulate(Gate(prof, "longspec"), 30, natural=64, accept=lambda i: 0, draft_per_node=0.0004,
                           verify_per_node=0.0005)
        assert budgets[0] >= 2, (seed, budgets)  # it starts drafting, from the paying request's estimates
        assert max(budgets) <= 3 * budgets[0], (seed, budgets)
        assert 0 in budgets[:24], (seed, budgets)
        first_off.append(budgets.index(0))
    assert sorted(first_off)[10] <= 12, first_off


def test_a_rejection_lowers_untried_larger_budgets_only():
    gate = Gate(GateProfile(), "sd")
    gate.profile.record_verify(CTX, 0, PLAIN)
    gate.update(8, 8, list(range(8)), 0.001, PLAIN, CTX)  # budget 8 tried and fully accepted
    gate.update(2, 2, [0], 0.001, PLAIN, CTX)  # budget 2: node 1 rejected
    assert gate.acc[8] == pytest.approx(0.9 * 0.5 * sum(0.5 ** k for k in range(1, 9)) + 8)  # tried: left as it was
    fresh = Gate(GateProfile(), "sd")
    fresh.update(8, 8, list(range(8)), 0.001, PLAIN, CTX)
    fresh.tried = 0  # as if carried from an earlier request
    fresh.update(2, 2, [0], 0.001, PLAIN, CTX)
    assert fresh.acc[8] == pytest.approx(0.9 * (0.9 * 0.5 * sum(0.5 ** k for k in range(1, 9)) + 8) + 1)
    assert fresh.nodes[8] == pytest.approx(0.9 * (0.9 * 0.5 * 8 + 8) + 8)  # a chain of 8 would have been drafted


@pytest.mark.parametrize("where", ["draft", "verify"])
def test_one_stalled_step_does_not_close_the_gate(where):
    # a drafter that pays (half its chain accepted, cheap) stalls once for 50 plain steps (the process descheduled, a
    # garbage collection): that one timing must not make drafting look slower than plain decoding for long
    gate = Gate(GateProfile(), "longspec")
    budgets = []
    for i in range(120):
        b = gate.choose(1000, CTX + i)
        budgets.append(b)
        nodes = min(b, 4)
        stall = 50 * PLAIN if i == 40 and b else 0.0
        draft_s = (0.0003 * nodes + (stall if where == "draft" else 0.0)) if b else 0.0
        verify_s = PLAIN + 0.001 * nodes + (stall if where == "verify" else 0.0)
        gate.update(b, nodes, list(range(min(nodes, 2))), draft_s, verify_s, CTX + i)
    assert budgets[40] > 0 and min(budgets[20:40]) >= 2  # drafting, and paying, before the stall
    assert budgets[41:].count(0) <= 2 and min(budgets[45:]) >= 2, budgets[38:60]


def test_a_drafter_cheap_on_most_steps_is_priced_at_its_mean():
    # a lookup chain fills the budget alone on three steps of four (0.4 ms), the block drafts deep on the fourth
    # (6 ms, under a plain step): the dear steps are a real cost, not stalls, so the budget's drafting time is
    # their mean (~1.8 ms), not ~STALL x the cheap steps' (which would make the budget look cheaper than it is)
    gate = Gate(GateProfile(), "longspec")
    gate.update(0, 0, [], 0.0, PLAIN, CTX)  # a plain step: what a drafting timing may cost without being a stall
    for i in range(200):
        gate.update(4, 4, [0], 0.006 if i % 4 == 3 else 0.0004, PLAIN + 0.004, CTX)
    assert gate.draft_s[4] == pytest.approx((3 * 0.0004 + 0.006) / 4, rel=0.6)
    assert gate.draft_s[4] > 2 * STALL * 0.0004
    gate.update(4, 4, [0], 50 * PLAIN, PLAIN + 0.004, CTX)  # over a plain step and over STALL x: still a stall
    assert gate.draft_s[4] < 0.7 * 0.006 + 0.3 * PLAIN


def test_a_stall_in_the_first_drafting_step_does_not_close_the_gate():
    # the first timing of a budget has no average to be capped by (a lazy first-use cost: a weight packed on first
    # call, a kernel loaded): once a later timing shows the budget is STALL x cheaper, that timing replaces the
    # average, so the next requests are not priced out by it either
    profile = GateProfile()
    for request in range(3):
        gate = Gate(profile, "longspec")
        budgets = []
        for i in range(120):
            b = gate.choose(1000, CTX + i)
            budgets.append(b)
            nodes = min(b, 4)
            first = request == 0 and b and not any(budgets[:-1])
            draft_s = (0.0003 * nodes + (6 * PLAIN if first else 0.0)) if b else 0.0
            gate.update(b, nodes, list(range(min(nodes, 2))), draft_s, PLAIN + 0.001 * nodes, CTX + i)
        gate.finish()
        assert budgets[60:].count(0) <= 6 and sorted(budgets[60:])[30] >= 2, (request, budgets[:60])


def test_a_request_that_ends_inside_its_warm_up_hands_nothing_on():
    # a request whose only drafting step stalled (and ended before the step that re-times it) must not price the
    # drafter out of the next request: that one starts its own ramp and warm-up
    profile = GateProfile()
    first = Gate(profile, "longspec")
    assert first.choose(1000, CTX) == 0
    first.update(0, 0, [], 0.0, PLAIN, CTX)
    assert first.choose(1000, CTX + 1) == 1
    first.update(1, 1, [0], 6 * PLAIN, PLAIN + 0.001, CTX + 1)  # the warm-up, stalled; then the request ends
    first.finish()
    assert "longspec" not in profile.carried
    budgets = simulate(Gate(profile, "longspec"), 120, natural=4, accept=lambda i: 2, draft_per_node=0.0003,
                       verify_per_node=0.001)
    assert budgets[:3] == [1, 1, 4] and budgets[60:].count(0) <= 6, budgets[:20]
