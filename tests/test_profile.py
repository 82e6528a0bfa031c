"""``retrospec profile`` from the user's side: one JSON object with ``forward_ms[context][tokens]``, the plot, the
markdown table, and one-line errors for bad knobs (exit 2)."""

from __future__ import annotations

import json

import pytest
import torch

from retrospec.bench.profile import best_gamma, tree_shape

pytestmark = pytest.mark.usefixtures("single_thread")


def test_profile_json_plot_and_table(cli, saved_models, tmp_path):
    plot = tmp_path / "p.png"
    run = cli("profile", "--target", saved_models.target, "--draft", saved_models.draft, "--contexts", "20,40",
              "--tokens", "1,2,3", "--reps", "1", "--json", "--plot", plot, "--out", tmp_path / "out")
    assert run.rc == 0, run.err
    prof = json.loads(run.out)
    assert set(prof["forward_ms"]) == {"20", "40"}
    for ctx in ("20", "40"):
        assert set(prof["forward_ms"][ctx]) == {"1", "2", "3"} and all(v > 0 for v in prof["forward_ms"][ctx].values())
        assert set(prof["plain_forward_ms"][ctx]) == {"1", "2", "3"}
        assert set(prof["tree_ms"][ctx]) == {"tree16", "tree44"}
    assert prof["ratio"]["20"]["1"] == 1.0
    assert prof["floors"]["bandwidth_gbs"] > 0 and prof["floors"]["weights_bytes"] > 0
    assert set(prof["floors"]["linear_ms"]) == {"1", "2", "3"}
    assert prof["draft"]["ms_per_token"] > 0 and "sd" in prof["gamma"]
    d = prof["draft"]
    assert d["ms_first_after_step"] > 0 and d["share_first_after_step"] == pytest.approx(
        d["ms_first_after_step"] / prof["forward_ms"]["20"]["1"])
    assert "right after the target's forward" in (tmp_path / "out" / "profile.md").read_text()
    steps = {int(t): v for t, v in prof["forward_ms"]["20"].items()}
    for a, pick in prof["gamma"]["sd"].items():  # chains priced with the dearer first token
        assert (pick["gamma"], pick["expected_speedup"]) == pytest.approx(
            best_gamma(steps, d["ms_per_token"], float(a), 16, d["ms_first_after_step"]))
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"profile.json", "profile.md", "profile.png"}
    assert "| 20 | retrospec |" in (tmp_path / "out" / "profile.md").read_text()
    formats = prof["floors"]["formats"]  # the same weights' floor in every format, float32 the one that ran
    assert prof["format"] == "float32" and formats["float32"]["weights_bytes"] == prof["floors"]["weights_bytes"]
    assert (formats["float32"]["weights_bytes"] > formats["bfloat16"]["weights_bytes"]
            > formats["int8"]["weights_bytes"] > formats["int4"]["weights_bytes"])
    assert "Floors by format" in (tmp_path / "out" / "profile.md").read_text()


def test_a_weight_only_model_is_profiled_in_its_format(cli, saved_models, tmp_path):
    run = cli("profile", "--target", saved_models.target, "--dtype", "int8", "--contexts", "20", "--tokens", "1,2",
              "--reps", "1", "--json", "--out", tmp_path / "out")
    assert run.rc == 0, run.err
    prof = json.loads(run.out)
    assert prof["format"] == "int8" and prof["engine"]["plan"] == "weight-only:int8" and prof["engine"]["row_exact"]
    assert prof["floors"]["weights_bytes"] == prof["floors"]["formats"]["int8"]["weights_bytes"]
    assert all(v > 0 for v in prof["floors"]["linear_ms"].values())


@pytest.mark.parametrize("flag,value,fragment", [("--tokens", "1,x", "--tokens"), ("--contexts", "0", "--contexts"),
                                                 ("--reps", "0", "--reps"), ("--contexts", "100000", "positions")])
def test_bad_knobs_are_one_line_errors(cli, saved_models, flag, value, fragment):
    run = cli("profile", "--target", saved_models.target, flag, value)
    assert run.rc == 2 and run.err.count("\n") == 1 and fragment in run.err and "Traceback" not in run.err


def test_tree_shapes_and_gamma_choice():
    tree = tree_shape((4, 3))
    assert len(tree) == 16 and tree.parents[:4].tolist() == [-1] * 4 and not tree.is_chain
    flat = {1: 10.0, 2: 10.0, 16: 10.0}  # verification as cheap as a decode step: draft as much as allowed
    assert best_gamma(flat, 0.0, 0.9, 8)[0] == 8
    steep = {1: 10.0, 2: 20.0, 16: 160.0}  # every token costs a full step: plain decoding pays best
    assert best_gamma(steep, 0.0, 0.5, 8) == (0, 1.0)
    # a chain's first drafted token dearer than the others: the same chain pays less, a short one may not pay
    assert best_gamma(flat, 1.0, 0.9, 8, first_ms=3.0)[1] < best_gamma(flat, 1.0, 0.9, 8)[1]
    assert best_gamma(flat, 0.5, 0.5, 8, first_ms=20.0)[0] == 0


