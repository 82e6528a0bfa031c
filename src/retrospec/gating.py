"""Gating: per request, draft only as much as pays, down to no draft at all.

A drafter that does not pay makes speculative decoding slower than plain decoding (an out-of-distribution REST
store: 0.4x; RAPID self-speculation on items it never agrees on: 0.15x). Before every step the gate picks the node
budget handed to ``Drafter.propose`` from what the decode loop measures anyway:

- cost(b) = draft(b) + verify(n(b)). draft(b): moving average of seconds in ``propose`` per budget tried, linear
  between them (budget 0 drafts nothing). verify(n): seconds to verify, accept and commit n nodes (n = 0: a plain
  step), kept per target across requests (``GateProfile``, by context-length bucket, linear between node counts,
  read so it never falls as n grows) and measured once per bucket when unknown. In both averages one timing counts
  at most ``STALL`` x the average (a stall is not a new cost), a drafting timing at least up to a plain step (the
  cost of some drafters varies from step to step: a lookup chain that fills the budget alone, else a block that
  drafts several levels; their cheap steps must not make the dear ones look like stalls); the first drafting step
  of a request with nothing carried is a warm-up: the next step drafts the same budget again and its timing
  replaces the warm-up's (a first call may pack weights or load a kernel: a 57 ms first call once priced a 1.2 ms
  drafter out of a whole run).
  n(b): expected node count with budget b, estimated like E(b).
- E(b): expected tokens committed per step. A step with budget B also tells what any b <= B would have committed:
  the accepted path's node indices increase (parents precede children), so the first b nodes keep exactly the
  accepted nodes with index < b (exact for chains and, up to rounding, for trees handed out best first like
  ``longspec``'s; for other trees an approximation). E(b) = 1 + decayed mean of those counts, from a half-step
  prior so one unlucky step does not close the gate: acceptance 0.5 per position for the first budgets, and a
  larger budget starts from the largest one known.

Decision: b* = argmax_b E(b) / cost(b) over 0 and every budget tried. At the top of what was tried, while the
drafter fills its budget, the budget grows 4x (1, 4, 16, ... capped by the positions left), or 2x where the larger
step is predicted to cost more than twice the top's (verify read on the curve, or extrapolated linearly from the
plain step through the top's node count beyond what was measured; drafting scaled with the budget): at a long
context a 64-node verification costs several plain steps, and such a probe rarely pays. Below the top, a probe
refreshes the estimates as often as its extra cost over a plain step fits in 3 % of plain decoding time (every 2 to
128 steps): at the top budget when that costs at most a quarter of a plain step more, else at 2 b* (at least 1); a
probe that wins is followed at once by the next one, and so is a probe whose whole draft is accepted, at twice its
budget, where that draft all accepted could beat a plain step (its drafting priced per node as the probe's), so a
request that turns speculable climbs back in a few steps while a drafter that is always right but too slow (the
target drafting for itself over a cache as long as its own) is not probed on every step. A request starts from the
last request's estimates for the same method and target (``GateProfile.carried``, each budget worth at most 1 step);
the very first one starts the ramp at 1. A step that does not commit its whole draft also counts for the larger
budgets this request has not tried yet: they would have stopped at the same node (exact for chains and for a drafter
that ran short; a lower bound for trees), so optimistic carried estimates fall together instead of being tried one
budget at a time.

Invariant: gating changes only the budget handed to the drafter; acceptance is untouched, so greedy output stays
token-identical to plain decoding and sampling stays exact. Decisions follow wall-clock timings, so drafted shapes
(never the greedy output) can differ between runs: seeded sampling runs ungated unless asked (``resolve``).
"""

from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass, field

DECAY = 0.9  # acceptance statistics: weight of the past per observation (a window of about 10 steps)
COST_DECAY = 0.7  # timing averages: faster, timings are less noisy than acceptance
STALL = 2.0  # a timing above this many times its average counts as this many: a stall, not a new cost
PRIOR_WEIGHT = 0.5  # pseudo-steps of the optimistic prior
PRIOR_ACCEPT = 0.5  # prior acceptance per position
GROWTH = 4  # ramp factor at the top of the budgets tried
SLOW_GROWTH = 2  # ... where a GROWTH step is predicted to cost more than GROWTH_COST x the top's step
GROWTH_COST = 2.0
PROBE_OVERHEAD = 0.03  # probes below the top may cost this share of plain decoding time
PROBE_MAX = 128  # steps between probes at most
CARRY_WEIGHT = 1.0  # a request starts from the last one's estimates, worth this many steps per budget
CHEAP_PROBE = 0.25  # a probe at the top budget costing at most this share of a plain step more is cheap


