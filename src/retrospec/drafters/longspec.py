"""``longspec``: a one-block draft that reads the target's KV cache drafts a chain or a beam tree (LongSpec: Yang et
al., "LongSpec: Long-Context Lossless Speculative Decoding with Efficient Drafting and Verification", sail-sg 2025).

The draft block (``models.longspec``) attends to a sliding window of its own keys/values (a fixed-size ring buffer,
``DraftState``) and cross-attends to the target's last-layer K/V (the read-only ``target_kv`` view declared in
``needs``). Its memory does not grow with the context.

Both modes draft deterministically (``draft_probs=None`` = one-hot q), verified exactly by ``GreedyMatch`` or the
multi-draft ``RejectionSampling`` at any temperature:
- chain (``gamma=N``): the draft's argmax chain of N tokens.
- tree (default ``tree=(4, 16, 16, 16, 16)``), handed out best first (EAGLE-2's re-ranking: Li et al., "EAGLE-2:
  Faster Inference of Language Models with Dynamic Draft Trees", 2024): depth 1 = the root's top-``w1`` tokens; each
  later depth runs the draft once over the previous level (batched, tree mask) and keeps the global top-``w_d``
  (node, token) pairs by cumulative draft log-prob (raw, whatever the temperature). The tree is the ``budget`` nodes
  of highest cumulative log-prob over every depth, best first: a smaller budget drafts a prefix of a larger one, and
  a confident draft goes deep in few nodes (a breadth-first cut of 8 nodes never passes depth 2). A depth is drafted
  only while one of its children could still enter the best ``budget``. Siblings are distinct tokens (a top-k over
  node x vocabulary), which makes the one-hot multi-draft rule exact (the seed's p/q rejection over top-k children
  is biased: not done here). Nothing is drafted below an EOS.

Lookup branch (``lookup=K``, default 10; ours, not in the paper): the prompt-lookup chain (``pld``'s n-gram match
over prompt + output, K tokens) is drafted first and the block's chain or tree is merged into it as a trie (a block
node equal to a chain node at the same place is shared), so siblings stay distinct and the tree stays deterministic:
the same rules verify it exactly. Order: chain nodes, then the block's new nodes in their own order, cut at the
budget, so a smaller budget drafts a prefix of a larger one (what the gate assumes).

Target features (a block with ``features``, EAGLE-3-style): the drafter also declares ``layer_states`` and names the
block's layers in ``feature_layers``; the decode loop hands it the target's outputs of those layers at the row that
produced the root, fused into the root's feature (``target_feature``); every drafted token reads its parent's output
(``DraftState.speculate``). One level per block call, as the tree is drafted anyway.

Speed: the block's fast copy (``fast_block``: possibly bfloat16, int8 or 4-bit) changes what is proposed, never the
output.
State consistency: the ring holds every committed token but the last, like the target's cache. ``observe`` only
gets counts and runs before the loop extends ``ctx.tokens``, so the ring catches up from ``ctx.tokens`` itself
when a ``propose`` calls the block (a step the gate leaves undrafted, or one the lookup chain fills alone, does
not touch it: the tokens it missed are appended in one call when the block drafts again), and every tentative
token is dropped at its end. After any step that called the block the ring equals one rebuilt from the committed
tokens (tested); the target cache length is checked against it at each of those steps.
"""

from __future__ import annotations

import sys
import threading
import weakref
from pathlib import Path

import torch

from ..errors import RetrospecError
from ..fastpath import compiled_block
from ..fastpath.draft import draft_choice, fast_copy, row_product
from ..models.longspec import DraftState, KeyBuffer, LongSpecDraft, load_longspec
from ..types import DraftTree
from .base import DecodeContext, as_module, chain_room
from .prompt_lookup import PromptLookupDrafter
from .registry import MAX_DRAFT, Knob, MethodSpec, register

DEFAULT_TREE = (4, 16, 16, 16, 16)
DEFAULT_LOOKUP = 10  # measured (docs/results.md, "longspec's lookup branch"): chat 1.18x -> 1.30x, MBPP 1.42x -> 1.94x over ar


MAX_TREE_WIDTH = 256  # nodes per depth: one verification's work stays bounded


