"""``retrospec models list|path|import-gguf``: the named models (``list`` never converts anything; ``path`` may,
with progress on stderr), and GGUF files turned into float32 checkpoint directories (``models.gguf``)."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("models", help="list named models, print their directories, import GGUF files")
    msub = p.add_subparsers(dest="models_command", required=True)
    ls = msub.add_parser("list", help="each named model: what it is, where it lives, whether it is ready")
    ls.set_defaults(func=run_list)
    pa = msub.add_parser("path", help="print a named model's directory (converting it first if needed)")
    pa.add_argument("name", help="a model name (see 'retrospec models list')")
    pa.set_defaults(func=run_path)
    im = msub.add_parser("import-gguf", help="convert a GGUF file into a Hugging Face checkpoint directory")
    im.add_argument("file", help="the .gguf file")
    im.add_argument("--out", required=True, help="output directory (must not exist or be empty; written atomically)")
    im.set_defaults(func=run_import)


def run_list(args) -> int:
    import sys

    from rich.console import Console
    from rich.table import Table

    from ..models.named import NAMED

    table = Table(title="retrospec named models")
    table.add_column("name", style="bold", no_wrap=True)
    table.add_column("what")
    table.add_column("where", overflow="fold")
    table.add_column("ready")
    for m in NAMED:
        name = m.name + "".join(f"\n(alias {a})" for a in m.aliases)
        table.add_row(name, m.what, str(m.location()), m.status())
    # a terminal gets a table that fits it; a pipe or file gets whole lines (nothing wrapped, greppable)
    Console(width=None if sys.stdout.isatty() else 400).print(table)
    return 0


def run_path(args) -> int:
    from ..models.named import resolve_name

    print(resolve_name(args.name))
    return 0


def run_import(args) -> int:
    from ..models.gguf import import_gguf

    import_gguf(args.file, args.out)
    return 0