def resolve(gating: bool | None, sampling) -> bool:
    """``gating=None``: on, except for seeded sampling (timing-driven draft shapes would consume the random stream
    differently: same distribution, another sample). Explicit True/False wins."""
    if gating is None:
        return sampling.greedy or sampling.seed is None
    return bool(gating)


def _bucket(context_tokens: int) -> int:
    """Context-length bucket for verify timings (attention cost grows with the context): log2, floored at 512."""
    return max(9, int(context_tokens).bit_length())


class Curve(dict):
    """Measured points x -> seconds, read piecewise-linearly (``at``); keys kept sorted for a binary search."""

    def __init__(self, *args):
        super().__init__(*args)
        self.xs = sorted(self)
        self._fit: Curve | None = None  # ``rising``'s fit, rebuilt after a change

    def ema(self, x, value: float, floor: float = 0.0) -> None:
        """Fold one timing into x's average; a timing over ``STALL`` x the average (and over ``floor``) counts as
        that much (a step the process was descheduled in, a garbage collection): one stall must not price a budget
        out for the ~100 steps until a probe measures it again, while a real rise still passes, by 1.3x per
        timing. ``floor``: timings up to it are never a stall (drafting: a plain step; a drafter whose cost
        varies from step to step, like a lookup chain that alone fills the budget or else a block drafting deep,
        is priced at its mean, not at its cheap steps)."""
        old = self.get(x)
        self[x] = value if old is None else COST_DECAY * old + (1 - COST_DECAY) * min(value, max(STALL * old, floor))

    def at(self, x: float) -> float | None:
        """Piecewise-linear through the points; flat beyond the last one; None when there are none."""
        xs = self.xs
        if not xs:
            return None
        i = bisect.bisect_left(xs, x)
        if i == 0:
            return self[xs[0]]
        if i == len(xs):
            return self[xs[-1]]
        lo, hi = xs[i - 1], xs[i]
        return self[lo] + (x - lo) / (hi - lo) * (self[hi] - self[lo])

    def rising(self, x: float) -> float | None:
        """``at(x)`` on the points' non-decreasing least-squares fit (pool adjacent violators), for a cost that cannot
        fall as x grows: one lucky low timing must not make more work look cheaper than less."""
        if self._fit is None:
            blocks: list[list[float]] = []  # [sum, count] of pooled neighbours, means non-decreasing
            for x_ in self.xs:
                blocks.append([self[x_], 1])
                while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
                    total, count = blocks.pop()
                    blocks[-1][0] += total
                    blocks[-1][1] += count
            self._fit = Curve(zip(self.xs, [b[0] / b[1] for b in blocks for _ in range(b[1])]))
        return self._fit.at(x)

    def __setitem__(self, x, y) -> None:
        self._fit = None
        if x not in self:
            bisect.insort(self.xs, x)
        dict.__setitem__(self, x, y)


@dataclass
class GateProfile:
    """What one target model's requests learn for the next ones (kept per target module, see ``profile_for``)."""

    verify_s: dict[int, Curve] = field(default_factory=dict)  # context bucket -> nodes -> seconds
    carried: dict[str, dict] = field(default_factory=dict)  # drafter name -> its last request's estimates

    def record_verify(self, context_tokens: int, nodes: int, seconds: float) -> None:
        self.verify_s.setdefault(_bucket(context_tokens), Curve()).ema(nodes, seconds)

    def verify_cost(self, context_tokens: int, nodes: float) -> float | None:
        """Seconds to verify ``nodes`` nodes (0 = a plain step); None before the bucket's first plain step. Beyond
        this bucket's node counts, the nearest bucket that measured them lends its ratio to its plain step. Read
        non-decreasing in ``nodes`` (``Curve.rising``): verifying more nodes never costs less than fewer, whatever
        one noisy timing said (else a draft nothing accepts could look faster than a plain step)."""
        here = _bucket(context_tokens)
        table = self.verify_s.get(here, Curve())
        if 0 not in table:
            return None
        if nodes > table.xs[-1]:
            for other_bucket in sorted(self.verify_s, key=lambda k: abs(k - here)):
                other = self.verify_s[other_bucket]
                if other_bucket == here or 0 not in other or other.xs[-1] < nodes:
                    continue
                plain = other.rising(0)
                if plain > 0:
                    return max(table.rising(nodes), table.rising(0) * other.rising(nodes) / plain)
        return table.rising(nodes)