def parse_tree(spec) -> tuple[int, ...]:
    """``"4,16,16"`` or a sequence of ints -> (4, 16, 16); widths per depth, each >= 1."""
    try:
        widths = tuple(int(w) for w in (spec.split(",") if isinstance(spec, str) else spec))
    except (TypeError, ValueError):
        raise RetrospecError(f"tree must be comma-separated widths per depth, e.g. 4,16,16; got {spec!r}") from None
    if not widths or any(w < 1 for w in widths):
        raise RetrospecError(f"tree widths must be >= 1 (one per depth, e.g. 4,16,16); got {spec!r}")
    if len(widths) > MAX_DRAFT or max(widths) > MAX_TREE_WIDTH:
        raise RetrospecError(f"tree: at most {MAX_DRAFT} depths of width <= {MAX_TREE_WIDTH}; got {spec!r}")
    return widths


def fast_block(block: LongSpecDraft, remeasure: bool = False) -> LongSpecDraft:
    """The block as drafting runs it: a private copy sharing the weights, its linears and, measured apart, its head
    rows each in the matmul path measured fastest for them (``fastpath.draft``; either may run in int8 or 4 bits),
    its drafting calls one compiled program where that is wanted and pays (``fastpath.compiled_block``). The block
    itself is left as it is."""
    rows = block.head_rows if block.head_rows is not None else block.lm_head.weight  # [K, H]
    weights = [m.weight for m in block.modules() if type(m) is torch.nn.Linear]
    choice = draft_choice(weights, remeasure=remeasure, quantized=True)  # no linears: plain
    head = draft_choice([rows], remeasure=remeasure, quantized=True)
    program = compiled_block.wanted(block)
    if choice == head == "plain" and not program:
        return block
    fast = fast_copy(block, choice, shared=(block.embed_tokens, block.lm_head), private=True)
    if getattr(fast, "head_choice", None) != head:  # a copy reused from the cache keeps its head when it is the same
        fast.head_fn, fast.head_choice = row_product(rows, head), head
    if program:
        with _BUILD_LOCK:  # built once per copy (the copy is cached), by one thread
            if getattr(fast, "program_info", None) is None:
                fast.program_built, fast.program_info = compiled_block.build(fast, progress=_say)
        fast.program = fast.program_built
    else:  # no longer wanted (RETROSPEC_COMPILE changed in this process): the copy drafts through its modules
        fast.program = None
    return fast


