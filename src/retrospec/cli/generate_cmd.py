"""``retrospec generate``: one prompt, streamed text or one JSON object."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import RetrospecError
from ..models.loading import FORMAT_NAMES


def add_sampling_args(p) -> None:
    p.add_argument("--target", help="target model directory or name, e.g. smollm2-135m (default: zoo, the bundled "
                                    "zoo target); see 'retrospec models list'")
    p.add_argument("--draft", help="draft model directory or name (default for sd: the target's paired draft when "
                                   "the target is a name or unset, e.g. zoo -> zoo-draft)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-gating", action="store_true",
                   help="draft the full budget every step (default: the gate drafts only as much as pays, down to "
                        "plain decoding; greedy output is identical either way; seeded sampling runs ungated so "
                        "the seed reproduces the sample). bench: a method label m@gating=0|1 sets it for one "
                        "method, so one run compares both, e.g. --methods ar,rest,rest@gating=0")
    p.add_argument("--chat", action="store_true",
                   help="each prompt is one user message under the target's chat template; generation stops at "
                        "the template's end-of-turn token")


def add_device_args(p) -> None:
    """``--device`` and ``--dtype`` for the target and the draft (``device_kwargs`` reads them)."""
    p.add_argument("--device", default="cpu", help="cpu (default) | cuda | cuda:N | auto (cuda when present)")
    p.add_argument("--dtype", default="float32", choices=FORMAT_NAMES,
                   help="the weight format of the target and the draft (default float32; 16-bit is for GPUs and "
                        "CPUs with native bf16/fp16 matmuls; int8 / int4: weight-only quantized linears on the CPU, "
                        "a model of its own; w8a8: int8 weights and int8 activation rows, integer matmuls whose cost "
                        "hardly grows with the tokens verified; w4a8: int4 weights and int8 activation blocks, integer "
                        "dot products (llama.cpp's Q4_1 computation; CPUs with AVX-512 VNNI, a kernel compiled once); "
                        "gguf: the blocks of the GGUF file the model was converted from, run "
                        "natively (smollm2-135m: the published Q4_1 file; a draft not converted from a GGUF runs in "
                        "float32)). Every lossless method is token-identical to ar in the same format")


def device_kwargs(args) -> dict:
    """``{"device", "dtype"}`` for ``load_model`` / ``api.generate`` (validated there: one line on a bad value)."""
    return {"device": args.device, "dtype": args.dtype}


def add_knob_args(p, multiple_datastores: bool = False, skip: tuple[str, ...] = ()) -> None:
    """One flag per method knob of the registry (``drafters.registry``): ``--gamma``, ``--tree``, ``--datastore``,
    ... The help says which methods take it; ``knob_kwargs`` checks that the chosen method does."""
    from ..drafters.registry import SPECS, all_knobs

    g = p.add_argument_group("method knobs", "each applies to the methods named in its help")
    for name, knob in all_knobs().items():
        if name in skip:
            continue
        users = [(m, s.knob(name)) for m, s in SPECS.items() if s.knob(name) is not None]
        defaults = ", ".join(f"{m}: {k.default}" if k.default not in (None, False) else m for m, k in users)
        kw: dict = {"default": None, "help": f"{knob.help} ({defaults})"}
        if knob.kind == "bool":
            kw["action"] = "store_true"
        elif name == "datastore" and multiple_datastores:
            kw.update(action="append", default=[], metavar="DIR",
                      help="retrieval store for rest (suffix) / dresd (dense); repeat to give both")
        else:
            kw["type"] = {"int": int, "float": float}.get(knob.kind, str)
            kw["metavar"] = {"path": "DIR", "widths": "W1,W2,..."}.get(knob.kind, name.upper())
        g.add_argument(knob.flag, **kw)


def knob_kwargs(args, method: str, extra: tuple[str, ...] = ()) -> dict:
    """The knob flags given on the command line, checked against ``method``'s spec (flag names in errors);
    ``extra``: knob names accepted whatever the method (with a context: the long-context options)."""
    from ..drafters.registry import SPECS, all_knobs, spec_of

    spec, out = spec_of(method), {}
    for name, knob in all_knobs().items():
        value = getattr(args, name, None)
        if value is None or value is False:
            continue
        if spec.knob(name) is None and name not in extra:
            users = [m for m, s in SPECS.items() if s.knob(name) is not None]
            raise RetrospecError(f"{knob.flag} applies to method{'s' if len(users) > 1 else ''} {', '.join(users)} "
                                 f"only (not {method})")
        if spec.knob(name) is not None:  # extra names pass unchecked
            try:
                knob.check(value)
            except RetrospecError as exc:
                raise RetrospecError(str(exc).replace(name, knob.flag, 1)) from None
        out[name] = value
    return out


def add_parser(sub) -> None:
    from ..drafters.registry import methods

    p = sub.add_parser("generate", help="generate a continuation of one prompt")
    p.add_argument("--method", default=None,
                   help=f"{' | '.join(methods(context=False))}; with --context-file: {' | '.join(methods(True))} "
                        "(default: the target's fastest lossless method: longspec with its bundled block, else sd "
                        "with its paired draft, else pld; with --context-file sd). rest / dresd need --datastore; "
                        "longspec's --draft is a LongSpec block (default: the target's bundled one)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file whose whole content is the prompt")
    add_sampling_args(p)
    add_device_args(p)
    add_knob_args(p)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    from .context_args import add_long_context_args

    add_long_context_args(p)
    p.set_defaults(func=run)


def read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    path = Path(args.prompt_file)
    if not path.is_file():
        raise RetrospecError(f"prompt file not found: {path}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise RetrospecError(f"prompt file is not UTF-8 text: {path}") from None


JSON_STATS = ("method", "new_tokens", "target_calls", "drafted_tokens", "accepted_tokens", "mean_accepted_tokens",
              "acceptance_rate", "prefill_s", "decode_s", "tokens_per_s", "gating", "gated_steps", "draft_shapes")


LONG_STATS = ("rule", "lossless", "prompt_tokens", "retrieval_s", "retrieved_tokens", "draft_s", "verify_s")


def run(args) -> int:
    from ..api import stream
    from ..drafters import default_method
    from ..request import CONTEXT_OPTIONS
    from .context_args import long_context_kwargs, read_context

    context = read_context(getattr(args, "context_file", None))
    long_kwargs = long_context_kwargs(args)
    if context is None and long_kwargs:
        raise RetrospecError("long-context options need --context-file FILE")
    method = args.method if args.method is not None else default_method(args.target, args.draft,
                                                                          context=context is not None)
    s = stream(read_prompt(args), chat=args.chat, target=args.target, draft=args.draft, method=method,
               max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
               seed=args.seed, stop=args.stop, gating=False if args.no_gating else None, **device_kwargs(args),
               **({"context": context} | long_kwargs if context is not None else {}),
               **knob_kwargs(args, method, CONTEXT_OPTIONS if context is not None else ()))
    if args.json:
        for _ in s.token_chunks():
            pass
        res = s.result
        full = res.stats.to_dict()
        stats = {k: full[k] for k in JSON_STATS} | {"per_position_acceptance": full["per_position_acceptance"]}
        if context is not None:
            stats |= {k: full[k] for k in LONG_STATS}
        print(json.dumps({"text": res.text, "token_ids": res.token_ids, "stats": stats}))
        return 0
    for piece in s:
        sys.stdout.write(piece)
        sys.stdout.flush()
    st = s.result.stats
    print(f"\n[{st.method}] {st.new_tokens} tokens, {st.tokens_per_s:.1f} tok/s, tau {st.mean_accepted_tokens:.2f}, "
          f"acceptance {st.acceptance_rate:.2f}, prefill {st.prefill_s * 1000:.0f} ms"
          + (f", retrieval {st.retrieval_s * 1000:.0f} ms ({st.retrieved_tokens} tokens)" if context is not None else "")
          + (f", {st.gated_steps} steps gated to no draft" if st.gated_steps else "")
          + ("" if st.lossless else f", LOSSY rule {st.rule}"), file=sys.stderr)
    return 0