_PROFILES: "weakref.WeakKeyDictionary[object, GateProfile]" = weakref.WeakKeyDictionary()


def profile_for(target) -> GateProfile:
    """The shared ``GateProfile`` of a target module (dropped with it), seeded from ``saved_verify_costs``."""
    prof = _PROFILES.get(target)
    if prof is None:
        prof = _PROFILES[target] = GateProfile()
        for context, nodes, seconds in saved_verify_costs(target):
            prof.record_verify(context, nodes, seconds)
    return prof


def saved_profile_path(target):
    """Where ``retrospec profile`` keeps its measurements for ``target``'s shapes on this machine (keyed like the
    engine plan), or None for a model without decoder/head accessors."""
    from .fastpath.plan import model_plan_key
    from .paths import cache_home

    key = model_plan_key(target)
    return cache_home() / "profiles" / f"{key}.json" if key else None


def saved_verify_costs(target) -> list[tuple[int, int, float]]:
    """(context tokens, draft nodes, seconds) of the saved profile's chain forwards; [] when there is none."""
    import json

    try:
        path = saved_profile_path(target)
        data = json.loads(path.read_text()) if path is not None else {}
        return [(int(c), int(t) - 1, float(ms) / 1e3) for c, row in data.get("forward_ms", {}).items()
                for t, ms in row.items()]
    except (OSError, ValueError, TypeError, AttributeError):
        return []  # absent or unreadable: the gate measures for itself