_BUILD_LOCK = threading.Lock()


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class LongSpecDrafter:
    name = "longspec"
    needs: frozenset[str] = frozenset({"target_kv"})

    def __init__(self, block: LongSpecDraft, gamma: int | None = None, tree=None, lookup: int = 0,
                 nodes: int | None = None):
        if gamma is not None and tree is not None:
            raise RetrospecError("longspec drafts a chain (gamma) or a tree (tree), not both")
        self.block = block
        self.feature_layers = tuple(block.features)  # the target layers whose outputs feed the block (or none)
        if self.feature_layers:
            self.needs = frozenset({"target_kv", "layer_states"})
        self.lookup = PromptLookupDrafter(k=lookup) if lookup > 0 else None
        self.fast = fast_block(block)  # what drafts: the block's fast copy (its weights, or integer copies of them)
        self.gamma = gamma
        self.tree = None if gamma is not None else parse_tree(DEFAULT_TREE if tree is None else tree)
        self.nodes = nodes  # at most this many nodes a step, whatever the budget (None: the budget's)
        self.state: DraftState | None = None
        self.root_feature: torch.Tensor | None = None  # [H] the root's feature (a block with features)

    def prefill(self, ctx: DecodeContext) -> None:
        if self.lookup is not None:
            self.lookup.prefill(ctx)
        self.state = DraftState(self.fast)
        self.state.append(ctx.tokens[:-1])

    def _sync(self, ctx: DecodeContext) -> KeyBuffer | tuple[torch.Tensor, torch.Tensor] | None:
        """Commit the tokens the ring lacks (all but the root); return the target's last-layer keys and values (its
        buffers, or (k, v) views where the cache does not keep its layers in buffers)."""
        state = self.state
        state.rollback()
        state.append(ctx.tokens[state.length: len(ctx.tokens) - 1])
        kv = ctx.target.kv
        last = kv.last_buffers() if kv is not None else None  # read in place where the cache has them
        if last is None and kv is not None:
            last = kv.last_layer()
        cached = 0 if last is None else last.filled if isinstance(last, KeyBuffer) else int(last[0].shape[2])
        if cached != state.length:
            raise RetrospecError(f"longspec needs the target's full last-layer KV cache of the committed tokens; it "
                                 f"holds {cached} positions for {state.length} committed tokens")
        return last

    @torch.no_grad()
    def propose(self, ctx: DecodeContext, budget: int) -> DraftTree:
        levels = None if self.tree is None else self.tree[: ctx.max_depth]  # the tree's levels that fit
        if self.nodes is not None:
            budget = min(budget, self.nodes)
        n = min(budget, chain_room(ctx, self.gamma) if self.gamma is not None else sum(levels))
        if n <= 0:  # an undrafted step costs nothing here: the ring catches up when drafting resumes (one append)
            return DraftTree.empty()
        chain = self.lookup.propose(ctx, budget) if self.lookup is not None else DraftTree.empty()
        if len(chain) >= budget:  # the lookup chain fills the budget: graft would cut every block node, so the
            self.root_feature = None  # block is not called and its ring catches up when it next drafts
            return chain
        target_kv = self._sync(ctx)
        states = ctx.target.layer_states  # [n, H] or None
        self.root_feature = None if states is None else self.fast.target_feature(states.to(self.state.k.dtype))
        try:
            logits = self._speculate([ctx.tokens[-1]], [-1], target_kv)[0]  # [K] after the root
            if self.gamma is not None:
                tree = self._chain(logits, n, target_kv, ctx.eos_ids)
            else:
                tree = self._tree(logits, n, target_kv, ctx.eos_ids, levels)
        finally:
            self.state.rollback()
        return graft(chain, tree, budget) if len(chain) else tree

    def _speculate(self, ids, parents, target_kv) -> torch.Tensor:
        return self.state.speculate(ids, parents, target_kv, root_feature=self.root_feature)

    def _chain(self, logits: torch.Tensor, n: int, target_kv, eos_ids) -> DraftTree:
        tokens: list[int] = []
        for i in range(n):
            tok = int(self.block.token_ids(logits.argmax()))
            tokens.append(tok)
            if tok in eos_ids or i + 1 == n:
                break
            logits = self._speculate([tok], [i], target_kv)[0]  # parent: tentative token i (0 = the root)
        return DraftTree.chain(tokens)

    def _expand(self, scores: torch.Tensor, toks: torch.Tensor, logits: torch.Tensor, k: int, eos: torch.Tensor):
        """The best ``k`` children of a level: (node, token) pairs by cumulative log-prob over every node and draft
        column, best first; no child below an EOS token, siblings distinct. ``scores``: [L] the nodes' cumulative
        log-probs, ``toks``: [L] their target ids, ``logits``: [L, V] the block's logits after each. Returns (scores
        [k'], node rows (list), target ids [k']), k' <= k. The global best k are among each node's own best k, so
        only [L, k] candidates are ranked, never [L, V]."""
        logits = logits.float()
        k = min(k, logits.shape[-1])
        top, cols = logits.topk(k, dim=-1)  # [L, k] each node's best columns, best first
        cand = scores[:, None] + (top - logits.logsumexp(-1, keepdim=True))  # [L, k] cumulative log-probs
        cand = torch.minimum(cand, scores[:, None])  # a child never above its parent, whatever the rounding
        if eos.numel():
            cand[torch.isin(toks, eos)] = float("-inf")  # nothing follows an EOS token
        best, flat = cand.flatten().topk(min(k, cand.numel()))  # [k] best first
        live = torch.isfinite(best)
        best, flat = best[live], flat[live]
        rows = flat // k
        return best, rows.tolist(), self.block.token_ids(cols[rows, flat % k])

    def _tree(self, root_logits: torch.Tensor, n: int, target_kv, eos_ids, levels: tuple[int, ...]) -> DraftTree:
        """The best ``n`` nodes of the beam of ``levels`` (widths per depth: ``self.tree``, or its first levels near
        the end of a generation) by cumulative draft log-prob, best first (module docstring)."""
        vocab = root_logits.shape[-1]  # K columns (the draft vocabulary, or the target's V)
        eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=root_logits.device)
        k = min(levels[0], n, vocab)
        scores, cols = root_logits.float().log_softmax(-1).topk(k)  # [k] cumulative log-probs, best first
        toks = self.block.token_ids(cols)  # target ids (columns differ under a draft vocabulary)
        tokens, parents, found = toks.tolist(), [-1] * k, scores.tolist()  # every node drafted, in drafting order
        level = list(range(k))  # tree indices of the last level, best first (tentative index = tree index + 1)
        for width in levels[1:]:
            floor = sorted(found, reverse=True)[n - 1] if len(found) >= n else float("-inf")  # the n-th best so far
            if found[level[0]] <= floor:  # no child of this level can enter the best n: it would score at most its
                break                     # parent's, and ties go to the node drafted first
            logits = self._speculate(toks, [p + 1 for p in parents[level[0]: level[-1] + 1]], target_kv)
            # no more than n children: the best n over every depth hold at most n of any one depth
            scores, rows, toks = self._expand(scores, toks, logits, min(width, n), eos)
            k = len(rows)
            if k == 0:
                break
            parents.extend(level[j] for j in rows)
            level = list(range(len(tokens), len(tokens) + k))
            tokens.extend(toks.tolist())
            found.extend(scores.tolist())
        keep = sorted(range(len(tokens)), key=lambda i: (-found[i], i))[:n]  # best first, so parents before children
        index = {old: new for new, old in enumerate(keep)}
        return DraftTree(torch.tensor([tokens[i] for i in keep], dtype=torch.long),
                         torch.tensor([index[parents[i]] if parents[i] >= 0 else -1 for i in keep], dtype=torch.long))

    def observe(self, accepted: int, drafted: int) -> None:
        """Nothing to do: the ring catches up with the committed tokens at the next ``propose`` (module docstring)."""

    def state_bytes(self) -> int:
        """Bytes of the ``DraftState`` (ring buffer and tentative tokens): the same at any context length."""
        return self.state.nbytes() if self.state is not None else 0


