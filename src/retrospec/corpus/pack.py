"""A corpus directory packed into three files, small enough to keep in a repository, and unpacked bit for bit.

A corpus (``corpus.build``) is a folder of JSONL shards with a manifest; token ids written as JSON decimals take ~6
bytes each. ``pack`` writes the same content as:

- ``manifest.json``: the corpus manifest, unchanged, plus ``packed`` (format version, record and token counts, and
  the SHA-256 of every shard file as it was, so ``unpack`` proves the round trip);
- ``records.jsonl.xz``: one JSON object per record, in shard order: its shard, every field but the token ids, and
  the two id counts;
- ``ids.u16.xz``: every record's ``prompt_ids`` then ``output_ids``, concatenated, little-endian uint16 (refused for
  a vocabulary of more than 65,536 ids: ``ids.u32.xz`` then, 4 bytes each).

Invariant: ``unpack(pack(d))`` writes shard files byte-identical to ``d``'s (checked against the recorded SHA-256;
a mismatch is one ``RetrospecError`` line and nothing is left half-written), so a training run resumed from an
unpacked corpus reads exactly the records it read before.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import shutil
import tempfile
from pathlib import Path

import numpy as np

from ..atomic import write_text_atomic
from ..errors import RetrospecError
from ..models.files import read_json
from .build import MANIFEST

FORMAT = 1
RECORDS = "records.jsonl.xz"
_FIELDS = ("source", "chat", "temperature", "prompt", "prompt_ids", "output_ids", "finished")  # a shard line's order


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def pack(corpus: str | Path, dest: str | Path, preset: int = 6) -> dict:
    """Pack the corpus directory ``corpus`` into ``dest`` (created; must not hold a pack already). Returns the
    ``packed`` summary. ``preset``: the xz level (0 fast .. 9 small)."""
    src, dest = Path(corpus), Path(dest)
    manifest = read_json(src / MANIFEST, f"corrupt corpus {src}") if (src / MANIFEST).is_file() else None
    if manifest is None:
        raise RetrospecError(f"{src} is not a corpus directory (no {MANIFEST})")
    if (dest / MANIFEST).exists():
        raise RetrospecError(f"{dest} already holds a packed corpus; pack into an empty folder")
    shards = sorted(src.glob("shard-*.jsonl"))
    metas, ids, top = [], [], 0
    for f in shards:
        for line in f.read_text(encoding="utf-8").splitlines():
            r = json.loads(line)
            if list(r) != list(_FIELDS):
                raise RetrospecError(f"{f.name}: a record with fields {list(r)}, expected {list(_FIELDS)}")
            metas.append({"shard": f.name} | {k: r[k] for k in _FIELDS if not k.endswith("_ids")}
                         | {"n_prompt": len(r["prompt_ids"]), "n_output": len(r["output_ids"])})
            ids += r["prompt_ids"] + r["output_ids"]
            top = max([top, *r["prompt_ids"], *r["output_ids"]])
    dtype = np.dtype("<u2") if top < 2**16 else np.dtype("<u4")
    ids_name = f"ids.u{dtype.itemsize * 8}.xz"
    summary = {"format": FORMAT, "records": len(metas), "tokens": len(ids), "ids": ids_name,
               "shards": {f.name: _sha(f) for f in shards}}
    work = Path(tempfile.mkdtemp(prefix=".pack-", dir=dest.parent if dest.parent.is_dir() else None))
    try:
        with lzma.open(work / RECORDS, "wt", encoding="utf-8", preset=preset) as out:
            out.writelines(json.dumps(m) + "\n" for m in metas)
        with lzma.open(work / ids_name, "wb", preset=preset) as out:
            out.write(np.asarray(ids, dtype=dtype).tobytes())
        write_text_atomic(work / MANIFEST, json.dumps(manifest | {"packed": summary}, indent=1) + "\n")
        dest.mkdir(parents=True, exist_ok=True)
        for name in (RECORDS, ids_name, MANIFEST):  # the manifest last: a folder with one is a whole pack
            shutil.move(str(work / name), dest / name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return summary


def unpack(packed: str | Path, corpus: str | Path) -> dict:
    """Write the corpus directory ``corpus`` (absent or empty) from the pack ``packed``; returns its manifest. The
    shard files are checked byte for byte against the SHA-256 the pack recorded."""
    src, dest = Path(packed), Path(corpus)
    manifest = read_json(src / MANIFEST, f"corrupt packed corpus {src}") if (src / MANIFEST).is_file() else None
    info = (manifest or {}).get("packed")
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise RetrospecError(f"{src} is not a packed corpus of format {FORMAT} (no 'packed' in its {MANIFEST})")
    if dest.exists() and any(dest.iterdir()):
        raise RetrospecError(f"{dest} is not empty; unpack into a new folder")
    try:
        with lzma.open(src / RECORDS, "rt", encoding="utf-8") as f:
            metas = [json.loads(line) for line in f]
        with lzma.open(src / info["ids"], "rb") as f:
            ids = np.frombuffer(f.read(), dtype="<u2" if info["ids"].startswith("ids.u16") else "<u4").tolist()
    except (OSError, EOFError, lzma.LZMAError, json.JSONDecodeError, KeyError) as e:
        raise RetrospecError(f"corrupt packed corpus {src}: {e}") from None
    if len(metas) != info["records"] or len(ids) != info["tokens"]:
        raise RetrospecError(f"corrupt packed corpus {src}: {len(metas)} records and {len(ids)} ids, the manifest "
                             f"says {info['records']} and {info['tokens']}")
    lines: dict[str, list[str]] = {name: [] for name in info["shards"]}
    at = 0
    for m in metas:
        p, o = m["n_prompt"], m["n_output"]
        r = {k: m[k] for k in _FIELDS[:4]} | {"prompt_ids": ids[at:at + p], "output_ids": ids[at + p:at + p + o],
                                              "finished": m["finished"]}
        at += p + o
        lines.setdefault(m["shard"], []).append(json.dumps(r) + "\n")
    work = Path(tempfile.mkdtemp(prefix=".unpack-", dir=dest.parent if dest.parent.is_dir() else None))
    try:
        for name, rows in lines.items():
            (work / name).write_text("".join(rows), encoding="utf-8")
            if _sha(work / name) != info["shards"].get(name):
                raise RetrospecError(f"corrupt packed corpus {src}: {name} does not match its recorded SHA-256")
        plain = {k: v for k, v in manifest.items() if k != "packed"}
        write_text_atomic(work / MANIFEST, json.dumps(plain, indent=1) + "\n")
        dest.mkdir(parents=True, exist_ok=True)
        for name in [*lines, MANIFEST]:
            shutil.move(str(work / name), dest / name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return plain
