"""The server on a model without a tokenizer (dummy weights, as `eval/bench_server.py` and load tests use it):
token-id prompts in, token counts out; whatever needs text is refused with a 400 that says why. And the HTTP
keep-alive the server gives idle connections.
"""

import http.client
import json
import threading
import time

import httpx
import pytest

from eightbit import LLM, EngineConfig, LLMEngine, SamplingParams
from eightbit.engine.server.cli import GRACEFUL_SHUTDOWN_S, KEEP_ALIVE_S, BackgroundServer

ENGINE_OPTIONS = dict(model="llama-tiny", load_format="dummy", dtype="float32", device="cpu", kv_cache_memory_gb=0.05)
PROMPT = [5, 17, 300, 42, 7, 99, 1000, 3]


@pytest.fixture(scope="module")
def server():
    srv = BackgroundServer(LLMEngine(EngineConfig(**ENGINE_OPTIONS))).start()
    yield srv
    srv.stop()


def model_id(server):
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


def test_token_id_completions_run_to_their_length(server):
    offline = LLM(**ENGINE_OPTIONS).generate([PROMPT], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    want = offline[0].outputs[0]
    resp = post(server, "/v1/completions", {"model": model_id(server), "prompt": PROMPT, "max_tokens": 6,
                                            "temperature": 0})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": len(want.token_ids),
                             "total_tokens": len(PROMPT) + len(want.token_ids)}
    assert body["choices"][0]["text"] == "" and body["choices"][0]["finish_reason"] == want.finish_reason


def test_a_stream_sends_a_chunk_per_token(server):
    """No text is ever held back without a tokenizer, so each token is a chunk (load tests count them)."""
    body = {"model": model_id(server), "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    tpots = tpot_count(server)
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    with_choices = [c for c in chunks if c["choices"]]
    assert len(with_choices) == 5
    assert [c["choices"][0]["finish_reason"] for c in with_choices] == [None] * 4 + ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert tpot_count(server) == tpots + 1  # the stream's outputs are deltas: its 5 tokens are counted, not its last 1


def tpot_count(server) -> float:
    metrics = httpx.get(server.url + "/metrics").text
    return float(next(line.split()[-1] for line in metrics.splitlines()
                      if line.startswith("eightbit_time_per_output_token_seconds_count")))


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/completions", {"prompt": "hello"}, "prompt"),
    ("/v1/completions", {"prompt": ["hello", "world"]}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "stop": ["x"]}, "stop"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 0}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
])
def test_what_needs_text_is_refused_by_name(server, path, extra, param):
    resp = post(server, path, {"model": model_id(server), "max_tokens": 2, **extra})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and "no tokenizer" in err["message"]
    assert post(server, "/v1/completions", {"model": model_id(server), "prompt": PROMPT, "max_tokens": 1,
                                            "stop_token_ids": [3]}).status_code == 200  # ids need no text


def test_an_idle_connection_outlives_clients_pool_expiry(server):
    """uvicorn's default keep-alive (5 s) equals httpx's and the OpenAI SDK's pool expiry, so the server could close
    a connection just as a client reused it (requests lost under load, docs/benchmarks.md). The server keeps idle
    connections longer: a request 6 s after the last one on the same connection is answered."""
    assert KEEP_ALIVE_S > 15  # aiohttp's pool expiry, the longest of the common clients'
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    try:
        for wait in (0, 6):
            time.sleep(wait)
            conn.request("GET", "/health")
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200
    finally:
        conn.close()


@pytest.mark.parametrize("flags, want", [([], (KEEP_ALIVE_S, GRACEFUL_SHUTDOWN_S)),
                                         (["--timeout-keep-alive", "7", "--timeout-graceful-shutdown", "3"], (7, 3))])
def test_serve_passes_its_keep_alive_and_shutdown_bound_to_uvicorn(flags, want, monkeypatch):
    """The shutdown bound: without it a Ctrl-C or SIGTERM waited for every open stream (61 s and counting)."""
    import uvicorn

    from eightbit.cli import main as cli_main

    seen = {}
    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets=None: seen.update(
        timeout_keep_alive=server.config.timeout_keep_alive,
        timeout_graceful_shutdown=server.config.timeout_graceful_shutdown))
    argv = ["serve", "--model", "llama-tiny", "--load-format", "dummy", "--device", "cpu", "--dtype", "float32",
            "--port", "0", *flags]
    assert cli_main(argv) == 0
    assert (seen["timeout_keep_alive"], seen["timeout_graceful_shutdown"]) == want


def test_a_second_ctrl_c_does_not_print_a_traceback_per_open_request():
    """A second Ctrl-C makes uvicorn quit at once and cancel every open request, each of which it logged as a
    CancelledError traceback (and the lifespan task's, as text). From the second Ctrl-C on those are dropped; other
    errors, and the same records after one Ctrl-C, still print."""
    import asyncio
    import logging
    import signal

    from eightbit.engine.server.cli import uvicorn_server

    def record(exc=None, msg="Exception in ASGI application"):
        exc_info = (type(exc), exc, None) if exc else None
        return logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, msg, None, exc_info)

    cancelled, other = record(asyncio.CancelledError()), record(RuntimeError("a real error"))
    lifespan = record(msg="Traceback ...\nasyncio.exceptions.CancelledError\n")
    logger = logging.getLogger("uvicorn.error")
    before = list(logger.filters)
    server = uvicorn_server(lambda scope, receive, send: None)
    try:
        server.handle_exit(signal.SIGINT, None)
        assert server.should_exit and not server.force_exit
        assert all(logger.filter(r) for r in (cancelled, lifespan, other))
        server.handle_exit(signal.SIGINT, None)
        assert server.force_exit
        assert not logger.filter(cancelled) and not logger.filter(lifespan) and logger.filter(other)
    finally:
        logger.filters[:] = before