def test_a_saved_profile_seeds_the_gate_of_a_new_process(cli, saved_models, tmp_path, monkeypatch):
    import copy

    from retrospec.gating import _bucket, profile_for, saved_verify_costs
    from retrospec.models import load_model

    monkeypatch.setenv("RETROSPEC_HOME", str(tmp_path))
    monkeypatch.setenv("RETROSPEC_FASTPATH", "auto")  # a measured plan: its key names this machine and these shapes
    run = cli("profile", "--target", saved_models.target, "--contexts", "20", "--tokens", "1,3", "--reps", "1",
              "--no-plain", "--no-trees", "--json")
    assert run.rc == 0, run.err
    fresh = copy.deepcopy(load_model(saved_models.target).model)  # another module of the same shapes
    costs = saved_verify_costs(fresh)
    assert sorted((c, n) for c, n, _ in costs) == [(20, 0), (20, 2)]
    gate_profile = profile_for(fresh)  # its curve holds the saved points as measured (read non-decreasing)
    assert dict(gate_profile.verify_s[_bucket(20)]) == pytest.approx({n: s for _, n, s in costs})
    plain, three = (dict((n, s) for _, n, s in costs)[k] for k in (0, 2))
    assert gate_profile.verify_cost(20, 0) == pytest.approx(plain if plain <= three else (plain + three) / 2)


def test_a_longspec_block_is_profiled_as_a_draft(cli, saved_models, tmp_path):
    from retrospec.models import load_model
    from retrospec.models.longspec import LongSpecDraft, save_longspec

    target = load_model(saved_models.target).model
    block = LongSpecDraft.for_target(target, window=8)
    block.set_vocab(list(range(0, 64)))
    save_longspec(block, target, tmp_path / "blk")
    run = cli("profile", "--target", saved_models.target, "--draft", tmp_path / "blk", "--contexts", "20",
              "--tokens", "1,2", "--reps", "1", "--no-plain", "--no-trees", "--json")
    assert run.rc == 0, run.err
    prof = json.loads(run.out)
    assert prof["draft"]["model"] == str(tmp_path / "blk") and prof["draft"]["ms_per_token"] > 0


def test_remeasure_measures_the_drafts_path_again(cli, saved_models, tmp_path, monkeypatch):
    """``--remeasure`` re-times the draft's matmul path (``fastpath.draft``) too, for a draft model and a block."""
    from retrospec.fastpath import draft as fdraft
    from retrospec.models import load_model
    from retrospec.models.longspec import LongSpecDraft, save_longspec

    monkeypatch.setenv("RETROSPEC_HOME", str(tmp_path))
    monkeypatch.setenv("RETROSPEC_FASTPATH", "auto")
    calls = []
    real = fdraft.measure_choice
    monkeypatch.setattr(fdraft, "measure_choice", lambda *a, **k: calls.append(1) or real(*a, **k))
    target = load_model(saved_models.target).model
    block = LongSpecDraft.for_target(target, window=8)
    save_longspec(block, target, tmp_path / "blk")
    base = ["profile", "--target", saved_models.target, "--contexts", "20", "--tokens", "1,2", "--reps", "1",
            "--no-plain", "--no-trees", "--json"]
    for draft in (saved_models.draft, tmp_path / "blk"):
        assert cli(*base, "--draft", draft).rc == 0
        measured = len(calls)  # the first run measured the choice (then cached); a plain rerun reads the cache
        assert measured >= 1 and cli(*base, "--draft", draft).rc == 0 and len(calls) == measured
        run = cli(*base, "--draft", draft, "--remeasure")
        assert run.rc == 0, run.err
        assert len(calls) > measured
        calls.clear()


def test_the_bandwidth_probe_outgrows_the_last_level_cache(tmp_path, monkeypatch):
    from retrospec.bench import profile

    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "307200K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    (tmp_path / "index1").mkdir()  # a cache without a size file is skipped
    assert profile.last_level_cache_bytes(str(tmp_path)) == 300 << 20
    assert profile.last_level_cache_bytes(str(tmp_path / "missing")) == 0
    sizes = []
    monkeypatch.setattr(profile, "last_level_cache_bytes", lambda: 200 << 20)
    monkeypatch.setattr(profile.torch, "ones", lambda n, device=None: sizes.append(n) or torch.zeros(8))
    assert profile.bandwidth_gbs() > 0 and sizes == [400 * (1 << 20) // 4]  # twice a 200 MiB cache, in float32s
