"""``retrospec serve`` from a client's side: the real server (uvicorn on a free loopback port, in a thread) driven by
the official ``openai`` client and by raw HTTP.

Two servers: the bundled zoo pair (``zoo`` + ``zoo-draft``, with an API key) for completions, errors, metrics and
cancellation; the tiny ChatML checkpoint of ``conftest.chat_models`` for chat completions and the load run (it is
~100x cheaper per token than the zoo, so 200 requests take seconds; the load run checks the server's accounting,
not the model). Nothing here asserts timing.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from conftest import CHAT_STOP_MESSAGES
from openai import OpenAI

import retrospec
from retrospec.serve import BackgroundServer, create_app
from retrospec.serve.loadtest import run_load

pytestmark = pytest.mark.usefixtures("single_thread")

KEY = "test-key"
PROMPT = "def parse_header(line):\n    "  # greedy zoo output has no EOS in its first 300 tokens
PROMPTS = [PROMPT, "import os\n\n\ndef walk(top):\n    ", "class Stack:\n    def push(self, x):",
           "with open(path) as f:\n    "]


@pytest.fixture(scope="module")
def zoo(single_thread):
    app = create_app("zoo", "zoo-draft", api_key=KEY)
    with BackgroundServer(app) as srv:
        srv.backend = app.state.backend
        yield srv


@pytest.fixture(scope="module")
def client(zoo):
    return OpenAI(base_url=f"{zoo.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def suffix_store(chat_models, tmp_path_factory):
    """A REST store over the source the chat model's tokenizer was trained on (built through the CLI)."""
    import inspect
    import textwrap

    from retrospec.cli import main

    root = tmp_path_factory.mktemp("serve_store")
    (root / "corpus.py").write_text(inspect.getsource(textwrap))
    assert main(["datastore", "build", "--kind", "suffix", "--out", str(root / "textwrap-suffix"), "--target",
                 str(chat_models.target), "--corpus", str(root / "corpus.py")]) == 0
    return root / "textwrap-suffix"


@pytest.fixture(scope="module")
def chat_server(chat_models, suffix_store, single_thread):
    app = create_app(str(chat_models.target), str(chat_models.draft), datastores=[str(suffix_store)])
    with BackgroundServer(app) as srv:
        yield srv


def _generate(zoo, prompt=PROMPT, **kw):
    b = zoo.backend
    return retrospec.generate(prompt, target=b.target, draft=b.draft, **kw)


def _stream_text(chunks) -> tuple[str, object]:
    text, last = "", None
    for ch in chunks:
        if ch.choices:
            text += ch.choices[0].text
        last = ch
    return text, last


def _metrics(zoo) -> str:
    req = urllib.request.Request(f"{zoo.url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        return resp.read().decode()


def _sample(text: str, name: str, **labels) -> float:
    want = "retrospec_" + name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return 0.0


# --- completions --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["sd", "pld"])
def test_streamed_equals_plain_equals_generate(zoo, client, method):
    n = 24
    ref = _generate(zoo, method=method, max_new_tokens=n, temperature=0.0)
    plain = client.completions.create(model="zoo", prompt=PROMPT, max_tokens=n, temperature=0,
                                      extra_body={"method": method})
    text, last = _stream_text(client.completions.create(model="zoo", prompt=PROMPT, max_tokens=n, temperature=0,
                                                        stream=True, extra_body={"method": method}))
    assert plain.choices[0].text == text == ref.text
    assert len(ref.token_ids) == n  # no EOS within n tokens: the answer ran out of length
    assert plain.choices[0].finish_reason == last.choices[0].finish_reason == "length"
    for u in (plain.usage, last.usage):
        assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (ref.stats.prompt_tokens, n,
                                                                          ref.stats.prompt_tokens + n)
    for stats in (plain.model_extra["retrospec"], last.model_extra["retrospec"]):
        assert stats["method"] == method and stats["new_tokens"] == n
        assert stats["mean_accepted_tokens"] == pytest.approx(n / stats["target_calls"])
        assert {"acceptance_rate", "gated_steps", "per_position_acceptance"} <= stats.keys()


def test_stop_string_is_cut_like_openai(zoo, client):
    full = _generate(zoo, method="sd", max_new_tokens=24).text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = full[: full.index(stop)]
    plain = client.completions.create(model="zoo", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "@@@"])
    text, last = _stream_text(client.completions.create(model="zoo", prompt=PROMPT, max_tokens=24, temperature=0,
                                                        stop=stop, stream=True))
    assert plain.choices[0].text == text == cut
    assert plain.choices[0].finish_reason == last.choices[0].finish_reason == "stop"
    assert plain.usage.completion_tokens < 24