def graft(chain: DraftTree, tree: DraftTree, budget: int) -> DraftTree:
    """``chain``'s nodes, then ``tree``'s nodes not already in it (same token below the same node), at most
    ``budget`` nodes; parents stay before children and siblings stay distinct."""
    tokens, parents = chain.tokens.tolist(), chain.parents.tolist()
    where = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens))}  # (parent, token) -> node
    new = []  # tree node -> merged node
    for t, p in zip(tree.tokens.tolist(), tree.parents.tolist()):
        key = (new[p] if p >= 0 else -1, t)
        if key not in where:
            where[key] = len(tokens)
            tokens.append(t)
            parents.append(key[0])
        new.append(where[key])
    return DraftTree(torch.tensor(tokens[:budget], dtype=torch.long), torch.tensor(parents[:budget], dtype=torch.long))


def load_block(draft, target) -> LongSpecDraft:
    """The LongSpec block for ``target`` from a block directory, a bundled block name (``smollm2-135m-longspec``)
    or a ``LongSpecDraft`` bound to this target; None is refused."""
    from ..models.named import longspec_dir

    model = as_module(target)
    if draft is None:
        raise RetrospecError("method 'longspec' needs a LongSpec draft block (--draft DIR|NAME / draft=...: a "
                             "directory written by 'retrospec train longspec', a bundled block name such as "
                             "smollm2-135m-longspec, or a LongSpecDraft); this target has no bundled block")
    if isinstance(draft, LongSpecDraft):
        if not draft.uses(model):
            raise RetrospecError("the LongSpecDraft passed as draft is bound to another model than the target; pass "
                                 "its directory, or load it with load_longspec(dir, target)")
        return draft
    if isinstance(draft, (str, Path)):
        return load_longspec(longspec_dir(draft), model)
    raise RetrospecError(f"method 'longspec' takes a LongSpec block directory or a LongSpecDraft as draft, got "
                         f"{type(draft).__name__}")


