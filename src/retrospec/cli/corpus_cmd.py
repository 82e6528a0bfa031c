"""``retrospec corpus generate``: the target's own outputs to many prompts, batched, sharded and resumable
(``corpus``); ``corpus info`` prints a corpus's manifest; ``corpus export`` writes it as text for datastores;
``corpus pack`` / ``unpack`` turn it into three compressed files and back, byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import RetrospecError


def add_parser(sub) -> None:
    p = sub.add_parser("corpus", help="a corpus of the target's own outputs (for drafts and datastores)")
    verbs = p.add_subparsers(dest="verb", required=True, parser_class=type(p))
    g = verbs.add_parser("generate", help="generate the target's replies to prompt sources (resumable)")
    g.add_argument("--target", help="target model directory or name (default: the bundled zoo target)")
    g.add_argument("--sources", required=True,
                   help="comma-separated: mbpp=PATH (raw code completion), nq=PATH (NQ-open questions, train split, "
                        "chat), stdlib[=N] (function openings from the stdlib's train split), self-instruct=N "
                        "(instructions the target writes itself, then answers), tasks=N (the same, each from the "
                        "opening words of a task: summaries, translations, arithmetic, writing ...)")
    g.add_argument("--temperatures", default="0,0.7", help="comma-separated; 0 = greedy (default 0,0.7)")
    g.add_argument("--top-p", type=float, default=0.95, help="for sampled temperatures (default 0.95)")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--batch-size", type=int, default=None,
                   help="sequences decoded together (default 32; with --engine vllm: the whole shard, one "
                        "LLM.generate call)")
    g.add_argument("--limit-per-source", type=int, default=None, metavar="N",
                   help="use the first N rows of each source")
    g.add_argument("--shard-size", type=int, default=128, help="items per shard file (default 128)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-prompt-tokens", type=int, default=1024, help="longer prompts are skipped")
    g.add_argument("--out", required=True, help="corpus directory (rerun the same command to resume)")
    g.add_argument("--engine", choices=("retrospec", "vllm"), default="retrospec",
                   help="what generates: retrospec (default: batched decoding in this process) or vllm (vLLM's "
                        "offline LLM.generate in its own interpreter: make peers-vllm or $RETROSPEC_VLLM_PYTHON; "
                        "the same corpus format, each record sampled with its own seed)")
    g.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="--engine vllm: GPUs the target is split over (vLLM's tensor_parallel_size; default 1)")
    from .generate_cmd import add_device_args

    add_device_args(g)
    g.set_defaults(func=run_generate)
    e = verbs.add_parser("export", help="write a corpus as a text .jsonl ('prompt', chat template included, and "
                                        "'completion' = the reply) for 'datastore build --corpus' (in-domain REST / "
                                        "DReSD stores, built from prompt + completion)")
    e.add_argument("path", help="corpus directory")
    e.add_argument("--out", required=True, help=".jsonl file to create")
    e.add_argument("--target", help="the corpus's target (its tokenizer decodes the ids; default: the bundled zoo "
                                    "target)")
    e.add_argument("--skip-heldout", type=float, default=0.0, metavar="SHARE",
                   help="leave out the prompts 'train longspec-distill --heldout SHARE' holds out (default 0: none)")
    e.add_argument("--heldout-prompts", type=float, default=None, metavar="SHARE",
                   help="write instead the prompts that --heldout SHARE holds out, once each, as 'prompt' lines "
                        "for 'bench --prompts' (held-out prompts of the corpus's own distribution; chat ones with "
                        "--chat); no model is loaded")
    e.add_argument("--heldout-records", type=float, default=None, metavar="SHARE",
                   help="write instead the records --heldout SHARE holds out, for 'datastore eval --corpus' (it "
                        "scores a store on their completions)")
    e.add_argument("--source", default=None, metavar="NAME[,NAME]",
                   help="only the records of these prompt sources (e.g. stdlib, or self-instruct,tasks)")
    e.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="only the records sampled at this temperature (0: the greedy replies, what a greedy decode "
                        "meets)")
    e.set_defaults(func=run_export)
    i = verbs.add_parser("info", help="print a corpus's manifest")
    i.add_argument("path")
    i.set_defaults(func=run_info)
    k = verbs.add_parser("pack", help="pack a corpus into three compressed files (token ids as uint16, xz), small "
                                      "enough to keep in a repository")
    k.add_argument("path", help="corpus directory")
    k.add_argument("--out", required=True, help="folder to create for the pack")
    k.add_argument("--level", type=int, default=6, choices=range(10), metavar="0-9",
                   help="xz level (default 6; 1 is several times faster and ~10%% larger)")
    k.set_defaults(func=run_pack)
    u = verbs.add_parser("unpack", help="write the corpus directory back from a pack, byte for byte (checked)")
    u.add_argument("path", help="pack folder ('corpus pack --out')")
    u.add_argument("--out", required=True, help="corpus directory to create (absent or empty)")
    u.set_defaults(func=run_unpack)


def run_pack(args) -> int:
    from ..corpus.pack import pack

    info = pack(args.path, args.out, args.level)
    size = sum(f.stat().st_size for f in Path(args.out).iterdir())
    print(f"{args.out}: {info['records']:,} records, {info['tokens']:,} token ids in {size / 2**20:.2f} MiB")
    return 0


def run_unpack(args) -> int:
    from ..corpus.pack import unpack

    manifest = unpack(args.path, args.out)
    print(f"{args.out}: {len(manifest.get('shards', {}))} shards, {manifest.get('output_tokens', 0):,} output tokens")
    return 0


def run_generate(args) -> int:
    from ..corpus import CorpusBuilder, CorpusConfig, load_rows, parse_sources
    from ..models import default_target, load_model

    try:
        temps = tuple(float(t) for t in args.temperatures.split(",") if t.strip())
    except ValueError:
        raise RetrospecError(f"--temperatures must be comma-separated numbers, got {args.temperatures!r}") from None
    if args.tensor_parallel < 1:
        raise RetrospecError(f"--tensor-parallel must be >= 1, got {args.tensor_parallel}")
    if args.engine == "vllm":
        from ..bench.vllm_corpus import DTYPES, vllm_python

        vllm_python()  # no vLLM: one line now, before anything loads or is written
        if args.dtype not in DTYPES:
            raise RetrospecError(f"--engine vllm runs the target in {', '.join(DTYPES)}, not {args.dtype}")
    elif args.tensor_parallel != 1:
        raise RetrospecError("--tensor-parallel is vLLM's: use it with --engine vllm")
    sources = parse_sources(args.sources)
    batch = args.batch_size if args.batch_size is not None else args.shard_size if args.engine == "vllm" else 32
    cfg = CorpusConfig(sources=args.sources, temperatures=temps, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                       batch_size=batch, shard_size=args.shard_size, seed=args.seed,
                       max_prompt_tokens=args.max_prompt_tokens)
    if args.limit_per_source is not None and args.limit_per_source < 1:
        raise RetrospecError("--limit-per-source must be >= 1")
    rows = load_rows(sources, args.limit_per_source)
    from .generate_cmd import device_kwargs

    target = load_model(default_target() if args.target is None else args.target, role="target",
                        **device_kwargs(args))
    engine = None
    try:
        if args.engine == "vllm":
            from ..bench.vllm_corpus import VllmCorpusEngine
            from ..corpus.build import INSTRUCTION_TOKENS

            n_ctx = cfg.max_prompt_tokens + max(cfg.max_new_tokens, INSTRUCTION_TOKENS)
            limit = getattr(target.model.config, "max_position_embeddings", None)
            engine = VllmCorpusEngine(target.path, args.dtype, min(n_ctx, limit) if limit else n_ctx, seed=cfg.seed,
                                      tensor_parallel=args.tensor_parallel)
        manifest = CorpusBuilder(target, rows, args.out, cfg, engine=engine).build()
    finally:
        if engine is not None:
            engine.close()
    seconds = manifest["seconds"]
    print(f"{args.out}: {sum(s['records'] for s in manifest['shards'].values()):,} replies, "
          f"{manifest['output_tokens']:,} output tokens in {seconds:.0f} s "
          f"({manifest['output_tokens'] / max(seconds, 1e-9):.0f} tokens/s, {manifest['engine']['name']} engine; "
          f"{'complete' if manifest.get('complete') else 'partial'})")
    return 0


def run_info(args) -> int:
    from pathlib import Path

    from ..corpus.build import read_manifest

    m = read_manifest(Path(args.path))
    print(json.dumps({k: v for k, v in m.items() if k != "shards"}, indent=1))
    return 0


def run_export(args) -> int:
    from pathlib import Path

    from ..atomic import write_text_atomic
    from ..corpus import check_corpus, read_corpus
    from ..models import default_target, load_model
    from ..models.named import DEFAULT_TARGET
    from ..train.longspec_distill import is_heldout

    out = Path(args.out)
    if out.exists():
        raise RetrospecError(f"{out} already exists; choose another --out")
    if not 0 <= args.skip_heldout < 1:
        raise RetrospecError(f"--skip-heldout must be in [0, 1), got {args.skip_heldout}")
    held = args.heldout_prompts
    if held is not None and not (0 < held < 1 and not args.skip_heldout and args.heldout_records is None):
        raise RetrospecError("--heldout-prompts takes a share in (0, 1) and no --skip-heldout or --heldout-records")
    held_records = args.heldout_records
    if held_records is not None and not (0 < held_records < 1 and not args.skip_heldout):
        raise RetrospecError("--heldout-records takes a share in (0, 1) and no --skip-heldout")
    records = read_corpus(args.path)  # a corrupt corpus fails before the target loads
    if args.source is not None:
        wanted = {s.strip() for s in args.source.split(",") if s.strip()}
        present = {r.get("source") for r in records}
        if not wanted or not wanted <= present:
            raise RetrospecError(f"--source {args.source!r}: this corpus's sources are "
                                 f"{', '.join(sorted(str(p) for p in present if p is not None))}")
        records = [r for r in records if r.get("source") in wanted]
    if args.temperature is not None:
        present = sorted({float(r["temperature"]) for r in records if r.get("temperature") is not None})
        if args.temperature not in present:
            raise RetrospecError(f"--temperature {args.temperature:g}: this corpus's records were sampled at "
                                 f"{', '.join(f'{t:g}' for t in present) or 'no recorded temperature'}")
        records = [r for r in records if r.get("temperature") == args.temperature]
    if held is not None:  # prompts only: no tokenizer needed
        rows = {}
        for r in records:
            if is_heldout(r, held):
                rows.setdefault(r.get("prompt", ""), {"prompt": r.get("prompt", ""), "source": r.get("source"),
                                                      "chat": bool(r.get("chat"))})
        if not rows:
            raise RetrospecError(f"no prompt of {args.path} is held out at share {held}")
        kinds = {chat: sorted({str(r["source"]) for r in rows.values() if r["chat"] == chat}) for chat in (True, False)}
        if all(kinds.values()):  # 'bench --chat' applies to every prompt of a file: one kind a file
            raise RetrospecError(f"the held-out prompts mix chat ({', '.join(kinds[True])}) and raw completion "
                                 f"({', '.join(kinds[False])}); choose one kind with --source")
        write_text_atomic(out, "".join(json.dumps(row) + "\n" for row in rows.values()))
        print(f"{out}: {len(rows):,} held-out prompts")
        return 0
    target = load_model(default_target() if args.target is None else args.target, role="target")
    tok = target.tokenizer
    if tok is None:
        raise RetrospecError("the target has no tokenizer to decode the corpus with")
    # the ids are decoded with the tokenizer of the model that wrote them
    check_corpus(args.path, records, target, name=args.target or DEFAULT_TARGET)
    if held_records is not None:
        kept = [r for r in records if r.get("output_ids") and is_heldout(r, held_records)]
        if not kept:
            raise RetrospecError(f"no record of {args.path} is held out at share {held_records}")
    else:
        kept = [r for r in records
                if r.get("output_ids") and not (args.skip_heldout and is_heldout(r, args.skip_heldout))]
    lines = [json.dumps(_text_row(tok, r)) for r in kept]
    write_text_atomic(out, "".join(line + "\n" for line in lines))
    print(f"{out}: {len(kept):,} of {len(records):,} records")
    return 0


def _text_row(tok, record: dict) -> dict:
    """A record as text: ``prompt`` + ``completion`` decode its ids together (so the two joined are exactly the
    decoded document); a plain ``text`` row where the prompt alone does not decode to a prefix of it."""
    prompt_ids = list(record["prompt_ids"])
    text, prompt = tok.decode(prompt_ids + list(record["output_ids"])), tok.decode(prompt_ids)
    if text.startswith(prompt):
        return {"prompt": prompt, "completion": text[len(prompt):]}
    return {"text": text}