def test_seeded_sampling_matches_the_library(zoo, client):
    knobs = dict(temperature=0.9, top_p=0.95, seed=3)
    # the server's default method is the library's: the zoo's fastest lossless one, its bundled LongSpec block
    assert zoo.backend.caps.default_method == retrospec.drafters.default_method("zoo") == "longspec"
    ref = retrospec.generate(PROMPT, target=zoo.backend.target, max_new_tokens=16, gating=False, top_k=50, **knobs)
    assert ref.stats.method == "longspec"
    body = {"gating": False, "top_k": 50}
    a = client.completions.create(model="zoo", prompt=PROMPT, max_tokens=16, extra_body=body, **knobs)
    text, _ = _stream_text(client.completions.create(model="zoo", prompt=PROMPT, max_tokens=16, stream=True,
                                                     extra_body=body, **knobs))
    assert a.choices[0].text == text == ref.text
    assert a.model_extra["retrospec"]["gating"] is False


def test_concurrent_requests_equal_sequential(zoo, client):
    jobs = [(p, m, n) for p in PROMPTS for m, n in (("sd", 6), ("pld", 9))]

    def ask(job):
        p, m, n = job
        r = client.completions.create(model="zoo", prompt=p, max_tokens=n, temperature=0, extra_body={"method": m})
        return r.choices[0].text, r.usage.completion_tokens, r.model_extra["retrospec"]["method"]

    sequential = [ask(j) for j in jobs]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        concurrent = list(pool.map(ask, jobs))
    assert concurrent == sequential
    assert [s[2] for s in sequential] == [m for _, m, _ in jobs]


# --- errors -------------------------------------------------------------------------------------------------------

BAD = [
    ({"extra_body": {"bogus": 1}}, "bogus", "unknown field"),
    ({"temperature": -1}, "temperature", "temperature must be >= 0"),
    ({"extra_body": {"method": "nope"}}, "method", "not served"),
    ({"n": 2}, "n", "n > 1"),
    ({"logprobs": 2}, "logprobs", "logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"extra_body": {"method": "pld", "num_drafts": 2}}, "num_drafts", "does not apply to method 'pld'"),
    ({"extra_body": {"method": "rest"}}, "method", "datastore"),
    ({"extra_body": {"gamma": 0}}, "gamma", "gamma must be >= 1"),
    ({"extra_body": {"gating": "yes"}}, "gating", "true or false"),
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
    ({"prompt": ["a", "b"]}, "prompt", "batched prompts"),
    ({"prompt": "   "}, "prompt", "prompt is empty"),
    ({"seed": 2**70}, "seed", "64-bit integer"),
]


@pytest.mark.parametrize("kwargs,param,fragment", BAD, ids=[b[1] + "-" + b[2].split()[0] for b in BAD])
def test_bad_completion_requests_are_400_openai_shaped(client, kwargs, param, fragment):
    args = {"model": "zoo", "prompt": PROMPT, "max_tokens": 4} | kwargs
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(**args)
    body = exc.value.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == param
    assert fragment.lower() in body["error"]["message"].lower()
    assert "\n" not in body["error"]["message"] and "Traceback" not in body["error"]["message"]


def test_chat_on_a_model_without_template_is_400(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="zoo", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    err = exc.value.response.json()["error"]
    assert "no chat template" in err["message"] and "/v1/completions" in err["message"]
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model="zoo", messages=[{"role": "user", "content": "hi"}],
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])