# target module -> {(block directory, its files' stamps): the block loaded from it}; see ``shared_block``
_SHARED: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, LongSpecDraft]]" = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()
SHARED_PER_TARGET = 4  # blocks kept per target (the least recently used dropped first)


def shared_block(draft, target) -> LongSpecDraft:
    """``load_block`` for requests: a block given as a directory or name is loaded once per target module and reused
    while its files stay the same (name, size, inode, modification and change times) and it still reads the target's
    own embedding and head where they are (device, dtype), as ``load_model`` reuses models, so a request does not pay
    loading the block and packing its head again (~0.2 s for the bundled block on a 2-core CPU). The block is shared
    between requests and only read by them (each target keeps at most ``SHARED_PER_TARGET``, with their drafting
    copies); code that changes a block loads its own with ``load_block``."""
    if not isinstance(draft, (str, Path)):
        return load_block(draft, target)
    from ..models.named import longspec_dir

    model, path = as_module(target), longspec_dir(draft)
    try:
        stats = [(f.name, f.stat()) for f in path.iterdir()]
    except OSError:  # not a directory: load_block says why
        return load_block(path, model)
    where = str(path.resolve())
    key = (where, tuple(sorted((n, st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns) for n, st in stats)))
    ref = model.get_input_embeddings().weight
    with _SHARED_LOCK:
        kept = _SHARED.setdefault(model, {})
        block = kept.pop(key, None)
        if block is None or not block.uses(model) or block.norm1.weight.device != ref.device \
                or block.norm1.weight.dtype != ref.dtype:
            for old in [k for k in kept if k[0] == where]:  # the directory's earlier contents
                del kept[old]
            block = load_block(path, model)
        kept[key] = block  # the most recently used last
        while len(kept) > SHARED_PER_TARGET:
            kept.pop(next(iter(kept)))
    return block


def longspec_options(draft, target, gamma: int | None, tree) -> dict:
    """Validated ``longspec`` factory options (``request.prepare``): the block (``shared_block``), chain length or
    tree shape."""
    if gamma is not None and tree is not None:
        raise RetrospecError("longspec drafts a chain (gamma / --gamma) or a tree (tree / --tree), not both")
    return {"block": shared_block(draft, target), "gamma": gamma, "tree": None if tree is None else parse_tree(tree)}


def load_longspec_block(spec: MethodSpec, target, draft, options: dict, *, context: bool, load: dict):
    """``MethodSpec.resolve`` for ``longspec``: ``draft`` is a LongSpec block (a directory, a block name or a
    ``LongSpecDraft``), else the target's bundled block (``models.paired_longspec``); it goes into the options with
    the chain length or tree shape. The request has no draft LM."""
    from ..models import paired_longspec

    block = paired_longspec(target) if draft is None else draft
    options.update(longspec_options(block, target, options.pop("gamma", None), options.pop("tree", None)))
    return None, options


def _make_longspec(*, target=None, block=None, gamma: int | None = None, tree=None,
                   lookup: int = DEFAULT_LOOKUP, nodes: int | None = None) -> LongSpecDrafter:
    if not isinstance(block, LongSpecDraft):
        block = load_block(block, target)
    return LongSpecDrafter(block, gamma=gamma, tree=tree, lookup=lookup, nodes=nodes)


SPEC = register(MethodSpec(
    "longspec", _make_longspec, "one draft block over the target's KV cache, beam tree",
    knobs=(Knob("gamma", "int", None, "draft a chain of N tokens instead of the tree", min=1,
                max=MAX_DRAFT),
           Knob("tree", "widths", None, "beam tree widths per depth (default 4,16,16,16,16)", parse=parse_tree),
           Knob("lookup", "int", DEFAULT_LOOKUP, "also draft a prompt-lookup chain of N tokens, merged into the "
                "tree (0: off)", min=0, max=MAX_DRAFT),
           Knob("nodes", "int", None, "draft at most N nodes a step (the tree's best N; default: the budget's)",
                min=1, max=MAX_TREE_WIDTH)),
    draft="block", needs=frozenset({"target_kv"}), load=load_longspec_block))
