"""``retrospec rag bench``: accuracy and latency of Speculative RAG (Wang et al., ICLR 2025), its baselines and
ablations on held-out questions.

Metrics (per method, averaged over questions):
- ``accuracy``: any gold answer contained in the output after normalisation (lower case, punctuation and articles
  removed, whitespace collapsed) — the paper's metric, as in the lost-in-the-middle NQ-open evaluation;
- ``exact_match``: the normalised output equals a normalised gold answer;
- ``draft_oracle`` (drafting methods): some draft contains a gold answer — the ceiling of any selection rule;
- ``latency_s`` and its split ``retrieve_s``, ``cluster_s``, ``draft_s``, ``verify_s`` (``verify_s`` is the
  verifier's time: scoring for the specrag family, answering for ``standard`` / ``closed-book``).

Output directory: ``rows.jsonl`` (appended per question, so a stopped run keeps its rows and ``--resume`` skips
them), ``results.json`` (``config``, ``summary: [{method, accuracy, exact_match, latency_s, retrieve_s, cluster_s,
draft_s, verify_s, questions}]`` and per-question ``rows`` with the answer, drafts and scores), ``report.md`` and
``accuracy_latency.png``. ``merge`` joins runs done in shards (``--shard I/N``) into one report.

Methods sharing a subset strategy share drafts within a question (``RagPipeline.answer_many``); each method's
latency is the sum of the stages it uses, each measured once.
"""

from __future__ import annotations

import json
import re
import string
import time
from collections.abc import Sequence
from pathlib import Path

from ..atomic import write_text_atomic
from ..errors import RetrospecError
from .data import Question
from .pipeline import RagPipeline

ROWS = "rows.jsonl"
TIMING_KEYS = ("latency_s", "retrieve_s", "cluster_s", "draft_s", "verify_s")


