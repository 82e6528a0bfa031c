"""``retrospec datastore build|info|eval`` and the rest / dresd options of ``generate`` and ``bench``, from the
user's side: success paths on a tiny corpus, and one-line errors (exit 2) for everything a user can get wrong."""

from __future__ import annotations

import json
import shutil

import pytest

pytestmark = pytest.mark.usefixtures("single_thread")

CODE = '''def add(a, b):
    """Return the sum of a and b."""
    return a + b


def mul(a, b):
    """Return the product of a and b."""
    return a * b


class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def norm(self):
        return (self.x ** 2 + self.y ** 2) ** 0.5
'''
PROMPT = "def add(a, b):\n    "


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds_cli")
    (root / "corpus.txt").write_text(CODE * 3)
    (root / "corpus.jsonl").write_text("\n".join(json.dumps({"prompt": CODE[:60], "completion": CODE[60:]})
                                                 for _ in range(2)) + "\n")
    (root / "dir").mkdir()
    (root / "dir" / "a.py").write_text(CODE)
    (root / "dir" / "b.jsonl").write_text(json.dumps({"text": CODE}) + "\n")
    (root / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": p}) for p in ("def add(", "class P")) + "\n")
    return root


@pytest.fixture(scope="module")
def stores(saved_models, files, tmp_path_factory):
    """A suffix and a dense store built through the CLI (in-process)."""
    from retrospec.cli import main

    root = tmp_path_factory.mktemp("stores")
    assert main(["datastore", "build", "--kind", "suffix", "--out", str(root / "suffix"), "--target",
                 str(saved_models.target), "--corpus", str(files / "dir")]) == 0
    assert main(["datastore", "build", "--kind", "dense", "--out", str(root / "dense"), "--target",
                 str(saved_models.target), "--corpus", str(files / "corpus.jsonl"), "--from-generations",
                 str(files / "prompts.jsonl"), "--gen-max-new-tokens", "8", "--pca-dims", "8"]) == 0
    return root


def test_build_info_eval_suffix(cli, saved_models, files, stores, tmp_path):
    res = cli("datastore", "build", "--kind", "suffix", "--out", tmp_path / "s", "--target", saved_models.target,
              "--corpus", files / "corpus.txt")
    assert res.rc == 0, res.err
    assert "suffix datastore" in res.out and "tokens" in res.out
    info = cli("datastore", "info", tmp_path / "s", "--json")
    meta = json.loads(info.out)
    assert meta["kind"] == "suffix" and meta["tokenizer"]["vocab_size"] == saved_models.vocab_size
    assert meta["counts"]["documents"] == 1 and meta["corpus"]["distribution"] == "OOD (raw text)"
    ev = cli("datastore", "eval", stores / "suffix", "--corpus", files / "corpus.txt", "--json")
    assert ev.rc == 0, ev.err
    out = json.loads(ev.out.strip().splitlines()[-1])
    assert out["hit_rate"] > 0.9 and out["mean_match_length"] >= 2 and out["tree_prefix"] > 1
    assert out["scored"] == "every position"
    ev = cli("datastore", "eval", stores / "suffix", "--corpus", files / "corpus.jsonl", "--json")
    assert ev.rc == 0 and json.loads(ev.out.strip().splitlines()[-1])["scored"] == "completions", ev.err


def test_info_and_eval_dense(cli, files, stores):
    info = cli("datastore", "info", stores / "dense")
    assert info.rc == 0 and "dense datastore" in info.out and "index flat" in info.out
    meta = json.loads(cli("datastore", "info", stores / "dense", "--json").out)
    assert meta["corpus"]["distribution"] == "mixed" and meta["params"]["key_dim"] == 8
    ev = cli("datastore", "eval", stores / "dense", "--corpus", files / "corpus.txt", "--json", "--max-queries", 50)
    assert ev.rc == 0, ev.err
    out = json.loads(ev.out.strip().splitlines()[-1])
    assert out["queries"] == 50 and 0 < out["mrr_next_token"] <= 1 and "lookup_p99_ms" in out
    ev = cli("datastore", "eval", stores / "dense", "--corpus", files / "corpus.jsonl", "--json", "--max-queries", 20)
    assert ev.rc == 0 and json.loads(ev.out.strip().splitlines()[-1])["scored"] == "completions", ev.err


def test_eval_walks_the_targets_own_replies_as_a_decode(cli, saved_models, files, stores, tmp_path):
    """``--from-generations``: stores of nothing but these very replies draft each whole reply below its last
    prompt token, so a walk takes one target call per reply; a store of other text drafts less."""
    gen = stores / "dense" / "generations.jsonl"  # the replies to prompts.jsonl, reused (no decoding here)
    rows = [json.loads(line) for line in gen.read_text().splitlines()]
    walked = [r for r in rows if r["completion_ids"]]

    def walk(store):
        ev = cli("datastore", "eval", store, "--from-generations", gen, "--gen-max-new-tokens", 8,
                 "--max-queries", 10, "--json")
        assert ev.rc == 0, ev.err
        return json.loads(ev.out.strip().splitlines()[-1])

    for kind in ("suffix", "dense"):
        res = cli("datastore", "build", "--kind", kind, "--out", tmp_path / kind, "--target", saved_models.target,
                  "--from-generations", gen, "--gen-max-new-tokens", 8, *(["--pca-dims", 8] * (kind == "dense")))
        assert res.rc == 0, res.err
        out = walk(tmp_path / kind)
        assert out["walked_documents"] == len(walked) > 0 and out["decode_steps"] == len(walked), kind
        assert out["decode_tau"] == pytest.approx(sum(len(r["completion_ids"]) for r in walked) / len(walked))
        assert out["ceiling_tau"] == pytest.approx(out["decode_tau"])  # the tree already holds the best path
    other = walk(stores / "suffix")
    assert 1 <= other["decode_tau"] < out["decode_tau"] and other["ceiling_steps"] > 0


@pytest.mark.parametrize("kind,shape", [("suffix", None), ("dense", None), ("suffix", (2, 3)), ("dense", (1, 2))])
def test_the_walk_of_replies_is_the_decode_of_their_prompts(cli, saved_models, stores, kind, shape):
    """Decoding each prompt ungated with the store's drafter takes the walk's target calls for the walk's tokens
    (at the drafters' greedy defaults, and at a shape given as --num-drafts / --draft-len and as knobs)."""
    import retrospec
    from retrospec.models import load_model

    gen = stores / "dense" / "generations.jsonl"
    knobs = {} if shape is None else {"num_drafts": shape[0], "draft_len": shape[1]}
    flags = [] if shape is None else ["--num-drafts", shape[0], "--draft-len", shape[1]]
    ev = cli("datastore", "eval", stores / kind, "--from-generations", gen, "--gen-max-new-tokens", 8,
             "--max-queries", 10, "--json", *flags)
    assert ev.rc == 0, ev.err
    out = json.loads(ev.out.strip().splitlines()[-1])
    assert (out["num_drafts"], out["draft_len"]) == (shape or (3, 20))
    if shape is not None:  # a step gains at most a draft and the target's own token
        assert 1 <= out["decode_tau"] <= shape[1] + 1 and out["tree_prefix"] <= shape[1]
    target = load_model(saved_models.target, role="target")
    calls = tokens = 0
    for row in map(json.loads, gen.read_text().splitlines()):
        res = retrospec.generate(row["prompt_ids"], target=target, method="rest" if kind == "suffix" else "dresd",
                                 datastore=stores / kind, gating=False, max_new_tokens=8, **knobs)
        assert res.token_ids == row["completion_ids"] + [row["stop"]] * (row["stop"] is not None)
        calls, tokens = calls + res.stats.target_calls, tokens + res.stats.new_tokens
    assert out["decode_steps"] == calls and out["decode_tau"] == pytest.approx(tokens / calls)


def test_a_decode_walk_counts_what_greedy_verification_accepts():
    from retrospec.bench.datastore_eval import _walk, _walk_summary
    from retrospec.tree import merge_sequences
    from retrospec.types import DraftTree

    ids = list(range(100, 130))  # 30 tokens; the walk starts with ids[5] committed
    assert _walk(ids, 5, lambda pos, budget: DraftTree.empty()) == (24, 24)  # no draft: one token a step
    everything = lambda pos, budget: merge_sequences([ids[pos + 1 :]], max_nodes=budget)  # noqa: E731
    assert _walk(ids, 5, everything) == (1, 24)  # all at once
    assert _walk(ids, 5, everything, max_new=10) == (1, 10)  # room for 9 drafted + the target's own, then done
    # a draft right for 3 tokens, then wrong: 4 tokens a step (the target's own after the third), 24 = 6 x 4
    three = lambda pos, budget: merge_sequences([ids[pos + 1 : pos + 4] + [0]], max_nodes=budget)  # noqa: E731
    assert _walk(ids, 5, three) == (6, 24)
    assert _walk(ids, 5, three, max_new=10) == (3, 10)  # 3 + 1, 3 + 1, then room for 1 drafted: 1 + 1
    assert _walk_summary([0, 1], [(6, 24), (2, 3)]) == {"walked_documents": 2, "decode_steps": 8, "decode_tau": 27 / 8}


def test_the_ceiling_drafts_the_retrieved_row_that_matches_longest():
    import numpy as np

    from retrospec.bench.datastore_eval import _best_chain

    rows = np.array([[5, 6, 9, -1], [5, 6, 7, 8], [4, 6, 7, 8], [5, 6, 7, -1]])  # [M, L], -1 after an end
    assert _best_chain(rows, [5, 6, 7, 8, 1]).tokens.tolist() == [5, 6, 7, 8]
    assert _best_chain(rows, [5, 6, 9]).tokens.tolist() == [5, 6, 9]  # a row's end is no match
    assert _best_chain(rows, [1, 2]).tokens.tolist() == [5, 6, 9]  # none matches: the first row, accepting none
    assert len(_best_chain(np.zeros((0, 4), np.int64), [1])) == 0


def test_id_generations_are_saved_and_reused(cli, saved_models, stores, tmp_path):
    gen = stores / "dense" / "generations.jsonl"
    rows = [json.loads(line) for line in gen.read_text().splitlines()]
    assert len(rows) == 2 and all(r["completion_ids"] and r["prompt_ids"] for r in rows)
    res = cli("datastore", "build", "--kind", "suffix", "--out", tmp_path / "s", "--target", saved_models.target,
              "--from-generations", gen, "--gen-max-new-tokens", 8)
    assert res.rc == 0, res.err
    meta = json.loads(cli("datastore", "info", tmp_path / "s", "--json").out)
    assert "2 reused" in meta["corpus"]["description"] and meta["corpus"]["distribution"].startswith("ID")
    assert meta["counts"]["tokens"] == sum(len(r["prompt_ids"]) + len(r["completion_ids"]) + 1 for r in rows)


def test_a_dense_build_keys_the_completions_of_prompt_completion_rows(cli, saved_models, files, tmp_path):
    """Default: only the keys whose drafts (x_{t+2}, ...) start in a completion; ``--keys all``: every position."""
    import numpy as np
    from transformers import AutoTokenizer

    from retrospec.retrieval.corpus import open_text_corpus, tokenize

    tok = AutoTokenizer.from_pretrained(saved_models.target)
    text = open_text_corpus(str(files / "corpus.jsonl"))
    docs = list(tokenize(text.split(), tok, total=len(text)))
    assert all(d.index_from > 2 for d in docs)
    t = ["--target", saved_models.target, "--corpus", files / "corpus.jsonl", "--pca-dims", 4]
    for keys, first in (("completions", [d.index_from - 2 for d in docs]), ("all", [0] * len(docs))):
        res = cli("datastore", "build", "--kind", "dense", "--out", tmp_path / keys, *t, *(["--keys", keys] *
                                                                                          (keys == "all")))
        assert res.rc == 0 and f"({keys} of prompt + completion rows)" in res.out, res.err
        meta = json.loads(cli("datastore", "info", tmp_path / keys, "--json").out)
        assert meta["corpus"]["keys"] == keys
        assert meta["counts"]["entries"] == sum(len(d.ids) - 1 - f for d, f in zip(docs, first))
        values = np.load(tmp_path / keys / "values.npy")  # row 0: x_{t+1}, x_{t+2}, ... of the first key
        assert values[0, :4].tolist() == docs[0].ids[first[0] + 1 : first[0] + 5].tolist()
    cli("datastore", "build", "--kind", "suffix", "--out", tmp_path / "s", "--target", saved_models.target,
        "--corpus", files / "corpus.jsonl", "--keys", "all").assert_user_error("--keys applies to dense")
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("method", ["rest", "dresd"])
def test_generate_with_datastore_equals_ar(cli, saved_models, stores, method):
    def gen(*extra, m):
        res = cli("generate", "--target", saved_models.target, "--method", m, "--prompt", PROMPT,
                  "--max-new-tokens", 24, "--json", *extra)
        assert res.rc == 0, res.err
        return json.loads(res.out)

    kind = "suffix" if method == "rest" else "dense"
    ar = gen(m="ar")
    got = gen("--datastore", stores / kind, "--num-drafts", 2, "--draft-len", 6, m=method)
    assert got["token_ids"] == ar["token_ids"] and got["stats"]["method"] == method


def test_bench_rest_and_dresd(cli, saved_models, files, stores, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    res = cli("bench", "--target", saved_models.target, "--draft", saved_models.draft, "--methods", "ar,rest,dresd",
              "--prompts", prompts, "--max-new-tokens", 12, "--no-warmup", "--out", tmp_path / "b",
              "--datastore", stores / "suffix", "--datastore", stores / "dense")
    assert res.rc == 0, res.err
    result = json.loads((tmp_path / "b" / "results.json").read_text())
    rows = {r["method"]: r for r in result["summary"]}
    assert rows["rest"]["lossless"] and rows["dresd"]["lossless"]
    assert result["config"]["method_options"]["dresd"]["datastore"] == str(stores / "dense")


# ---- errors: one line, exit 2 ---------------------------------------------------------------------------------------


def test_build_errors(cli, saved_models, files, stores, tmp_path):
    t = ["--target", saved_models.target]
    cli("datastore", "build", "--kind", "suffix", "--out", tmp_path / "x", *t).assert_user_error("--corpus")
    cli("datastore", "build", "--kind", "suffix", "--out", tmp_path / "x", *t,
        "--corpus", tmp_path / "nope.txt").assert_user_error("corpus not found")
    cli("datastore", "build", "--kind", "suffix", "--out", tmp_path / "x", *t, "--corpus", files / "corpus.txt",
        "--chat").assert_user_error("--chat applies to --from-generations")
    cli("datastore", "build", "--kind", "suffix", "--out", stores / "suffix", *t,
        "--corpus", files / "corpus.txt").assert_user_error("already exists", "--overwrite")
    cli("datastore", "build", "--kind", "vector", "--out", tmp_path / "x", *t,
        "--corpus", files / "corpus.txt").assert_user_error("--kind")
    cli("datastore", "build", "--kind", "dense", "--out", tmp_path / "x", *t, "--corpus", files / "corpus.txt",
        "--value-len", 0).assert_user_error("--value-len")
    cli("datastore", "build", "--kind", "dense", "--out", tmp_path / "x", "--target", tmp_path / "no_model",
        "--corpus", files / "corpus.txt").assert_user_error("not found")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"title": "no text"}\n')
    cli("datastore", "build", "--kind", "suffix", "--out", tmp_path / "x", *t,
        "--corpus", bad).assert_user_error("'text'")
    cli("datastore", "build", "--kind", "suffix", "--out", tmp_path / "x", *t,
        "--from-generations", files / "corpus.txt").assert_user_error("not valid JSON")
    assert not (tmp_path / "x").exists()


def test_info_and_eval_errors(cli, saved_models, files, stores, tmp_path):
    cli("datastore", "info", tmp_path / "missing").assert_user_error("not found")
    (tmp_path / "empty").mkdir()
    cli("datastore", "info", tmp_path / "empty").assert_user_error("no meta.json")
    broken = tmp_path / "broken"
    shutil.copytree(stores / "suffix", broken)
    (broken / "sa.npy").write_bytes(b"xx")
    cli("datastore", "eval", broken, "--corpus", files / "corpus.txt").assert_user_error("corrupt", "sa.npy")
    cli("datastore", "eval", stores / "dense", "--corpus", files / "corpus.txt",
        "--target", saved_models.draft).assert_user_error("another target")
    cli("datastore", "eval", stores / "dense", "--corpus", files / "corpus.txt",
        "--target", saved_models.draft_other_tokens).assert_user_error("another tokenizer")
    cli("datastore", "eval", stores / "suffix", "--corpus", tmp_path / "nope").assert_user_error("corpus not found")
    cli("datastore", "eval", stores / "suffix").assert_user_error("one held-out source")
    cli("datastore", "eval", stores / "suffix", "--corpus", files / "corpus.txt", "--from-generations",
        files / "prompts.jsonl").assert_user_error("one held-out source")
    cli("datastore", "eval", stores / "suffix", "--corpus", files / "corpus.txt",
        "--walk-docs", 0).assert_user_error("--walk-docs must be >= 1")
    for flag in ("--num-drafts", "--draft-len"):
        cli("datastore", "eval", stores / "dense", "--corpus", files / "corpus.txt",
            flag, 0).assert_user_error(f"{flag} must be >= 1")
        cli("datastore", "eval", stores / "suffix", "--corpus", files / "corpus.txt",
            flag, 65).assert_user_error(f"{flag} must be <= 64")
    cli("datastore", "eval", stores / "suffix", "--corpus", files / "corpus.txt",
        "--chat").assert_user_error("--chat applies to --from-generations")


def test_generate_and_bench_errors(cli, saved_models, stores, tmp_path):
    base = ["generate", "--target", saved_models.target, "--prompt", PROMPT, "--max-new-tokens", 4]
    cli(*base, "--method", "rest").assert_user_error("--datastore")
    cli(*base, "--method", "dresd", "--datastore", stores / "suffix").assert_user_error("needs a dense store")
    cli(*base, "--method", "rest", "--datastore", stores / "dense").assert_user_error("needs a suffix store")
    cli(*base, "--method", "rest", "--datastore", stores / "suffix", "--num-drafts", 0).assert_user_error(
        "--num-drafts")
    cli(*base, "--method", "dresd", "--datastore", tmp_path / "nothing").assert_user_error("not found")
    cli("generate", "--target", saved_models.draft_other_tokens, "--prompt", PROMPT, "--method", "rest",
        "--datastore", stores / "suffix").assert_user_error("another tokenizer")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    bench = ["bench", "--target", saved_models.target, "--prompts", prompts, "--out", tmp_path / "b"]
    cli(*bench, "--methods", "ar,dresd").assert_user_error("dense datastore")
    cli(*bench, "--methods", "ar,rest", "--datastore", stores / "suffix", "--datastore",
        stores / "suffix").assert_user_error("two suffix datastores")
    cli(*bench, "--methods", "ar,dresd", "--datastore", stores / "dense", "--target",
        saved_models.draft).assert_user_error("another target")


def test_chat_generations_are_replies_under_the_template(chat_models, tmp_path):
    """``chat``: the prompt is one user message under the chat template, and the reply ends at end-of-turn."""
    from conftest import CHAT_STOP_MESSAGES

    from retrospec.corpus.documents import generation_documents, save_generations
    from retrospec.models import load_model

    target = load_model(chat_models.target, role="target")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": CHAT_STOP_MESSAGES[0]["content"]}) + "\n")
    docs, rows, desc = generation_documents(prompts, target, max_new_tokens=24, chat=True, progress=False)
    templated = target.tokenizer.apply_chat_template(CHAT_STOP_MESSAGES, add_generation_prompt=True)["input_ids"]
    assert rows[0]["prompt_ids"] == list(templated) and docs[0].index_from == len(templated)
    assert len(rows[0]["completion_ids"]) == chat_models.stop_step and "chat prompts" in desc
    saved = tmp_path / "generations.jsonl"
    save_generations(rows, saved)
    _, again, desc = generation_documents(saved, target, max_new_tokens=24, chat=True, progress=False)
    assert again == rows and "1 reused" in desc
    _, plain, desc = generation_documents(saved, target, max_new_tokens=24, progress=False)  # not chat: decoded anew
    assert plain[0]["prompt_ids"] != rows[0]["prompt_ids"] and "reused" not in desc