def test_raw_http_errors(zoo):
    conn = http.client.HTTPConnection("127.0.0.1", zoo.port, timeout=30)
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for method, path, body, status in (("POST", "/v1/completions", b"{not json", 400),
                                       ("POST", "/v1/completions", b"[1, 2]", 400),
                                       ("GET", "/v1/nothing", None, 404),
                                       ("GET", "/v1/completions", None, 405)):
        conn.request(method, path, body=body, headers=auth)
        resp = conn.getresponse()
        err = json.loads(resp.read())["error"]
        assert resp.status == status and err["message"], (path, err)
    conn.close()


def test_model_mismatch_is_404(client):
    with pytest.raises(openai.NotFoundError, match="not served"):
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)


def test_api_key(zoo):
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=f"{zoo.url}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(f"{zoo.url}/metrics")
    assert exc.value.code == 401 and json.loads(exc.value.read())["error"]["code"] == "invalid_api_key"
    with urllib.request.urlopen(f"{zoo.url}/health") as resp:  # /health needs no key
        assert json.loads(resp.read())["status"] == "ok"


def test_models_lists_the_served_model(client):
    (model,) = client.models.list().data
    assert model.id == "zoo"
    assert {"ar", "sd", "pld"} <= set(model.model_extra["retrospec"]["methods"])


