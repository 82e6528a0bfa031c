"""The method registry (``drafters.registry``) and what derives from it: every method's knobs are validated the same
way by the API, the CLI and the server; the one run path (``run.Run``) leaves the caller's model as it was; stop
strings follow OpenAI in the API and the server (``text.TextStream``); text that cannot be encoded is a user error
at every entry point."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

import retrospec
from retrospec.api import prepare
from retrospec.drafters import REGISTRY, SPECS, spec_of
from retrospec.drafters.registry import all_knobs, methods
from retrospec.errors import RetrospecError
from retrospec.models import load_model
from retrospec.serve import BackgroundServer, create_app
from retrospec.serve.protocol import Capabilities, ProtocolError, parse
from retrospec.text import TextStream, check_encodable

SHORT = methods(context=False)
BAD_TEXT = "a\u0000b\udcff"


def foreign_knob(method: str) -> str:
    """A knob some other method declares and ``method`` does not."""
    return next(k for k in all_knobs() if SPECS[method].knob(k) is None)


def sample_value(knob):
    return {"int": 2, "float": 0.5, "bool": True, "str": "x", "path": "store", "widths": "2,2"}[knob.kind]


CAPS = Capabilities("m", SHORT, "ar", stores={"suffix": {"store": object()}, "dense": {"store": object()}})


# --- the registry itself -----------------------------------------------------------------------------------------

def test_every_method_is_one_spec_with_a_checked_factory():
    assert set(REGISTRY) == set(SPECS) and {"ar", "sd", "pld", "magicdec", "rest", "dresd", "longspec", "lc", "rag",
                                            "rapid"} <= set(SPECS)
    for name, spec in SPECS.items():
        assert spec.name == name and spec.context in ("never", "optional", "required")
        assert spec.draft in ("none", "lm", "block") and spec.store in (None, "suffix", "dense")
        if spec.knob("gamma") is not None and spec.draft != "block":
            assert (spec.default_gamma or spec.context_gamma), name  # a draft length when none is given
    with pytest.raises(RetrospecError, match="unknown method"):
        spec_of("nope")
    with pytest.raises(RetrospecError, match="'max_ngarm' does not apply to method 'pld'.*max_ngram"):
        REGISTRY["pld"](max_ngarm=4)  # factories take no stray options
    assert REGISTRY["pld"](gamma=3, max_ngram=2).k == 3
    with pytest.raises(RetrospecError, match="gamma must be >= 1"):
        REGISTRY["pld"](gamma=0)  # values are checked as the API checks them
    with pytest.raises(RetrospecError, match="needs a draft model"):
        REGISTRY["sd"](gamma=2)  # a user error, not a ValueError


def test_knob_types_and_ranges_are_checked():
    spec = SPECS["sd"]
    assert spec.check({}) == {"gamma": 5} and spec.check({}, context=True) == {"gamma": 10}
    assert spec.check({"gamma": 3, "adaptive_gamma": True}) == {"gamma": 3, "adaptive": True}
    for bad, msg in (({"gamma": 0}, "gamma must be >= 1"), ({"gamma": "3"}, "gamma must be an integer"),
                     ({"adaptive_gamma": 1}, "true or false"), ({"tree": "2,2"}, "does not apply")):
        with pytest.raises(RetrospecError, match=msg):
            spec.check(bad)
    assert SPECS["longspec"].check({"tree": "2,3"}) == {"tree": (2, 3)}
    assert SPECS["rest"].check({"datastore": None, "gamma": None}) == {}  # unset knobs of other methods: ignored


# --- the same validation in the API, the CLI and the server ------------------------------------------------------

@pytest.mark.parametrize("method", SHORT)
def test_a_knob_of_another_method_is_refused_everywhere(method, cli):
    knob = foreign_knob(method)
    value = sample_value(all_knobs()[knob])
    with pytest.raises(RetrospecError, match=f"'{knob}' does not apply to method '{method}'"):
        prepare("x", method=method, **{knob: value})  # refused before any model is loaded
    flag = all_knobs()[knob].flag
    args = [flag] if all_knobs()[knob].kind == "bool" else [flag, value]
    cli("generate", "--prompt", "x", "--method", method, *args).assert_user_error(flag, "applies to")
    with pytest.raises(ProtocolError) as exc:
        parse({"prompt": "x", "method": method, knob: value}, "completions", CAPS)
    assert exc.value.status == 400 and exc.value.param == knob and "does not apply to method" in exc.value.message


@pytest.mark.parametrize("method", [m for m in SHORT if SPECS[m].knob("gamma")])
def test_a_bad_value_is_refused_everywhere(method, cli):
    with pytest.raises(RetrospecError, match="gamma must be >= 1"):
        prepare("x", method=method, gamma=0)
    cli("generate", "--prompt", "x", "--method", method, "--gamma", 0).assert_user_error("--gamma must be >= 1")
    with pytest.raises(ProtocolError) as exc:
        parse({"prompt": "x", "method": method, "gamma": 0}, "completions", CAPS)
    assert exc.value.param == "gamma" and "gamma must be >= 1" in exc.value.message


def test_a_misspelt_knob_is_refused(saved_models):
    with pytest.raises(RetrospecError, match="'max_ngarm' does not apply to method 'pld' \\(its options: gamma, "
                                             "max_ngram\\)"):
        retrospec.generate("def f(x):", target=str(saved_models.target), method="pld", max_ngarm=4)
    res = retrospec.generate("def f(x):", target=str(saved_models.target), method="pld", max_ngram=2,
                             max_new_tokens=6)
    assert len(res.token_ids) == 6


# --- the run path ------------------------------------------------------------------------------------------------

def _snapshot(model):
    return (model.config._attn_implementation, [type(m) for m in model.modules()],
            [(n, p.data_ptr(), p._version) for n, p in model.named_parameters()], dict(model.__dict__).keys())


@pytest.mark.parametrize("method,kw", [("sd", {}), ("magicdec", {"window": 8}), ("pld", {}),
                                       ("sd", {"context": "alpha beta gamma " * 20}),
                                       ("lc", {"context": "alpha beta gamma " * 20, "prefix_attention": False})])
def test_the_callers_model_is_left_as_it_was(saved_models, method, kw):
    target = load_model(str(saved_models.target))
    draft = load_model(str(saved_models.draft)) if method == "sd" else None
    before = _snapshot(target.model)
    res = retrospec.generate("def f(x):", target=target, draft=draft, method=method, max_new_tokens=6, **kw)
    assert len(res.token_ids) == 6
    assert _snapshot(target.model) == before


def test_a_model_in_train_mode_runs_in_eval_mode_and_is_given_back_in_train_mode(saved_models):
    from transformers import AutoModelForCausalLM

    target, draft = (AutoModelForCausalLM.from_pretrained(str(p)) for p in (saved_models.target, saved_models.draft))
    tok = load_model(str(saved_models.target)).tokenizer
    want = retrospec.generate("def f(x):", target=str(saved_models.target), method="ar", max_new_tokens=8).token_ids
    modes = []
    hook = target.register_forward_pre_hook(lambda m, a: modes.append(m.training))  # seen if the engine is off
    target.train(), draft.train()
    res = retrospec.generate("def f(x):", target=load_model(target, tokenizer=tok), draft=draft, method="sd",
                             max_new_tokens=8)
    hook.remove()
    assert res.token_ids == want
    assert target.training and draft.training  # given back as it came
    assert not any(modes)


def test_the_run_restores_the_attention_implementation(saved_models):
    from retrospec.run import Run

    req = prepare("def f(x):", target=str(saved_models.target), method="ar", max_new_tokens=4)
    model = req.target.model
    before = model.config._attn_implementation
    run = Run(req)
    steps = iter(run)
    next(steps)
    model.config._attn_implementation = "eager"  # a component that changes the model mid-run ...
    steps.close()
    assert model.config._attn_implementation == before  # ... does not leave it changed


# --- stop strings ------------------------------------------------------------------------------------------------

def test_text_stream_is_incremental_and_equals_one_decode(saved_models):
    tok = load_model(str(saved_models.target)).tokenizer
    ids = tok("def wrap(text, width=70):\n    return [line for line in text] # é ü 😀", add_special_tokens=False)[
        "input_ids"]
    s = TextStream(tok)
    pieces = [s.push([t]) for t in ids] + [s.finish()]
    assert "".join(pieces) == s.sent == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)  # partial characters are held back, never sent
    stop = TextStream(tok, stops=["line for"])
    out = "".join(stop.push([t]) for t in ids) + stop.finish()
    assert stop.stopped and out == "def wrap(text, width=70):\n    return [" and out == stop.sent


def test_api_and_server_cut_before_the_stop_string(saved_models):
    target = str(saved_models.target)
    full = retrospec.generate("def f(x):", target=target, method="ar", max_new_tokens=24).text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    want = full[: full.index(stop)]
    res = retrospec.generate("def f(x):", target=target, method="ar", max_new_tokens=24, stop=[stop])
    streamed = "".join(retrospec.stream("def f(x):", target=target, method="ar", max_new_tokens=24, stop=[stop]))
    assert res.text == streamed == want
    assert len(res.token_ids) < 24  # generation ended at the stop string
    with BackgroundServer(create_app(target, method="ar")) as srv:
        (info,) = json.load(urllib.request.urlopen(f"{srv.url}/v1/models", timeout=60))["data"]
        served = info["retrospec"]
        assert served["knobs"]["pld"] == ["gamma", "max_ngram", "gating"]  # from the registry
        assert "rapid" in served["unavailable"] and "sd" in served["unavailable"]  # a long context / no draft
        body = json.dumps({"prompt": "def f(x):", "max_tokens": 24, "stop": stop}).encode()
        req = urllib.request.Request(f"{srv.url}/v1/completions", body, {"Content-Type": "application/json"})
        choice = json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]
        assert choice["text"] == want and choice["finish_reason"] == "stop"

        # text that cannot be encoded: a clear 400, not a 500
        bad = json.dumps({"prompt": BAD_TEXT, "max_tokens": 2}).encode()
        req = urllib.request.Request(f"{srv.url}/v1/completions", bad, {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(req, timeout=60)
        assert exc.value.code == 400
        err = json.load(exc.value)["error"]
        assert err["param"] == "prompt" and "cannot be encoded" in err["message"]
        # ... nor in a field's name, which the 400 quotes back (rendered with non-ASCII escaped)
        bad = json.dumps({"prompt": "x", BAD_TEXT: 1}).encode()
        req = urllib.request.Request(f"{srv.url}/v1/completions", bad, {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(req, timeout=60)
        assert exc.value.code == 400
        err = json.load(exc.value)["error"]
        assert err["param"] == BAD_TEXT and "unknown field" in err["message"]


# --- text that cannot be encoded ---------------------------------------------------------------------------------

def test_unencodable_text_is_a_user_error(saved_models, cli):
    assert check_encodable("a\u0000b") == "a\u0000b"
    with pytest.raises(RetrospecError, match="cannot be encoded"):
        retrospec.generate(BAD_TEXT, target=str(saved_models.target), method="ar", max_new_tokens=2)
    with pytest.raises(RetrospecError, match="cannot be encoded"):
        retrospec.generate("q", context=BAD_TEXT * 50, target=str(saved_models.target), method="lc",
                           max_new_tokens=2)
    cli("generate", "--prompt", BAD_TEXT, "--target", saved_models.target, "--method", "ar").assert_user_error(
        "cannot be encoded")


def test_cli_names_itself_once(cli):
    line = cli("nope").assert_user_error("invalid choice")
    assert line.count("retrospec") == 1


def test_the_architecture_doc_method_table_follows_the_registry():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0] in SPECS:
            rows[cells[0]] = cells
    assert list(rows) == list(SPECS)  # every method, in registry order
    for name, spec in SPECS.items():
        _, _, _, knobs, gamma, lossless = rows[name]
        assert knobs == (", ".join(spec.knob_names) or "-"), name
        want_gamma = "/".join(dict.fromkeys(str(g) for g in (spec.default_gamma, spec.context_gamma) if g))
        assert gamma == (want_gamma or "-"), name
        assert (lossless == "yes") == (spec.lossless and not spec.lossy_when), name