def normalize(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def contains_answer(output: str, answers: Sequence[str]) -> bool:
    out = normalize(output)
    return any(normalize(a) and normalize(a) in out for a in answers)


def exact_match(output: str, answers: Sequence[str]) -> bool:
    out = normalize(output)
    return any(out == normalize(a) for a in answers)


def run_bench(pipe: RagPipeline, questions: Sequence[Question], methods: list[str], out: Path, *, config: dict,
              resume: bool = False, progress: bool = True) -> dict:
    """Answer every question with every method, appending rows to ``OUT/rows.jsonl``; then write the reports."""
    from tqdm.auto import tqdm

    out.mkdir(parents=True, exist_ok=True)
    rows_file = out / ROWS
    done: set[str] = set()
    if rows_file.exists():
        if not resume:
            raise RetrospecError(f"{out} already holds a bench ({ROWS}); pass --resume to continue it or choose "
                                 "another --out")
        rows = read_rows(rows_file)
        have: dict[str, set[str]] = {}
        for r in rows:
            have.setdefault(r["id"], set()).add(r["method"])
        done = {qid for qid, ms in have.items() if set(methods) <= ms}
        # a stopped run may leave a partial last line (appending after it would corrupt the next row) and some of
        # a question's rows: keep the complete questions' rows only; the others are answered again
        write_text_atomic(rows_file, "".join(_line(r) for r in rows if r["id"] in done))
    todo = [q for q in questions if q.id not in done]
    with rows_file.open("a") as f:
        for q in tqdm(todo, desc="rag bench", unit="question", disable=not progress, dynamic_ncols=True):
            results = pipe.answer_many(q.question, methods)
            for name in methods:
                r = results[name]
                row = {"id": q.id, "question": q.question, "answers": list(q.answers), "method": name,
                       "output": r.answer, "correct": contains_answer(r.answer, q.answers),
                       "exact": exact_match(r.answer, q.answers), "timings": r.timings, "chosen": r.chosen,
                       "drafts": r.to_dict()["drafts"], "retrieved": r.retrieved,
                       "gold_retrieved": any(pid == q.gold_passage for pid, _ in r.retrieved)}
                f.write(_line(row))
            f.flush()
    return write_reports(read_rows(rows_file), out, config)


def _line(row: dict) -> str:
    return json.dumps(row, ensure_ascii=False) + "\n"


def read_rows(path: Path) -> list[dict]:
    rows = []
    for line in filter(str.strip, path.read_text().splitlines()):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a run killed mid-write leaves a partial last line
            pass
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    summary = []
    for name in dict.fromkeys(r["method"] for r in rows):
        rs = [r for r in rows if r["method"] == name]
        n = len(rs)
        s = {"method": name, "questions": n,
             "accuracy": round(100 * sum(r["correct"] for r in rs) / n, 2),
             "exact_match": round(100 * sum(r["exact"] for r in rs) / n, 2)}
        for k in TIMING_KEYS:
            s[k] = round(sum(r["timings"].get(k, 0.0) for r in rs) / n, 4)
        if any(r.get("drafts") for r in rs):  # the selection's ceiling: some draft of the question holds a gold answer
            s["draft_oracle"] = round(100 * sum(any(contains_answer(d["answer"], r["answers"]) for d in r["drafts"])
                                                for r in rs) / n, 2)
        summary.append(s)
    return summary


def write_reports(rows: list[dict], out: Path, config: dict) -> dict:
    if not rows:
        raise RetrospecError("no bench rows to report")
    summary = summarize(rows)
    ids = {r["id"] for r in rows}
    gold = [r["gold_retrieved"] for r in rows if r["method"] == "standard" or r["method"].startswith("specrag")]
    config = dict(config) | {"questions": len(ids),
                             "gold_in_retrieved": round(100 * sum(gold) / len(gold), 2) if gold else None}
    result = {"config": config, "summary": summary, "rows": rows}
    write_text_atomic(out / "results.json", json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    (out / "report.md").write_text(render_markdown(result))
    render_plot(summary, out / "accuracy_latency.png")
    return result


def render_markdown(result: dict) -> str:
    c = result["config"]
    lines = ["# retrospec rag bench", "",
             f"- {c['questions']} questions ({c.get('split', '?')} split of `{c.get('questions_file', '?')}`); "
             f"index `{c.get('index', '?')}`",
             f"- drafter `{c.get('drafter')}`, verifier `{c.get('verifier')}`, dtype {c.get('dtype')}, "
             f"{c.get('threads')} torch threads",
             f"- docs {c.get('docs')}, drafts {c.get('drafts')}, per draft {c.get('per_draft')}; "
             f"gold passage among the retrieved: {c.get('gold_in_retrieved')} %",
             "", "| method | accuracy | exact match | draft oracle | latency s | retrieve s | cluster s | draft s | "
             "verify s |", "|---|---|---|---|---|---|---|---|---|"]
    for s in result["summary"]:
        oracle = f"{s['draft_oracle']:.1f}" if "draft_oracle" in s else "—"
        lines.append(f"| {s['method']} | {s['accuracy']:.1f} | {s['exact_match']:.1f} | {oracle} | "
                     f"{s['latency_s']:.2f} | {s['retrieve_s']:.3f} | {s['cluster_s']:.3f} | {s['draft_s']:.2f} | "
                     f"{s['verify_s']:.2f} |")
    lines += ["", "accuracy: a gold answer contained in the output (normalised, %); exact match: output equals a gold "
              "answer (normalised, %); draft oracle: some draft of the question contains a gold answer (the ceiling "
              "of any selection rule over those drafts). Latencies are means per question; methods that share a "
              "subset strategy share its drafts within a question, and each reports the stages it uses. verify s is "
              "the verifier's time (scoring drafts, or answering for standard / closed-book).", ""]
    return "\n".join(lines)


def render_plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for s in summary:
        ax.scatter(s["latency_s"], s["accuracy"], s=28)
        ax.annotate(s["method"], (s["latency_s"], s["accuracy"]), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    ax.set_xlabel("mean latency per question (s)")
    ax.set_ylabel("accuracy (%)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def merge(parts: Sequence[Path], out: Path) -> dict:
    """One report from bench directories run in shards (their ``rows.jsonl``; config from the first)."""
    rows, config, seen = [], None, set()
    for part in parts:
        f = Path(part) / ROWS
        if not f.is_file():
            raise RetrospecError(f"not a rag bench directory (no {ROWS}): {part}")
        if config is None and (Path(part) / "results.json").is_file():
            config = json.loads((Path(part) / "results.json").read_text())["config"]
        for r in read_rows(f):
            key = (r["id"], r["method"])
            if key not in seen:
                seen.add(key)
                rows.append(r)
    out.mkdir(parents=True, exist_ok=True)
    (out / ROWS).write_text("".join(map(_line, rows)))
    config = dict(config or {}) | {"merged_from": [str(p) for p in parts], "merged": time.strftime("%Y-%m-%d %H:%M")}
    return write_reports(rows, out, config)