class Gate:
    """Chooses the node budget of each step for one request; ``enabled=False`` always hands over the full room."""

    def __init__(self, profile: GateProfile, drafter_name: str, enabled: bool = True):
        self.profile, self.name, self.enabled = profile, drafter_name, enabled
        self.draft_s = Curve({0: 0.0})  # budget -> EMA seconds in propose() (budget 0 drafts nothing)
        # index b: decayed sums over steps with budget >= b of what budget b would have given
        self.acc: list[float] = [0.0]  # accepted tokens
        self.nodes: list[float] = [0.0]  # drafted nodes (what verification pays for)
        self.wgt: list[float] = [0.0]  # observations
        self.top = 0  # largest budget tried
        self.tried = 0  # largest budget tried by this request (carried estimates may reach above it)
        self.filled_top = False  # the drafter filled the top budget at least once (it may want more)
        self.since_probe = 0
        self.last_probe = 0  # budget of the last probe while it may still be climbing (0: none)
        self.last_full = False  # the last step's whole draft was accepted
        self.context = 0
        last = profile.carried.get(drafter_name) if enabled else None
        self.warm = last is not None  # False until a drafting step has been timed twice (the first is a warm-up)
        self.redo = 0  # the budget of the warm-up step, drafted again at once to replace its timing
        if last is not None:  # start from the last request's estimates, worth at most CARRY_WEIGHT steps each
            self.acc, self.nodes, self.wgt = list(last["acc"]), list(last["nodes"]), list(last["wgt"])
            self.draft_s, self.top, self.filled_top = Curve(last["draft_s"]), last["top"], last["filled_top"]

    # ---- estimates -------------------------------------------------------------------------------------------
    def expected_tokens(self, b: int) -> float:
        return 1.0 if b == 0 else 1.0 + self.acc[b] / self.wgt[b]

    def step_cost(self, b: int) -> float | None:
        """Estimated seconds per step with budget b: drafting plus verifying the expected node count."""
        if b >= len(self.wgt):
            return None
        nodes = 0.0 if b == 0 else self.nodes[b] / self.wgt[b]
        verify = self.profile.verify_cost(self.context, nodes)
        draft = self.draft_s.at(b) if b <= self.draft_s.xs[-1] else None
        return None if verify is None or draft is None else draft + verify

    def rates(self) -> dict[int, float]:
        """Estimated tokens per second for budgets 0..top; tokens per step never fall as the budget grows (a
        larger draft contains the smaller one)."""
        out, tokens = {}, 1.0
        for b in range(0, self.top + 1):
            tokens = max(tokens, self.expected_tokens(b))
            c = self.step_cost(b)
            if c is not None and c > 0:
                out[b] = tokens / c
        return out

    # ---- decisions -------------------------------------------------------------------------------------------
    def choose(self, room: int, context_tokens: int) -> int:
        """The node budget for the next step (<= room)."""
        if not self.enabled or room <= 0:
            return max(0, room)
        self.context = context_tokens
        if self.profile.verify_cost(context_tokens, 0) is None:
            return 0  # measure plain decoding once for this target and context size
        if self.top == 0:
            return 1  # the first request of this drafter on this target: start the ramp
        if self.redo:
            return min(room, self.redo)  # the warm-up's budget once more, to time it warm
        rates = self.rates()
        best = max(rates, key=lambda b: (rates[b], b))
        if best == self.top:
            self.since_probe = 0
            if self.filled_top:  # the drafter used the whole budget: try a larger one
                return min(room, self._grown())
            return min(room, best)
        return self._probe(room, best)

    def _grown(self) -> int:
        """The next budget above the top: ``GROWTH`` x, or ``SLOW_GROWTH`` x when that step is predicted to cost more
        than ``GROWTH_COST`` x the top's (module docstring). Never below 2 x: a drafter that keeps filling its budget
        still climbs."""
        top = self.top
        now, plain = self.step_cost(top), self.profile.verify_cost(self.context, 0)
        if top < 2 or not now or plain is None:
            return top * GROWTH
        nodes = self.nodes[top] / self.wgt[top]  # expected nodes at the top budget
        verify_top = self.profile.verify_cost(self.context, nodes)  # not None: the bucket has its plain step
        # measured, lent by a neighbour bucket, or flat; at least linear in the nodes beyond what was measured
        verify = max(self.profile.verify_cost(self.context, nodes * GROWTH), plain + (verify_top - plain) * GROWTH)
        draft = (self.draft_s.at(top) or 0.0) * GROWTH
        return top * (GROWTH if draft + verify <= GROWTH_COST * now else SLOW_GROWTH)

    def _could_pay(self, b: int, plain: float) -> bool:
        """Whether a draft of b nodes, all accepted, could beat a plain step: b + 1 tokens against drafting (the
        last probe's seconds per node, times b) plus verifying b nodes."""
        per_node = (self.draft_s.get(self.last_probe) or 0.0) / max(1, self.last_probe)
        verify = self.profile.verify_cost(self.context, b) or plain
        return (b + 1) * plain > per_node * b + verify

    def _probe(self, room: int, best: int) -> int:
        """``best``, or every so often a probe (module docstring)."""
        plain = self.profile.verify_cost(self.context, 0) or 0.0
        if plain <= 0:
            return min(room, best)

        def extra(b: int) -> float:
            return max(0.0, (self.step_cost(b) or plain) - plain)

        probe = max(1, self.top)
        cost = extra(probe)
        if cost > CHEAP_PROBE * plain:
            probe = min(max(1, 2 * best), probe)
            cost = extra(probe)
        # keep climbing at once while the last probe won, or while its whole draft was accepted; in the second case
        # the next probe doubles it (the same probe again would tell nothing new and may lose on every step)
        climbing = self.last_probe > 0 and best == self.last_probe
        if self.last_probe > 0 and self.last_full and not climbing and self._could_pay(2 * self.last_probe, plain):
            probe = max(probe, 2 * self.last_probe)
            climbing = True
        self.since_probe += 1
        if not climbing and self.since_probe < min(PROBE_MAX, max(2.0, cost / (PROBE_OVERHEAD * plain))):
            self.last_probe = 0
            return min(room, best)
        self.since_probe = 0
        self.last_probe = probe if probe > best else 0
        return min(room, probe)

    # ---- feedback --------------------------------------------------------------------------------------------
    def update(self, budget: int, nodes: int, accepted_nodes: list[int], draft_s: float, verify_s: float,
               context_tokens: int, depth_bound: bool = False) -> None:
        """One step's outcome: budget, node count, accepted path (node indices), seconds drafting and verifying.
        ``depth_bound``: the end of the request allowed no draft as deep as the budget (the loop cuts a step's
        depth at the new tokens left): its verification timing counts, its acceptance and drafting time do not
        (they tell what the end of a request allows, not what the budget buys)."""
        self.profile.record_verify(context_tokens, nodes, verify_s)
        self.last_full = nodes > 0 and nodes == budget and len(accepted_nodes) == nodes and not depth_bound
        if not self.enabled or budget == 0 or depth_bound:
            return
        if self.warm:
            self.draft_s.ema(budget, draft_s, floor=self.profile.verify_cost(context_tokens, 0) or 0.0)
        elif self.redo == budget:  # the step after the warm-up, at its budget: this timing replaces the warm-up's
            self.draft_s[budget], self.warm, self.redo = draft_s, True, 0
        else:  # the warm-up: kept until the next step measures the same budget again
            self.draft_s[budget], self.redo = draft_s, budget
        if budget > self.top:
            self.filled_top = False
        below = len(self.acc) - 1  # the largest budget with estimates so far (0: none)
        while len(self.acc) <= budget:  # first time at this budget: a prior worth PRIOR_WEIGHT steps
            b = len(self.acc)
            if below == 0:  # nothing known: acceptance PRIOR_ACCEPT per position, a full draft
                prior_acc, prior_nodes = sum(PRIOR_ACCEPT ** k for k in range(1, b + 1)), float(b)
            else:  # a larger budget behaves like the largest one known until its own steps say otherwise
                prior_acc, prior_nodes = self.acc[below] / self.wgt[below], self.nodes[below] / self.wgt[below]
            self.acc.append(PRIOR_WEIGHT * prior_acc)
            self.nodes.append(PRIOR_WEIGHT * prior_nodes)
            self.wgt.append(PRIOR_WEIGHT)
        self.top, self.tried = max(self.top, budget), max(self.tried, budget)
        if budget == self.top and nodes >= budget:
            self.filled_top = True
        # counterfactual: with budget b the tree's first b nodes, of which the accepted ones have index < b
        j = 0
        for b in range(1, budget + 1):
            while j < len(accepted_nodes) and accepted_nodes[j] < b:
                j += 1
            self.acc[b] = DECAY * self.acc[b] + j
            self.nodes[b] = DECAY * self.nodes[b] + min(nodes, b)
            self.wgt[b] = DECAY * self.wgt[b] + 1.0
        if len(accepted_nodes) < nodes:  # a rejection: a larger budget this request has not tried (only carried
            # estimates there) would have drafted b nodes (as many as now, if the drafter ran short) and committed
            # no more than this step's path; budgets it did try keep what their own steps said
            for b in range(self.tried + 1, len(self.acc)):
                self.acc[b] = DECAY * self.acc[b] + len(accepted_nodes)
                self.nodes[b] = DECAY * self.nodes[b] + (b if nodes >= budget else nodes)
                self.wgt[b] = DECAY * self.wgt[b] + 1.0

    def finish(self) -> None:
        """Hand this request's estimates to the next one of this drafter and target, capped at ``CARRY_WEIGHT``; a
        request that ended inside its warm-up hands nothing on (its one drafting timing may be a first-call stall)."""
        if not (self.enabled and self.top > 0 and self.warm):
            return
        scale = [min(1.0, CARRY_WEIGHT / w) if w > 0 else 1.0 for w in self.wgt]
        self.profile.carried[self.name] = {
            "acc": [a * f for a, f in zip(self.acc, scale)], "nodes": [n * f for n, f in zip(self.nodes, scale)],
            "wgt": [w * f for w, f in zip(self.wgt, scale)], "draft_s": dict(self.draft_s), "top": self.top,
            "filled_top": self.filled_top}
