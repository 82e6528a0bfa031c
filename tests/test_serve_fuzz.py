"""Schema-driven and property-based tests of what clients and callers can send.

- schemathesis generates request bodies from the server's own ``/openapi.json`` (valid ones, and invalid ones that
  break the schema) for every POST route and sends them over HTTP to a running server: no response is a 5xx, every
  4xx is a JSON error. ``RETROSPEC_FUZZ_EXAMPLES`` sets the examples per route and mode (default 60: 240
  requests); the longer run is ``RETROSPEC_FUZZ_EXAMPLES=300 .venv/bin/python -m pytest tests/test_serve_fuzz.py``.
- hypothesis drives the Python API's argument checks (any value: a Request or a RetrospecError, nothing else) and
  the text layer (stop strings cut the streamed text exactly where the whole text would be cut).
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retrospec.api import prepare
from retrospec.config import Limits
from retrospec.errors import RetrospecError
from retrospec.models import load_model
from retrospec.serve import BackgroundServer, create_app
from retrospec.text import TextStream

pytestmark = pytest.mark.usefixtures("single_thread")
EXAMPLES = int(os.environ.get("RETROSPEC_FUZZ_EXAMPLES", "60"))
KEY = "fuzz-key"
QUICK = dict(deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzz_server(chat_models, single_thread):
    app = create_app(str(chat_models.target), str(chat_models.draft), api_key=KEY,
                     limits=Limits(max_tokens=4, max_body_bytes=256 << 10))
    with BackgroundServer(app) as srv:
        yield srv


def test_generated_requests_reach_every_post_route_and_none_is_a_server_error(fuzz_server):
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json",
                                           headers={"Authorization": f"Bearer {KEY}"})
    ops = [r.ok() for r in schema.get_all_operations()]
    posts = [op for op in ops if op.method.upper() == "POST"]
    assert {op.path for op in posts} == {"/v1/completions", "/v1/chat/completions"}
    sent: Counter = Counter()
    failures: list[str] = []
    accepted: list = []  # bodies outside the schema that were served anyway
    for op in posts:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, **QUICK)
            def send(case):
                resp = case.call(base_url=fuzz_server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
                sent[op.path, mode.value, resp.status_code // 100] += 1
                problem = None
                if resp.status_code >= 500:
                    problem = "a server error"
                elif resp.status_code >= 400:
                    try:
                        err = resp.json()["error"]
                        assert isinstance(err["message"], str) and err["message"]
                    except Exception:
                        problem = "a 4xx that is not a JSON error"
                if mode is GenerationMode.NEGATIVE and resp.status_code < 300:
                    accepted.append(case.body)
                if problem:
                    failures.append(f"{op.path} {mode.value}: {problem}: {resp.status_code} {resp.text[:200]} "
                                    f"for {case.body!r}"[:600])

            send()
    total = sum(sent.values())
    print(f"schemathesis: {total} requests: {dict(sent)}; outside the schema but served: {accepted[:5]}")
    assert not failures, failures[:5]
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert sent[path, "positive", 2] > 0, sent  # valid bodies were served, not only refused
        assert sum(n for (p, m, _), n in sent.items() if p == path and m == "negative") > 0, sent
    assert total >= 4 * EXAMPLES * 0.8, sent  # hypothesis may stop early when a small space is exhausted


# --- the Python API: any argument value is a Request or one RetrospecError ----------------------------------------

ANY = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                st.text(max_size=8), st.binary(max_size=4), st.lists(st.integers(-5, 300), max_size=3),
                st.lists(st.text(max_size=3), max_size=3), st.dictionaries(st.text(max_size=2), st.integers(),
                                                                            max_size=2))


@pytest.fixture(scope="module")
def zoo_target():
    return load_model("zoo")


@pytest.mark.parametrize("name", ["prompt", "temperature", "top_p", "top_k", "seed", "max_new_tokens", "stop",
                                  "gating", "chat", "gamma", "method"])
def test_api_arguments_are_a_request_or_one_retrospec_error(zoo_target, name):
    @given(value=ANY)
    @settings(max_examples=40, **QUICK)
    def check(value):
        args = {"prompt": "def f(x):", "target": zoo_target, "method": "pld", "max_new_tokens": 2} | {name: value}
        try:
            req = prepare(args.pop("prompt"), **args)
        except RetrospecError as exc:
            assert "\n" not in str(exc) and str(exc)
        else:
            assert req.prompt_ids and all(0 <= t < zoo_target.vocab_size for t in req.prompt_ids)

    check()


# --- the text layer: streamed deltas with stop strings equal the whole text cut at the first stop ---------------

def test_stop_strings_cut_the_stream_where_they_cut_the_whole_text(zoo_target):
    tok = zoo_target.tokenizer
    vocab = zoo_target.vocab_size

    @given(ids=st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40),
           cuts=st.lists(st.integers(1, 6), min_size=1, max_size=6),
           stops=st.lists(st.text(alphabet="ab \n()e:=_", min_size=1, max_size=3), max_size=3))
    @settings(max_examples=150, **QUICK)
    def check(ids, cuts, stops):
        stream, out, i = TextStream(tok, stops), "", 0
        for c in cuts * 10:
            if i >= len(ids):
                break
            out += stream.push(ids[i:i + c])
            i += c
        out += stream.push(ids[i:])
        full = tok.decode(ids, skip_special_tokens=True)
        out += stream.finish(full)
        hits = [full.find(s) for s in stops if s in full]
        assert out == (full[:min(hits)] if hits else full)

    check()