def test_a_shutdown_answers_the_requests_still_open_with_a_503():
    """Past its graceful wait, uvicorn cancelled the open handlers: a non-streamed request got a plain-text 500 and
    a stream was cut mid-body (the openai client raised a protocol error). Now they are answered before that."""
    engine = LLMEngine(EngineConfig(**ENGINE_OPTIONS))
    step = engine.step
    engine.step = lambda *a, **k: (time.sleep(0.01), step(*a, **k))[1]  # 1,000 tokens take 10 s or more
    srv = BackgroundServer(engine, timeout_graceful_shutdown=2).start()
    body = {"model": model_id(srv), "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True}
    answers = {}

    def plain():
        answers["plain"] = post(srv, "/v1/completions", body)

    def stream():
        with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as resp:
            answers["stream"] = [line for line in resp.iter_lines() if line.startswith("data: ")]

    clients = [threading.Thread(target=plain), threading.Thread(target=stream)]
    for c in clients:
        c.start()
    deadline = time.monotonic() + 30
    while len(srv.app.state.server.open_generations) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # both have tokens
    start = time.monotonic()
    srv.stop()
    for c in clients:
        c.join(30)
    assert time.monotonic() - start < 2 + 1  # within the graceful wait, not 10 s of generation
    assert answers["plain"].status_code == 503, answers["plain"].text
    assert answers["plain"].json()["error"]["code"] == "shutting_down"
    lines = answers["stream"]
    assert lines[-1] == "data: [DONE]" and len(lines) > 3  # some tokens, the error event, [DONE]
    assert json.loads(lines[-2][6:])["error"]["code"] == "shutting_down"
    assert not engine.requests  # their engine requests were aborted


def test_pages_served_from_this_machine_may_call_the_api_from_a_browser(server):
    """CORS, by default for local pages only (the server has no API keys: any page the user has open must not use
    it): a local page's preflight is answered (and not counted as an API response), every answer names it; another
    site's preflight is refused."""
    preflight = {"access-control-request-method": "POST", "access-control-request-headers": "content-type"}
    counts = server.app.state.server.metrics.requests
    before = dict(counts)
    for origin in ("http://localhost:3000", "http://127.0.0.1", "https://[::1]:8443"):
        resp = httpx.options(server.url + "/v1/chat/completions", headers={"origin": origin, **preflight})
        assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == origin, resp.text
        assert "POST" in resp.headers["access-control-allow-methods"]
    assert counts.get(("/v1/chat/completions", 200), 0) == before.get(("/v1/chat/completions", 200), 0)
    resp = httpx.post(server.url + "/v1/completions", headers={"origin": "http://localhost:3000"},
                      json={"model": model_id(server), "prompt": PROMPT, "max_tokens": 1})
    assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == "http://localhost:3000"
    for origin in ("https://evil.test", "http://localhost.evil.test"):
        resp = httpx.options(server.url + "/v1/chat/completions", headers={"origin": origin, **preflight})
        assert resp.status_code == 400 and "access-control-allow-origin" not in resp.headers


def test_allowed_origins_choose_which_pages_may_call_the_api():
    from eightbit.engine.server.cli import _origins

    assert _origins("http://a.test, *,") == ("http://a.test", "*") and _origins("") == ()
    preflight = {"access-control-request-method": "POST"}
    for origins, origin, allowed in [(("*",), "https://any.test", "*"), (("http://a.test",), "http://a.test",
                                                                         "http://a.test"),
                                     (("http://a.test",), "http://localhost:3000", None),
                                     ((), "http://localhost:3000", None)]:
        srv = BackgroundServer(LLMEngine(EngineConfig(**ENGINE_OPTIONS)), allowed_origins=origins).start()
        try:
            resp = httpx.options(srv.url + "/v1/completions", headers={"origin": origin, **preflight})
            assert resp.headers.get("access-control-allow-origin") == allowed, (origins, origin)
            assert (resp.status_code == 200) == (allowed is not None)
            resp = httpx.get(srv.url + "/v1/models", headers={"origin": origin})
            assert resp.status_code == 200 and resp.headers.get("access-control-allow-origin") == allowed
        finally:
            srv.stop()


def test_unknown_fields_are_logged_once_each_and_boundedly(server, caplog, monkeypatch):
    from eightbit.engine.server import protocol

    monkeypatch.setattr(protocol, "_unknown_fields_logged", set())
    body = {"model": model_id(server), "prompt": PROMPT, "max_tokens": 1, "some_vendor_field": 1}
    with caplog.at_level("WARNING", logger="eightbit.server"):
        for _ in range(2):
            assert post(server, "/v1/completions", body).status_code == 200
        flood = {f"x{i}": 1 for i in range(2 * protocol.MAX_UNKNOWN_FIELDS_LOGGED)}
        for _ in range(2):
            assert post(server, "/v1/completions", {**body, **flood}).status_code == 200
    logged = [r.getMessage() for r in caplog.records if "ignoring field" in r.getMessage()]
    assert "some_vendor_field" in logged[0] and len(logged) == 2  # once, then the flood's first names, then nothing
    assert len(protocol._unknown_fields_logged) == protocol.MAX_UNKNOWN_FIELDS_LOGGED
    assert "no more unknown fields will be logged" in logged[1]
    monkeypatch.setattr(protocol, "_unknown_fields_logged", set())
    with caplog.at_level("WARNING", logger="eightbit.server"):
        post(server, "/v1/completions", {**body, "a\nERROR forged line": 1})
    assert "\n" not in caplog.records[-1].getMessage() and "'a\\nERROR forged line'" in caplog.records[-1].getMessage()