def test_a_failing_generation_is_500_and_the_server_lives_on(zoo, client, monkeypatch):
    import retrospec.serve.backend as backend

    class Broken(backend.Run):
        def __iter__(self):
            raise RuntimeError("boom")
            yield

    monkeypatch.setattr(backend, "Run", Broken)
    with pytest.raises(openai.InternalServerError) as exc:
        client.completions.create(model="zoo", prompt=PROMPT, max_tokens=2)
    assert exc.value.response.json()["error"]["type"] == "server_error"
    monkeypatch.undo()
    assert client.completions.create(model="zoo", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


# --- cancellation, metrics ----------------------------------------------------------------------------------------

def _wait_for(cond, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_client_disconnect_cancels_the_generation(zoo, client):
    before = _sample(_metrics(zoo), "generations_cancelled_total", method="ar")
    stream = client.completions.create(model="zoo", prompt=PROMPT, max_tokens=490, temperature=0, stream=True,
                                       extra_body={"method": "ar"})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    assert _wait_for(lambda: _sample(_metrics(zoo), "generations_cancelled_total", method="ar") == before + 1)
    # a plain (non-streamed) request whose client leaves is cancelled too
    body = json.dumps({"prompt": PROMPT, "max_tokens": 490, "method": "ar"}).encode()
    with socket.create_connection(("127.0.0.1", zoo.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(1.0)
    assert _wait_for(lambda: _sample(_metrics(zoo), "generations_cancelled_total", method="ar") == before + 2)
    assert _wait_for(lambda: zoo.backend.queue_depth == 0)
    assert client.completions.create(model="zoo", prompt=PROMPT, max_tokens=2).choices[0].text


def test_metrics_count_requests_and_speculation(zoo, client):
    client.completions.create(model="zoo", prompt=PROMPT, max_tokens=12, temperature=0,
                              extra_body={"method": "sd", "gating": False})
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="zoo", prompt=PROMPT, max_tokens=2, extra_body={"bogus": True})
    text = _metrics(zoo)
    for family in ("requests_total", "generated_tokens_total", "drafted_tokens_total", "accepted_tokens_total",
                   "target_calls_total", "gated_steps_total", "mean_accepted_tokens", "acceptance_rate",
                   "last_mean_accepted_tokens", "last_acceptance_rate", "position_drafted_total",
                   "position_accepted_total"):
        assert f"# TYPE retrospec_{family} " in text
    assert _sample(text, "requests_total", route="/v1/completions", status="200") > 0
    assert _sample(text, "requests_total", route="/v1/completions", status="400") > 0
    gen, calls = _sample(text, "generated_tokens_total", method="sd"), _sample(text, "target_calls_total", method="sd")
    drafted, accepted = (_sample(text, "drafted_tokens_total", method="sd"),
                         _sample(text, "accepted_tokens_total", method="sd"))
    assert gen > 0 and calls > 0 and drafted > 0  # the ungated request drafted every step
    assert _sample(text, "mean_accepted_tokens", method="sd") == pytest.approx(gen / calls)
    assert _sample(text, "acceptance_rate", method="sd") == pytest.approx(accepted / drafted)
    assert _sample(text, "position_drafted_total", method="sd", position="1") > 0


# --- chat, load ---------------------------------------------------------------------------------------------------

def test_chat_streamed_equals_plain_equals_generate(chat_server, chat_models):
    c = OpenAI(base_url=f"{chat_server.url}/v1", api_key="unused", max_retries=0)
    ref = retrospec.generate(messages=CHAT_STOP_MESSAGES, target=str(chat_models.target),
                             draft=str(chat_models.draft), method="sd", max_new_tokens=24)
    plain = c.chat.completions.create(model="target", messages=CHAT_STOP_MESSAGES, max_tokens=24, temperature=0)
    deltas, roles, last = [], [], None
    for ch in c.chat.completions.create(model="target", messages=CHAT_STOP_MESSAGES, max_tokens=24, temperature=0,
                                        stream=True):
        delta = ch.choices[0].delta
        roles += [delta.role] if delta.role else []
        deltas.append(delta.content or "")
        last = ch
    msg = plain.choices[0].message
    assert msg.role == "assistant" and roles == ["assistant"]
    assert msg.content == "".join(deltas) == ref.text
    # the reply ends at the template's end-of-turn token, not at the length limit
    assert plain.choices[0].finish_reason == last.choices[0].finish_reason == "stop"
    assert plain.usage.completion_tokens == last.usage.completion_tokens == chat_models.stop_step + 1
    assert last.model_extra["retrospec"]["method"] == "sd"


def test_rest_with_the_served_datastore(chat_server, chat_models, suffix_store):
    c = OpenAI(base_url=f"{chat_server.url}/v1", api_key="unused", max_retries=0)
    prompt = "    def _wrap_chunks(self, chunks):\n"
    ref = retrospec.generate(prompt, target=str(chat_models.target), method="rest", datastore=str(suffix_store),
                             num_drafts=2, draft_len=4, max_new_tokens=20, gating=False)
    knobs = {"method": "rest", "num_drafts": 2, "draft_len": 4, "gating": False}
    a = c.completions.create(model="target", prompt=prompt, max_tokens=20, extra_body=knobs)
    b = c.completions.create(model="target", prompt=prompt, max_tokens=20,
                             extra_body=knobs | {"datastore": "textwrap-suffix"})
    assert a.choices[0].text == b.choices[0].text == ref.text
    assert a.model_extra["retrospec"]["method"] == "rest" and a.model_extra["retrospec"]["drafted_tokens"] > 0
    with pytest.raises(openai.BadRequestError) as exc:
        c.completions.create(model="target", prompt=prompt, max_tokens=2, extra_body=knobs | {"datastore": "other"})
    assert exc.value.response.json()["error"]["param"] == "datastore"
    assert "textwrap-suffix" in exc.value.response.json()["error"]["message"]


def test_load_run_answers_every_request(chat_server):
    def counts() -> tuple[float, float]:
        with urllib.request.urlopen(f"{chat_server.url}/metrics") as resp:
            text = resp.read().decode()
        return (_sample(text, "requests_total", route="/v1/completions", status="200"),
                _sample(text, "generations_total", method="sd"))

    before = counts()
    rep = run_load(chat_server.url, requests=200, threads=8, max_tokens=8, model="target")
    assert rep.requests == 200 and rep.ok == 200 and rep.errors == 0, rep.first_error
    assert rep.statuses == {"200": 200}
    assert 200 <= rep.completion_tokens <= 200 * 8
    after = counts()
    assert (after[0] - before[0], after[1] - before[1]) == (200, 200)  # nothing lost, nothing counted twice


# --- longspec ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def longspec_block(chat_models, tmp_path_factory):
    """A random LongSpec block bound to the chat model (saved like ``retrospec train longspec`` does)."""
    from test_longspec import randomized

    from retrospec.models import load_model
    from retrospec.models.longspec import save_longspec

    tgt = load_model(str(chat_models.target))
    return save_longspec(randomized(tgt.model, window=16, std=0.1), tgt, tmp_path_factory.mktemp("serve_ls") / "blk")


@pytest.fixture(scope="module")
def longspec_server(chat_models, longspec_block, single_thread):
    app = create_app(str(chat_models.target), longspec_draft=str(longspec_block), method="longspec")
    with BackgroundServer(app) as srv:
        yield srv


@pytest.mark.parametrize("knobs", [{}, {"gamma": 3}, {"tree": "2,2"}], ids=["tree-default", "gamma", "tree"])
def test_longspec_knobs_equal_generate(longspec_server, chat_models, longspec_block, knobs):
    c = OpenAI(base_url=f"{longspec_server.url}/v1", api_key="unused", max_retries=0)
    prompt = "    def _wrap_chunks(self, chunks):\n"
    lib = {"tree": tuple(int(w) for w in knobs["tree"].split(","))} if "tree" in knobs else dict(knobs)
    ref = retrospec.generate(prompt, target=str(chat_models.target), draft=str(longspec_block), method="longspec",
                             max_new_tokens=16, gating=False, **lib)
    res = c.completions.create(model="target", prompt=prompt, max_tokens=16, extra_body=knobs | {"gating": False})
    assert res.choices[0].text == ref.text
    stats = res.model_extra["retrospec"]
    assert stats["method"] == "longspec" and stats["drafted_tokens"] > 0  # the server's default method
    assert stats["draft_state_bytes"] > 0 and stats["target_kv_bytes"] > 0
    if "gamma" in knobs:  # gamma bounds the block's chain; the lookup chain (default on) has its own length
        from retrospec.drafters.longspec import DEFAULT_LOOKUP
        assert len(stats["per_position_drafted"]) <= max(3, DEFAULT_LOOKUP)


@pytest.mark.parametrize("body,fragment", [
    ({"tree": "2,x"}, "comma-separated widths"),
    ({"tree": "2,0"}, ">= 1"),
    ({"tree": [2, 2]}, "a string of widths"),
    ({"tree": "2,2", "gamma": 2}, "not both"),
    ({"method": "pld", "tree": "2,2"}, "does not apply to method 'pld'"),
])
def test_bad_longspec_knobs_are_400(longspec_server, body, fragment):
    c = OpenAI(base_url=f"{longspec_server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as exc:
        c.completions.create(model="target", prompt="x = 1\n", max_tokens=2, extra_body=body)
    err = exc.value.response.json()["error"]
    assert err["param"] == "tree"
    assert fragment in err["message"] and "\n" not in err["message"]


def test_longspec_unavailable_without_a_block(chat_server):
    c = OpenAI(base_url=f"{chat_server.url}/v1", api_key="unused", max_retries=0)
    (model,) = c.models.list().data
    info = model.model_extra["retrospec"]
    assert "longspec" not in info["methods"] and "--longspec-draft" in info["unavailable"]["longspec"]
    with pytest.raises(openai.BadRequestError) as exc:
        c.completions.create(model="target", prompt="x = 1\n", max_tokens=2, extra_body={"method": "longspec"})
    err = exc.value.response.json()["error"]
    assert err["param"] == "method" and "not served here" in err["message"] and "--longspec-draft" in err["message"]


# --- the command line -------------------------------------------------------------------------------------------

def test_cli_user_errors_are_one_line(cli, tmp_path):
    cli("serve", "--port", "0", "--target", tmp_path / "nothing").assert_user_error("not found")
    cli("serve", "--port", "0", "--method", "nope").assert_user_error("unknown method")
    cli("serve", "--port", "0", "--method", "rest").assert_user_error("rest", "--datastore")
    cli("serve", "--port", "0", "--longspec-draft", tmp_path / "nope").assert_user_error("not found")
    cli("serve", "--port", "70000").assert_user_error("port")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        cli("serve", "--port", port).assert_user_error(f"cannot listen on 127.0.0.1:{port}", "in use")
