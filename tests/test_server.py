"""The OpenAI-compatible server, end to end over loopback HTTP with the official `openai` client.

Two servers per session, one after the other (uvicorn in a background thread, port picked by the OS) on the
embedded SmolLM2-135M-Instruct, float32 on the CPU: the engine loop in a thread of this process, then in a process
of its own (EngineProcess, `eightbit serve`'s default); every test that takes `server` runs against both. The
offline `LLM` in this process is the reference for greedy outputs.
"""

import asyncio
import json
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx  # the [test] extra installs both clients: a missing one is an error here, not a skip
import openai
import pytest

from eightbit import LLM, SamplingParams
from eightbit.engine.server.cli import EMBEDDED_MODEL_NAME, BackgroundServer

ENGINE_OPTIONS = dict(dtype="float32", device="cpu", max_model_len=2048, kv_cache_memory_gb=0.25)
MODEL = EMBEDDED_MODEL_NAME
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time", "def fibonacci(n):",
           "The quick brown fox"]


@pytest.fixture(scope="session")
def offline():
    return LLM(**ENGINE_OPTIONS)


@pytest.fixture(scope="session", params=["thread", "process"])
def server(request):
    from eightbit import EngineConfig, LLMEngine
    from eightbit.engine.server.engine_process import EngineProcess

    config = EngineConfig(model=None, **ENGINE_OPTIONS)
    srv = BackgroundServer(LLMEngine(config) if request.param == "thread" else EngineProcess(config)).start()
    yield srv
    srv.stop()


def in_process(server) -> bool:
    return hasattr(server.async_engine, "engine")


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def metrics(server) -> dict:
    out = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_idle(server, timeout=10.0) -> dict:
    """Poll /metrics until no request runs or waits and every KV block is back in the pool."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        idle = (m["eightbit_num_requests_running"] == 0 and m["eightbit_num_requests_waiting"] == 0
                and m["eightbit_kv_cache_blocks_used"] == 0 and server.app.state.server.num_queued == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def wait_for_change(server, name, before, timeout=10.0) -> dict:
    """Poll /metrics until counter `name` is no longer `before` (or the timeout passes); returns the metrics."""
    deadline = time.monotonic() + timeout
    while (m := metrics(server)).get(name, 0) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    return m


def post(server, path, body, **kw):
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    kw.setdefault("timeout", 120)
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return httpx.post(server.url + path, content=content, headers=headers, **kw)


def stream_events(server, path, body, timeout=120) -> list[dict]:
    """POST a streamed request; the JSON of its data: lines (the final [DONE] left out)."""
    with httpx.stream("POST", server.url + path, json=body, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: {")]


def tiny_config():
    from eightbit import EngineConfig

    return EngineConfig("llama-tiny", load_format="dummy", device="cpu", dtype="float32", kv_cache_memory_gb=0.01,
                        max_model_len=256)


def tiny_engine():
    """A dummy-weight engine of its own, for tests that need one beside the session's servers."""
    from eightbit import LLMEngine

    return LLMEngine(tiny_config())


def watch_rendering(monkeypatch, chat_template=None) -> list:
    """Watch the server's chat rendering (engine/chat.render_chat as api.py calls it), optionally with another
    template: a record per rendering, with its messages, the template variables the server passed (kwargs) and
    the text."""
    from types import SimpleNamespace

    from eightbit.engine.server import api

    seen, real = [], api.render_chat

    def render(tok, messages, *args, **kwargs):
        extra = {} if chat_template is None else {"chat_template": chat_template}
        text, ids = real(tok, messages, *args, **kwargs, **extra)
        seen.append(SimpleNamespace(messages=messages, kwargs=kwargs, text=text))
        return text, ids

    monkeypatch.setattr(api, "render_chat", render)
    return seen


def parallel(*calls):
    """Run the zero-argument callables at once (their requests share engine steps); results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def greedy(max_tokens=16, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


# --- basics ---------------------------------------------------------------------------------------


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    text = httpx.get(server.url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_used", "generation_tokens_total",
                 "time_to_first_token_seconds_bucket", "time_per_output_token_seconds_count",
                 "engine_loop_outside_model_ratio"):
        assert f"eightbit_{name}" in text


def test_model_retrieve_by_id(server, client):
    """GET /v1/models/{id}: the served model's card (its id may hold a slash), 404 model_not_found otherwise,
    both counted under one metric label whatever the id."""
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("org/other-model")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    before = metrics(server)
    httpx.get(server.url + "/v1/models/x/y/z")
    after = metrics(server)
    label = 'eightbit_http_responses_total{endpoint="/v1/models/{id}",status="404"}'
    assert after[label] == before.get(label, 0) + 1


def test_completions_greedy_equal_offline(server, client, offline):
    ref = offline.generate(PROMPTS, greedy(), use_tqdm=False)
    tok = offline.get_tokenizer()
    outs = parallel(*(lambda p=p: client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0)
                      for p in PROMPTS))
    for prompt, r, out in zip(PROMPTS, ref, outs):
        c = out.choices[0]
        assert c.text == r.outputs[0].text
        assert c.finish_reason == r.outputs[0].finish_reason
        assert out.usage.prompt_tokens == len(tok(prompt).input_ids)
        assert out.usage.completion_tokens == len(r.outputs[0].token_ids)
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
        assert out.object == "text_completion" and out.model == MODEL


def test_penalties_reach_the_engine(client, offline):
    """OpenAI's presence / frequency penalties and vLLM's repetition_penalty: the same text as the offline LLM
    with the same SamplingParams, and not the text without them."""
    extra = dict(presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.2)
    ref = offline.generate(["1, 2, 3, 4,"], greedy(24, **extra), use_tqdm=False)[0].outputs[0].text
    plain = offline.generate(["1, 2, 3, 4,"], greedy(24), use_tqdm=False)[0].outputs[0].text
    out = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=24, temperature=0,
                                    presence_penalty=0.5, frequency_penalty=1.0,
                                    extra_body={"repetition_penalty": 1.2})
    assert out.choices[0].text == ref != plain


def test_logit_bias_and_min_tokens_reach_the_engine(client, offline):
    """OpenAI's logit_bias (token ids as string keys) and vLLM's min_tokens: the offline LLM's text with the same
    SamplingParams."""
    ref = offline.generate(["Once upon a time"], greedy(8, logit_bias={1234: 30.0, 11: -100.0}, min_tokens=8),
                           use_tqdm=False)[0].outputs[0]
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0,
                                    logit_bias={"1234": 30, "11": -100}, extra_body={"min_tokens": 8})
    assert out.choices[0].text == ref.text and 1234 in ref.token_ids


def test_include_stop_str_in_output(client, offline):
    free = offline.generate(["Once upon a time"], greedy(16), use_tqdm=False)[0].outputs[0].text
    stop = free.split()[2]
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0, stop=[stop],
                                    extra_body={"include_stop_str_in_output": True})
    assert out.choices[0].text == free[: free.index(stop) + len(stop)] and out.choices[0].finish_reason == "stop"


def test_completions_batch_prompt_and_token_ids(client, offline):
    ref = offline.generate(PROMPTS[:3], greedy(8), use_tqdm=False)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=8, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [r.outputs[0].text for r in ref]
    ids = offline.get_tokenizer()(PROMPTS[0]).input_ids
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert out.choices[0].text == ref[0].outputs[0].text
    assert out.usage.prompt_tokens == len(ids)


def test_completions_stream(server, client, offline):
    ref = offline.generate(PROMPTS[:2], greedy(), use_tqdm=False)
    streams = parallel(*(lambda p=p: list(client.completions.create(
        model=MODEL, prompt=p, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}))
        for p in PROMPTS[:2]))
    for r, chunks in zip(ref, streams):
        texts = [ch.choices[0].text for ch in chunks if ch.choices]
        assert "".join(texts) == r.outputs[0].text
        assert len([t for t in texts if t]) > 1  # it really streamed
        finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        assert finals == [r.outputs[0].finish_reason]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(r.outputs[0].token_ids)
        assert all(ch.usage is None for ch in chunks[:-1])
    # the raw SSE framing: data: lines, ending with [DONE]
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "stream": True}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "text_completion"
    # without include_usage no chunk has a usage field (OpenAI: "only present" when asked for); with it, null in
    # every chunk but the last
    assert all("usage" not in json.loads(line[6:]) for line in lines[:-1])
    for path, body in (("/v1/completions", {"prompt": PROMPTS[0]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        events = stream_events(server, path, {"model": MODEL, "max_tokens": 3, "stream": True,
                                              "stream_options": {"include_usage": True}, **body})
        assert all(e["usage"] is None for e in events[:-1]) and events[-1]["usage"]["completion_tokens"] >= 1
        events = stream_events(server, path, {"model": MODEL, "max_tokens": 3, "stream": True, **body})
        assert events and all("usage" not in e for e in events), path


def test_chat_equal_offline_stream_and_not(client, offline):
    conversations = [[{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "system", "content": "You are terse."},
                      {"role": "user", "content": [{"type": "text", "text": "Say hi."}]}]]
    for messages in conversations:
        offline_messages = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                             else m["content"][0]["text"]} for m in messages]
        r = offline.chat(offline_messages, greedy(24), use_tqdm=False)[0]
        kw = dict(model=MODEL, messages=messages, max_tokens=24, temperature=0)
        out, chunks = parallel(lambda: client.chat.completions.create(**kw), lambda: list(
            client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)))
        assert out.choices[0].message.content == r.outputs[0].text
        assert out.choices[0].message.role == "assistant"
        assert out.choices[0].finish_reason == r.outputs[0].finish_reason
        assert out.usage.prompt_tokens == len(r.prompt_token_ids)
        assert out.usage.completion_tokens == len(r.outputs[0].token_ids)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == r.outputs[0].text
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == [
            r.outputs[0].finish_reason]
        assert chunks[-1].object == "chat.completion.chunk"
        assert chunks[-1].usage.total_tokens == out.usage.total_tokens


# --- sampling parameters ----------------------------------------------------------------------------


def test_n_and_seed_reproducible(client):
    kw = dict(model=MODEL, prompt="My favourite animal is", max_tokens=12, temperature=1.0, n=3)
    a, b, c, ids, chunks = parallel(
        lambda: client.completions.create(seed=1234, **kw),
        lambda: client.completions.create(seed=1234, **kw),
        lambda: client.completions.create(seed=99, **kw),
        lambda: client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=12, n=3, seed=5,
                                          extra_body={"ignore_eos": True}),
        lambda: list(client.completions.create(seed=1234, stream=True, **kw)))
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert len({ch.text for ch in a.choices}) > 1  # the n samples differ from one another
    assert [ch.text for ch in a.choices] != [ch.text for ch in c.choices]
    assert ids.usage.completion_tokens == 3 * 12  # every choice counts
    assert ids.usage.prompt_tokens == a.usage.prompt_tokens < 12  # the prompt counts once
    # streamed n > 1 gives the same samples, each choice's deltas joined
    joined = {}
    for ch in chunks:
        for choice in ch.choices:
            joined[choice.index] = joined.get(choice.index, "") + choice.text
    assert [joined[i] for i in range(3)] == [ch.text for ch in a.choices]
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8, n=2,
              temperature=1.0, seed=7, logprobs=True)
    chat, again = parallel(lambda: client.chat.completions.create(**kw), lambda: client.chat.completions.create(**kw))
    assert [c.index for c in chat.choices] == [0, 1]
    assert [c.message.content for c in chat.choices] == [c.message.content for c in again.choices]
    assert chat.usage.completion_tokens == sum(len(c.logprobs.content) for c in chat.choices)


def test_any_64_bit_seed_is_taken(client):
    """vLLM takes any int64 seed, and clients send -1; it is taken modulo 2**63."""
    kw = dict(model=MODEL, prompt="My favourite animal is", max_tokens=8, temperature=1.0)
    negative, same = parallel(lambda: client.completions.create(seed=-1, **kw),
                              lambda: client.completions.create(seed=2**63 - 1, **kw))
    assert negative.choices[0].text == same.choices[0].text
    for seed in (2**63, -2**63 - 1):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(seed=seed, **kw)
        assert e.value.body["param"] == "seed" and "64-bit" in e.value.body["message"]


def test_chat_stream_chunks_carry_the_stop_reason(client, offline):
    messages = [{"role": "user", "content": "Tell me a story."}]
    free = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    stop = free.choices[0].message.content.split()[3]
    kw = dict(model=MODEL, messages=messages, max_tokens=16, temperature=0, stop=[stop])
    whole = client.chat.completions.create(**kw)
    last = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices and c.choices[0].finish_reason]
    assert whole.choices[0].model_extra["stop_reason"] == stop
    assert len(last) == 1 and last[0].choices[0].finish_reason == "stop"
    assert last[0].choices[0].model_extra["stop_reason"] == stop


def test_probes_answer_head(server):
    assert httpx.head(server.url + "/health").status_code == 200
    assert httpx.head(server.url + "/v1/models").status_code == 200
    assert httpx.head(server.url + f"/v1/models/{MODEL}").status_code == 200


def test_stop_strings_and_max_tokens(client, offline):
    prompt = PROMPTS[1]  # "1, 2, 3, 4," continues with numbers and commas
    full = offline.generate(prompt, greedy(16), use_tqdm=False)[0].outputs[0].text
    stop = full.strip()[1:3] if len(full.strip()) > 3 else full.strip()[:1]
    ref = offline.generate(prompt, greedy(16, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert ref.finish_reason == "stop"
    story = [{"role": "user", "content": "Tell me a story."}]
    out, chunks, short, chat = parallel(
        lambda: client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop]),
        lambda: list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=stop,
                                               stream=True)),
        lambda: client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                          extra_body={"ignore_eos": True}),
        lambda: client.chat.completions.create(model=MODEL, messages=story, max_completion_tokens=5, temperature=0))
    assert out.choices[0].text == ref.text and stop not in out.choices[0].text
    assert out.choices[0].finish_reason == "stop"
    assert "".join(ch.choices[0].text for ch in chunks) == ref.text
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"


def test_logprobs(client, offline):
    prompt = PROMPTS[0]
    tok = offline.get_tokenizer()

    def top(entry, k):  # the offline engine's k most likely tokens, as {token text: logprob}
        return {tok.decode([t]): lp for t, lp in sorted(entry.items(), key=lambda kv: -kv[1])[:k]}

    ref = offline.generate(prompt, greedy(6, logprobs=2), use_tqdm=False)[0].outputs[0]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ref.token_ids)
    for got, got_top, tid, entry in zip(lp.token_logprobs, lp.top_logprobs, ref.token_ids, ref.logprobs):
        assert got == pytest.approx(entry[tid], abs=1e-4)
        assert len(got_top) == 2
        assert got_top == pytest.approx(top(entry, 2), abs=1e-4)
    assert "".join(lp.tokens) == out.choices[0].text
    messages = [{"role": "user", "content": "Hi"}]
    ref = offline.chat(messages, greedy(4, logprobs=3), use_tqdm=False)[0].outputs[0]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == len(ref.token_ids)
    for t, tid, entry in zip(content, ref.token_ids, ref.logprobs):
        assert t.token == tok.decode([tid]) and t.logprob == pytest.approx(entry[tid], abs=1e-4)
        assert len(t.top_logprobs) == 3
        assert {x.token: x.logprob for x in t.top_logprobs} == pytest.approx(top(entry, 3), abs=1e-4)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob)  # greedy: the top token


def test_completion_top_logprobs_hold_the_sampled_token(client, offline):
    """OpenAI's legacy completions return the k most likely tokens and the sampled token's own: up to k + 1."""
    tok = offline.get_tokenizer()
    kw = dict(max_tokens=12, temperature=1.5, seed=3)
    ref = offline.generate(PROMPTS[2], SamplingParams(logprobs=1, **kw), use_tqdm=False)[0].outputs[0]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[2], logprobs=1, **kw)
    assert out.choices[0].text == ref.text
    off_top = 0
    for got, tid, entry in zip(out.choices[0].logprobs.top_logprobs, ref.token_ids, ref.logprobs):
        best = max(entry, key=entry.get)
        off_top += tid != best
        assert got == pytest.approx({tok.decode([best]): entry[best], tok.decode([tid]): entry[tid]}, abs=1e-4)
    assert off_top > 0  # the seed samples below the top token somewhere, so the rule is exercised
    out = client.completions.create(model=MODEL, prompt=PROMPTS[2], logprobs=0, **kw)
    assert [list(t) for t in out.choices[0].logprobs.top_logprobs] == [[tok.decode([t])] for t in ref.token_ids]


def _token_bytes(name: str) -> bytes:
    if name.startswith("bytes:"):  # OpenAI's naming of a token that holds part of a character
        return bytes(int(h, 16) for h in name[len("bytes:"):].split("\\x")[1:])
    return name.encode()


def test_completion_logprobs_of_partial_characters(server):
    """Emoji are several tokens each: a token holding part of a character is named by its bytes ("bytes:\\xf0..."),
    not U+FFFD, so the tokens' bytes join to the text, and text_offset counts the characters completed before each
    token (it ran past the end of the text), streamed and not alike."""
    body = {"model": MODEL, "prompt": "Emoji list: \U0001F600 \U0001F601 \U0001F602 \U0001F923 \U0001F603 \U0001F604",
            "max_tokens": 12, "temperature": 0, "logprobs": 1}
    choice = post(server, "/v1/completions", body).json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert any(t.startswith("bytes:") for t in lp["tokens"]) and "\ufffd" not in "".join(lp["tokens"])
    raw = [_token_bytes(t) for t in lp["tokens"]]
    assert b"".join(raw).decode() == text
    assert lp["text_offset"] == [len(b"".join(raw[:i]).decode("utf-8", errors="ignore")) for i in range(len(raw))]
    assert all(top for top in lp["top_logprobs"]) and lp["text_offset"][-1] <= len(text)
    chunks = stream_events(server, "/v1/completions", {**body, "stream": True})
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert [t for s in streamed for t in s["tokens"]] == lp["tokens"]
    assert [o for s in streamed for o in s["text_offset"]] == lp["text_offset"]


def test_null_means_the_default(server, client):
    """OpenAI's schema lets these fields be null; a client that sends null gets the default, where max_tokens null
    keeps its own meaning (as much as the context leaves)."""
    body = {"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 3, "temperature": 0, "n": None, "stream": None,
            "echo": None, "ignore_eos": None, "stream_options": None, "presence_penalty": None}
    resp = post(server, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    ref = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=3, temperature=0)
    assert [c["text"] for c in resp.json()["choices"]] == [ref.choices[0].text]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": None,
            "n": None, "stream": None}
    resp = post(server, "/v1/chat/completions", chat)
    assert resp.status_code == 200 and resp.json()["choices"][0]["logprobs"] is None, resp.text
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": None})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"


def test_an_unhandled_error_is_a_counted_500(server, monkeypatch):
    from eightbit.engine.server import api

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    key = 'eightbit_http_responses_total{endpoint="/v1/completions",status="500"}'
    before = metrics(server).get(key, 0)
    monkeypatch.setattr(api, "_check_limits", broken)
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2},
                headers={"origin": "http://localhost:3000"})
    assert resp.status_code == 500 and resp.json()["error"]["type"] == "server_error"  # OpenAI's type for a 5xx
    assert resp.headers["access-control-allow-origin"] == "http://localhost:3000"  # so that a browser shows it
    assert "a bug" not in resp.text  # the details are for the server's log, not the client
    assert metrics(server)[key] == before + 1


def test_an_engine_refusal_the_server_did_not_foresee_is_a_400(server, monkeypatch):
    # The server checks lengths before the engine sees a request; with that check gone, the engine's own ValueError
    # must still reach the client as the client's error (400, its message), not as a server failure, in both the
    # thread and the process engine, and the server must go on serving.
    from eightbit.engine.server import api

    monkeypatch.setattr(api, "_check_length", lambda *args, **kwargs: None)
    key = 'eightbit_http_responses_total{endpoint="/v1/completions",status="400"}'
    before = metrics(server).get(key, 0)
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": [1] * ENGINE_OPTIONS["max_model_len"],
                                            "max_tokens": 1})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and "leaves no room to generate" in error["message"], error
    assert metrics(server)[key] == before + 1
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2, resp.text


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", "{not json", 400, None),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 100000}, 400, "n"),  # not an out-of-memory kill
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 257}, 400, "n"),  # n over max_num_seqs (256)
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": 2 ** 63}, 400, "top_k"),  # not a failed step
    ("/v1/completions", {"model": MODEL, "prompt": "\ud800"}, 400, "prompt"),  # a lone surrogate
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),  # as OpenAI: only with stream
    ("/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"1": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {str(i): 1 for i in range(1025)}}, 400,
     "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [10 ** 6]}, 400, "stop_token_ids"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"\u00b2": 1}}, 400, "logit_bias"),  # "²"
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"7": 1, "07": 2}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [1] * 1025}, 400, "stop_token_ids"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": None,
                              "min_tokens": 5000}, 400, "min_tokens"),  # more than the context leaves
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 5000}, 400, "max_completion_tokens"),  # the field it came in
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 99}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [10 ** 9]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": True}, 400, "echo"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tool_choice": "auto",
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    # a client's own template could run for ever on a tokenizer worker
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"chat_template": "{% for i in range(9) %}x{% endfor %}"}},
     400, "chat_template_kwargs"),
    # every stop string is checked at every token on the loop all requests share
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": "y" * 1025}, 400, "stop"),
    # the field, not pydantic's name for the union member that failed ("prompt.str")
    ("/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": 5}, 400, "stop"),
    # integer fields are strict: "logprobs": false must not ask for log-probs, nor true for one
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": False}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": True}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 3.0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": True}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": [1.0, 2.0]}, 400, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    # vLLM's extras that would change the output are refused, not ignored (an answer that ignores them is wrong)
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "guided_choice": ["yes", "no"]}, 400, "guided_choice"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "structured_outputs": {"choice": ["yes", "no"]}}, 400, "structured_outputs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "guided_json": {"type": "object"}}, 400, "guided_json"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "allowed_token_ids": [28]}, 400, "allowed_token_ids"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "bad_words": ["x"]}, 400, "bad_words"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "prompt_logprobs": 1}, 400, "prompt_logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "use_beam_search": True}, 400, "use_beam_search"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "truncate_prompt_tokens": 5}, 400, "truncate_prompt_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "echo": True}, 400,
     "echo"),
    # continuing the final message: no generation prompt after it
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"},
                                                           {"role": "assistant", "content": "y"}],
                              "continue_final_message": True}, 400, "continue_final_message"),
    # the deprecated functions / function_call, as tools / tool_choice
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "functions": [{"name": "f"}]}, 400, "functions"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "functions": [{"name": "f"}], "function_call": {"name": "f"}}, 400, "functions"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "function_call": "auto"}, 400, "function_call"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x\ud800"}]}, 400,
     "messages.0.content"),  # a lone surrogate: said so, not the tokenizer's words
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages.0.content"),
])
def test_bad_input_openai_error(server, path, body, status, param):
    resp = post(server, path, body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["param"] == param


CHAT_X = {"messages": [{"role": "user", "content": "x"}]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of"),
    ("/v1/chat/completions", {**CHAT_X, "tools": [TOOL]}, "tools"),
    ("/v1/chat/completions", {**CHAT_X, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT_X, "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]}, "messages.0.content"),
    ("/v1/completions", {"prompt": "x", "guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a+"}, "guided_regex"),
    ("/v1/completions", {"prompt": "x", "guided_choice": ["a"]}, "guided_choice"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [1]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "bad_words": ["a"]}, "bad_words"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"prompt": "x", "length_penalty": 2.0}, "length_penalty"),
    ("/v1/completions", {"prompt": "x", "return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
    ("/v1/chat/completions", {**CHAT_X, "echo": True}, "echo"),
])
def test_what_the_server_does_not_do_is_refused_as_unsupported(server, path, body, param):
    """docs/server.md: each is answered 400 unsupported_parameter (an image part had no code)."""
    resp = post(server, path, {"model": MODEL, "max_tokens": 1, **body})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert (err["code"], err["param"]) == ("unsupported_parameter", param), err


@pytest.mark.parametrize("path,body,param,words", [
    # render_chat's own arguments: Python's "got multiple values for argument" named messages before
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"tokenizer": 1}},
     "chat_template_kwargs", "chat template's variables only"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"messages": []}},
     "chat_template_kwargs", "chat template's variables only"),
    # a text part without its text said "only text content parts are supported, got 'text'"
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages.0.content.0.text", "needs its 'text' field"),
    # the tokenizer's own words ("TextEncodeInput must be Union[...]") before
    ("/v1/completions", {"prompt": "Hi\ud800"}, "prompt", "lone surrogate"),
])
def test_bad_input_is_named_in_the_error(server, path, body, param, words):
    resp = post(server, path, {"model": MODEL, "max_tokens": 1, **body})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_an_empty_stream_options_without_stream_is_ignored(server):
    """As in vLLM, which refuses only a non-empty stream_options without stream: some clients always send {}."""
    for path, body in (("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        resp = post(server, path, {"model": MODEL, "max_tokens": 1, "stream_options": {}, **body})
        assert resp.status_code == 200 and "usage" in resp.json(), resp.text
        resp = post(server, path, {"model": MODEL, "max_tokens": 1, "stream_options": {"include_usage": False}, **body})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream_options", resp.text


@pytest.mark.parametrize("body,words", [
    ('{"prompt": "caf\xe9"}'.encode("latin-1"), "UnicodeDecodeError"),  # not UTF-8
    ("[" * 100_000 + "]" * 100_000, "RecursionError"),
    ('{"prompt": "x", "max_tokens": ' + "9" * 5000 + "}", "digits"),
])
def test_a_body_json_cannot_parse_says_why(server, body, words):
    """FastAPI answers these with "There was an error parsing the body" before our own JSON check sees them."""
    resp = post(server, "/v1/completions", body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["message"].startswith("malformed JSON body") and words in err["message"], err


def test_a_body_that_is_not_json_gets_told_so(server):
    """curl -d without -H 'Content-Type: application/json' sends a form: FastAPI then said "body: Input should be a
    valid dictionary or object to extract fields from"."""
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1})
    resp = httpx.post(server.url + "/v1/completions", content=body,
                      headers={"content-type": "application/x-www-form-urlencoded"})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == ("the body must be a JSON object, sent with Content-Type: "
                                               "application/json")
    resp = post(server, "/v1/completions", [1, 2])  # JSON, but not an object: pydantic's own words
    assert resp.status_code == 400 and "valid dictionary" in resp.json()["error"]["message"]


def test_prompt_longer_than_context(server, client):
    long_prompt = "hello " * 2100
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": long_prompt, "max_tokens": 4})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"
    resp = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": long_prompt}]})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 5000})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=4)
    # the server keeps serving
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2
    assert httpx.get(server.url + "/v1/nothing-here").json()["error"]["type"] == "not_found_error"


def test_a_prompt_too_long_to_fit_is_refused_before_it_is_tokenized(server, monkeypatch):
    """More characters per token of the context than any token of the vocabulary holds: refused without holding a
    tokenizer worker (a 12 MB prompt took 32 s to tokenize, and requests behind it waited)."""
    limit = server.app.state.server.max_chars_per_token * ENGINE_OPTIONS["max_model_len"]
    tokenizers = server.app.state.server.tokenizers
    encode = tokenizers.encode
    monkeypatch.setattr(tokenizers, "encode", lambda text: encode(text) if len(text) <= limit else pytest.fail(
        "a prompt that cannot fit was tokenized"))
    monkeypatch.setattr(tokenizers, "chat_prompt", lambda *a: pytest.fail("a prompt that cannot fit was tokenized"))
    huge = "hello world " * (limit // 12 + 1)
    hi = [{"role": "user", "content": "hi"}]
    for path, body in (("/v1/completions", {"model": MODEL, "prompt": huge}),
                       ("/v1/chat/completions", {"model": MODEL, "messages": [
                           {"role": "system", "content": huge[: len(huge) // 2]},
                           {"role": "user", "content": huge[len(huge) // 2:]}]}),
                       # every string the template renders counts, not only the contents (a 10 MB role was
                       # tokenized for 22 s)
                       ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user " + huge, "content": "hi"}]}),
                       ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi",
                                                                               "name": huge}]}),
                       ("/v1/chat/completions", {"model": MODEL, "messages": hi, "chat_template_kwargs": {"x": huge}})):
        resp = post(server, path, body)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded", resp.text
        assert "characters" in resp.json()["error"]["message"]
        assert resp.json()["error"]["param"] == ("prompt" if path == "/v1/completions" else "messages")
    # at the limit the prompt is tokenized as before (and refused for its token count)
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": "hello " * 2100})
    assert resp.status_code == 400 and "tokens" in resp.json()["error"]["message"]


def test_a_list_of_prompts_is_refused_before_or_while_it_is_tokenized(server, monkeypatch):
    """A request whose samples cannot run together is refused before any prompt is tokenized, and a list stops at
    its first prompt too long to fit."""
    tokenizers = server.app.state.server.tokenizers
    encode, encoded = tokenizers.encode, []
    monkeypatch.setattr(tokenizers, "encode", lambda text: encoded.append(text) or encode(text))
    too_many = server.app.state.server.max_num_seqs + 1
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": ["hello", "world"], "n": too_many})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "n", resp.text
    assert "max_num_seqs" in resp.json()["error"]["message"] and encoded == []
    long_prompt = "hello " * 2100  # > max_model_len tokens
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": ["hi", long_prompt, long_prompt, long_prompt]})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"
    assert encoded == ["hi", long_prompt]


def test_more_prompts_than_max_num_seqs_queue_and_are_all_served(server):
    """A list of more prompts than the engine runs at once: each prompt is its own engine request, and the ones past
    max_num_seqs wait their turn (as in vLLM); every choice comes back, in order. It was refused with a 400."""
    count = server.app.state.server.max_num_seqs + 3
    prompts = [f"{i} + 1 =" for i in range(count)]
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": prompts, "max_tokens": 1, "temperature": 0})
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert [c["index"] for c in choices] == list(range(count))
    assert all(c["finish_reason"] in ("length", "stop") for c in choices)
    one = post(server, "/v1/completions", {"model": MODEL, "prompt": prompts[-1], "max_tokens": 1, "temperature": 0})
    assert one.json()["choices"][0]["text"] == choices[-1]["text"]  # the last, queued prompt got its own answer


def test_a_prompt_of_long_tokens_that_fits_is_not_refused_for_its_characters(server, offline):
    """SmolLM2 has tokens of 80 characters (runs of '#', of spaces): 900 of them, 72,000 characters, are ~1,100
    tokens of a 2,048-token context, and were refused by a bound of 32 characters a token."""
    from eightbit.engine.server.api import MAX_CHARS_PER_TOKEN

    tokenizer = offline.get_tokenizer()
    longest = max(len(tokenizer.decode([t])) for t in range(len(tokenizer)))
    assert server.app.state.server.max_chars_per_token >= longest > MAX_CHARS_PER_TOKEN
    prompt = "#" * 80 * 900
    num_tokens = len(tokenizer(prompt)["input_ids"])
    assert len(prompt) > MAX_CHARS_PER_TOKEN * ENGINE_OPTIONS["max_model_len"] and num_tokens < 2000
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == num_tokens


def test_chat_template_variables_still_reach_the_template(client, offline, monkeypatch):
    """chat_template_kwargs keeps setting the template's own variables; only apply_chat_template's parameters are
    refused. (SmolLM2's template reads no variable, so the rendering is watched: the reply alone would be the same
    had the variable been dropped.)"""
    seen = watch_rendering(monkeypatch)
    messages = [{"role": "user", "content": "Hi"}]
    ref = offline.chat(messages, greedy(4), use_tqdm=False)[0].outputs[0].text
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                         extra_body={"chat_template_kwargs": {"some_template_variable": True}})
    assert out.choices[0].message.content == ref
    assert [r.kwargs for r in seen] == [{"some_template_variable": True}]


def test_tools_with_tool_choice_none_reach_the_template_and_are_never_called(client, offline, monkeypatch):
    """Agent frameworks send their tools with every request: with tool_choice "none" they are taken, passed to the
    chat template as HF's `tools` (SmolLM2's template does not read them, so the rendering is watched), and the answer
    is plain text; any other tool_choice is refused (tests above)."""
    seen = watch_rendering(monkeypatch)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Hi"}]
    ref = offline.chat(messages, greedy(4), use_tqdm=False)[0].outputs[0].text
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, tools=tools,
                                         tool_choice="none")
    assert out.choices[0].message.content == ref and not out.choices[0].message.tool_calls
    assert [r.kwargs for r in seen] == [{"tools": tools}]
    # the deprecated form: functions with function_call "none" reach the template as tools
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                         functions=[tools[0]["function"]], function_call="none")
    assert out.choices[0].message.content == ref and seen[-1].kwargs == {"tools": tools}


def test_earlier_tool_calls_reach_the_template_as_hf_templates_take_them(server, monkeypatch):
    """An agent's history: an assistant turn that called a tool (no content, arguments as a JSON string) and the
    tool's result. The template gets the call with its arguments as a dict (HF's form, as vLLM passes them) and the
    result's call id. As in vLLM, arguments that are empty or not a JSON object become {} (a bad call in the history
    must not lock the conversation out) and an empty list of calls is dropped; tool_calls that is not a list, or a
    call without a function, is a 400 naming the message."""
    seen = watch_rendering(monkeypatch)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    body = {"model": MODEL, "messages": history, "max_tokens": 2, "tool_choice": "none",
            "tools": [{"type": "function", "function": {"name": "get_weather"}}]}
    assert post(server, "/v1/chat/completions", body).status_code == 200
    assert seen[-1].messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert seen[-1].messages[2] == {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}
    for arguments in ("{city", "", None, "[1]", "[" * 100000, "1" * 5000, {"city": "Rome"}):
        function = {"name": "f"} if arguments is None else {"name": "f", "arguments": arguments}
        body["messages"] = [history[0], {**history[1], "tool_calls": [{**call, "function": function}]}, history[2]]
        assert post(server, "/v1/chat/completions", body).status_code == 200
        got = seen[-1].messages[1]["tool_calls"][0]["function"]["arguments"]
        assert got == (arguments if isinstance(arguments, dict) else {}), (repr(arguments)[:20], got)
    body["messages"] = [history[0], {"role": "assistant", "content": "Sunny.", "tool_calls": []}]
    assert post(server, "/v1/chat/completions", body).status_code == 200
    assert seen[-1].messages[1] == {"role": "assistant", "content": "Sunny."}
    for bad in ("not a call", {"id": "call_2", "type": "function"}):
        body["messages"] = [history[0], {**history[1], "tool_calls": [bad]}, history[2]]
        resp = post(server, "/v1/chat/completions", body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages.1", resp.text
    for bad in (5, True, "call", {"function": {"name": "f"}}):
        body["messages"] = [history[0], {**history[1], "tool_calls": bad}, history[2]]
        resp = post(server, "/v1/chat/completions", body)
        assert resp.status_code == 400 and "must be a list" in resp.json()["error"]["message"], resp.text


# a chat template that shows the tools it gets, and an earlier turn's calls and a tool result's call id
TOOLS_TEMPLATE = ("{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
                  "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                  "{% if m.tool_calls %} calls {{ m.tool_calls | tojson }}{% endif %}"
                  "{% if m.tool_call_id %} answers {{ m.tool_call_id }}{% endif %}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOL_HISTORY = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]


def check_the_template_sees(srv, tok, monkeypatch, tools_shown: bool):
    """Chat requests with tools (tool_choice "none", and the deprecated functions with function_call "none") and a
    tool-calling history, the server's tokenizer rendering them with TOOLS_TEMPLATE: its rendering (watched) is HF's
    apply_chat_template on the same template, with the tools if tools_shown, else without them, the history's calls
    and results shown either way; usage counts that reference's tokens."""
    seen = watch_rendering(monkeypatch, TOOLS_TEMPLATE)
    # the history as the template takes it: content "" for None, the call's arguments as a dict
    history = [TOOL_HISTORY[0], {"role": "assistant", "content": "", "tool_calls": [
        {**TOOL_CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}, TOOL_HISTORY[2]]

    def reference(**kwargs):
        return tok.apply_chat_template(history, chat_template=TOOLS_TEMPLATE, add_generation_prompt=True,
                                       tokenize=False, **kwargs)

    with_tools, without_tools = reference(tools=TOOLS), reference()
    assert with_tools != without_tools and "get_weather" in with_tools.split("<|im_start|>")[0]
    assert "calls [" in without_tools and "answers call_1" in without_tools
    want = with_tools if tools_shown else without_tools
    for form in ({"tools": TOOLS, "tool_choice": "none"},
                 {"functions": [TOOLS[0]["function"]], "function_call": "none"}):
        resp = post(srv, "/v1/chat/completions", {"model": MODEL, "messages": TOOL_HISTORY, "max_tokens": 1, **form})
        assert resp.status_code == 200, resp.text
        assert seen[-1].text == want, form
        assert resp.json()["usage"]["prompt_tokens"] == len(tok(want, add_special_tokens=False).input_ids)


def test_a_tools_aware_template_shows_the_tools(server, offline, monkeypatch):
    """By default (vLLM's too) the tools sent with tool_choice "none" reach the template, which may show them."""
    check_the_template_sees(server, offline.get_tokenizer(), monkeypatch, tools_shown=True)


def test_exclude_tools_when_tool_choice_none_keeps_the_tools_from_the_template(offline, monkeypatch):
    """`eightbit serve --exclude-tools-when-tool-choice-none` (vLLM's flag): with tool_choice "none" (here the only
    one taken; also function_call "none") the template gets no tools, so a template that knows tools does not show
    them; the history's calls and results still reach it, as in vLLM (which drops only the tool definitions). The
    flag changes what the template gets, not which requests are taken."""
    from eightbit import EngineConfig, LLMEngine

    srv = BackgroundServer(LLMEngine(EngineConfig(model=None, **ENGINE_OPTIONS)),
                           exclude_tools_when_tool_choice_none=True).start()
    try:  # stopped here: a server left running would show its threads to the tests after this one
        check_the_template_sees(srv, offline.get_tokenizer(), monkeypatch, tools_shown=False)
        body = {"model": MODEL, "messages": TOOL_HISTORY, "max_tokens": 1, "tools": TOOLS, "tool_choice": "auto"}
        resp = post(srv, "/v1/chat/completions", body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "tools", resp.text
    finally:
        srv.stop()


def test_vllm_extras_at_their_neutral_values_are_taken(server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1, "use_beam_search": False, "bad_words": [],
            "length_penalty": 1.0, "prompt_logprobs": None, "guided_json": None, "return_tokens_as_token_ids": False}
    assert post(server, "/v1/completions", body).status_code == 200


def test_continue_final_message_continues_the_assistant_s_last_words(client, offline):
    """vLLM's continue_final_message: the template renders the last message (the assistant's first words, or any)
    open, without its end of turn, and the reply continues it. Reference: HF's apply_chat_template with the same
    option, generated from offline."""
    tok = offline.get_tokenizer()
    for last in ({"role": "assistant", "content": "The colour is"}, {"role": "user", "content": "1, 2, 3, 4,"}):
        messages = [{"role": "user", "content": "Name a colour."}, last][-2 if last["role"] == "assistant" else -1:]
        text = tok.apply_chat_template(messages, continue_final_message=True, add_generation_prompt=False,
                                       tokenize=False)
        assert text.endswith(last["content"])
        ids = tok(text, add_special_tokens=False).input_ids
        ref = offline.generate([ids], greedy(6), use_tqdm=False)[0].outputs[0].text
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                             extra_body={"continue_final_message": True,
                                                         "add_generation_prompt": False})
        assert out.choices[0].message.content == ref and ref.strip()


def test_text_parts_are_joined_by_newlines(server, monkeypatch):
    """As vLLM joins them, so that parts do not run into each other; the Responses API's input_text and an earlier
    turn's refusal are text too."""
    seen = watch_rendering(monkeypatch)
    messages = [{"role": "user", "content": [{"type": "text", "text": "First."}, {"type": "input_text",
                                                                                 "text": "Second."}]},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
                {"role": "user", "content": [{"type": "text", "text": "Why?"}]}]
    assert post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages,
                                                 "max_tokens": 1}).status_code == 200
    assert [m["content"] for m in seen[-1].messages] == ["First.\nSecond.", "I cannot.", "Why?"]


def test_the_overload_metric_counts_queue_rejections_only():
    from eightbit.engine.server.metrics import Metrics

    m = Metrics("m")
    m.count_response("/health", 503)  # a dead engine's health check is not an overload
    assert m.rejected_overload == 0
    m.count_overload()
    assert m.rejected_overload == 1


# --- disconnects and overload -------------------------------------------------------------------


def test_stream_disconnect_aborts_and_frees_blocks(server):
    assert wait_idle(server)["eightbit_kv_cache_blocks_used"] == 0
    body = {"model": MODEL, "prompt": "Write a very long essay about the sea.", "max_tokens": 1500,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        running = metrics(server)
        assert running["eightbit_num_requests_running"] == 1 and running["eightbit_kv_cache_blocks_used"] > 0
    # the connection is closed mid-stream: the request is aborted and its blocks go back to the pool
    idle = wait_idle(server)
    assert idle["eightbit_num_requests_running"] == 0 and idle["eightbit_kv_cache_blocks_used"] == 0
    assert server.app.state.server.num_queued == 0  # a leak here makes --max-queue refuse everything in time
    assert not in_process(server) or not server.async_engine.engine.requests
    generated = idle["eightbit_generation_tokens_total"]
    time.sleep(0.3)
    assert metrics(server)["eightbit_generation_tokens_total"] == generated  # nothing runs on in the dark


def test_non_stream_disconnect_aborts(server):
    wait_idle(server)
    body = {"model": MODEL, "prompt": "Write a very long essay about mountains.", "max_tokens": 1500,
            "ignore_eos": True}
    closed = 'eightbit_http_responses_total{endpoint="/v1/completions",status="499"}'
    before = metrics(server).get(closed, 0)
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", body, timeout=httpx.Timeout(60, read=1.0))
    # the client may give up before its request reaches the engine (a slow machine): wait for the handler to see
    # the disconnect (it aborts its request, then answers 499) before asking whether the engine is idle
    assert wait_for_change(server, closed, before).get(closed, 0) == before + 1
    idle = wait_idle(server)
    assert idle["eightbit_num_requests_running"] == 0 and idle["eightbit_kv_cache_blocks_used"] == 0
    assert server.app.state.server.num_queued == 0
    assert not in_process(server) or not server.async_engine.engine.requests


def test_a_client_gone_while_its_body_is_read_counts_as_499_not_400(server):
    """Half a body sent, then the socket closed: FastAPI reports the disconnect as a body it could not parse."""
    counter = 'eightbit_http_responses_total{endpoint="/v1/completions",status="%d"}'
    before = metrics(server)
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 4}).encode()
    with socket.create_connection((server.host, server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body[: len(body) // 2])
    after = wait_for_change(server, counter % 499, before.get(counter % 499, 0))
    assert after.get(counter % 499, 0) == before.get(counter % 499, 0) + 1
    assert after.get(counter % 400, 0) == before.get(counter % 400, 0)


def test_overload_503_with_retry_after_then_served(server, offline):
    state = server.app.state.server
    ref = offline.generate(PROMPTS, greedy(4), use_tqdm=False)
    state.max_queue, state.num_queued = 1, state.num_queued + 1  # one prompt waits already: the queue is full
    try:
        rejected = metrics(server)["eightbit_requests_rejected_overload_total"]
        resp = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
        state.num_queued -= 1
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["type"] == "server_overloaded"
        assert metrics(server)["eightbit_requests_rejected_overload_total"] == rejected + 1
        state.max_queue = 2
        # more prompts than the queue can ever hold: a 400 (a retry cannot help), even on an idle server
        resp = post(server, "/v1/completions", {"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 2})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt", resp.text
        assert "--max-queue" in resp.json()["error"]["message"]
        assert metrics(server)["eightbit_requests_rejected_overload_total"] == rejected + 1

        async def one(http, i):
            body = {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 4, "temperature": 0}
            statuses = []
            while True:  # a client honouring Retry-After (shortened) gets served eventually
                r = await http.post("/v1/completions", json=body)
                statuses.append(r.status_code)
                if r.status_code != 503:
                    return statuses, r
                await asyncio.sleep(0.05)

        async def burst():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
                return await asyncio.gather(*(one(http, i) for i in range(16)))

        results = asyncio.run(burst())
    finally:
        state.max_queue = None
    assert sum(s.count(503) for s, _ in results) >= 1
    for i, (statuses, r) in enumerate(results):
        assert set(statuses) <= {200, 503} and r.status_code == 200
        assert r.json()["choices"][0]["text"] == ref[i % len(PROMPTS)].outputs[0].text
    assert wait_idle(server)["eightbit_kv_cache_blocks_used"] == 0


# --- load -----------------------------------------------------------------------------------------

LOAD_REQUESTS = 300
LOAD_CONCURRENCY = 32
LOAD_MAX_TOKENS = 8
SUBJECTS = ["cats", "the moon", "Paris", "rivers", "music", "bread", "trains", "winter", "robots", "gardens",
            "the ocean", "chess", "coffee", "volcanoes", "birds"]
TEMPLATES = ["Tell me about {}.", "A short fact about {}:", "{} are", "My opinion of {} is"]


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def test_load_300_requests_concurrency_32(server, offline):
    """Streams LOAD_REQUESTS greedy completions, LOAD_CONCURRENCY at a time: none lost, all equal offline."""
    prompts = [t.format(s) for t in TEMPLATES for s in SUBJECTS]  # 60 distinct prompts
    ref = {p: r.outputs[0].text for p, r in
           zip(prompts, offline.generate(prompts, greedy(LOAD_MAX_TOKENS), use_tqdm=False))}
    before = metrics(server)
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    sem = asyncio.Semaphore(LOAD_CONCURRENCY)

    async def one(i):
        prompt = prompts[i % len(prompts)]
        async with sem:
            t0 = time.perf_counter()
            first = last = None
            text, usage = [], None
            stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=LOAD_MAX_TOKENS,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True})
            async for ch in stream:
                if ch.choices:  # a chunk comes with new text or with the finish reason
                    last = time.perf_counter()
                    first = first or last
                    text.append(ch.choices[0].text)
                if ch.usage is not None:
                    usage = ch.usage
            return prompt, "".join(text), usage, t0, first, last

    async def run_all():
        t = time.perf_counter()
        out = await asyncio.gather(*(one(i) for i in range(LOAD_REQUESTS)), return_exceptions=True)
        await aclient.close()
        return out, time.perf_counter() - t

    results, wall = asyncio.run(run_all())
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, failures[:3]
    assert len(results) == LOAD_REQUESTS
    mismatches = [(p, got, ref[p]) for p, got, *_ in results if got != ref[p]]
    assert not mismatches, mismatches[:3]
    ttft = [first - t0 for _, _, _, t0, first, _ in results]
    tpot = [(last - first) / (u.completion_tokens - 1) for _, _, u, _, first, last in results
            if u.completion_tokens > 1]
    tokens = sum(u.completion_tokens for _, _, u, *_ in results)
    after = wait_idle(server)
    assert after["eightbit_kv_cache_blocks_used"] == 0
    assert after["eightbit_time_to_first_token_seconds_count"] - before["eightbit_time_to_first_token_seconds_count"] \
        == LOAD_REQUESTS
    assert after["eightbit_generation_tokens_total"] - before["eightbit_generation_tokens_total"] == tokens
    print(f"\nload: {LOAD_REQUESTS} requests at concurrency {LOAD_CONCURRENCY}, max_tokens {LOAD_MAX_TOKENS}: "
          f"{wall:.1f} s, {LOAD_REQUESTS / wall:.1f} req/s, {tokens / wall:.1f} output tok/s; "
          f"TTFT p50 {statistics.median(ttft) * 1e3:.0f} ms p99 {percentile(ttft, 99) * 1e3:.0f} ms; "
          f"TPOT p50 {statistics.median(tpot) * 1e3:.0f} ms p99 {percentile(tpot, 99) * 1e3:.0f} ms; "
          f"loop time outside the model {after['eightbit_engine_loop_outside_model_ratio']:.1%} "
          f"(sampling incl. detokenize {after['eightbit_engine_sampling_seconds_total']:.2f} s, detokenize "
          f"{after['eightbit_engine_detokenize_seconds_total']:.2f} s of "
          f"{after['eightbit_engine_loop_busy_seconds_total']:.2f} s busy; "
          f"{after['eightbit_engine_detokenize_seconds_total'] / after['eightbit_generation_tokens_total'] * 1e6:.0f}"
          f" us of postprocessing per generated token)")


def test_engine_loop_thread_does_the_engine_work(server):
    """Handlers never touch the engine: only the loop thread, or the reader of the engine process's pipe (and
    tokenizer workers) exist besides uvicorn."""
    names = {t.name for t in threading.enumerate()}
    if in_process(server):
        assert "eightbit-engine-loop" in names
    else:
        assert "eightbit-engine-loop" not in names and "eightbit-engine-reader" in names
        assert server.async_engine._proc.is_alive() and server.async_engine.alive
    assert any(n.startswith("eightbit-tokenizer") for n in names)


@pytest.mark.parametrize("port, message", [(99999, "must be in"), (None, "cannot listen")])
def test_serve_rejects_a_port_it_cannot_listen_on_before_loading(port, message, capsys, monkeypatch):
    import eightbit.engine.llm_engine as llm_engine
    from eightbit.cli import main as cli_main

    monkeypatch.setattr(llm_engine, "load_model", lambda *a, **k: pytest.fail("the model must not load"))
    with socket.socket() as taken:  # a port in use (listening) when port is None
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = port or taken.getsockname()[1]
        assert cli_main(["serve", "--device", "cpu", "--port", str(port)]) == 2
    assert message in capsys.readouterr().err


def test_a_tiny_temperature_samples_greedily(server, offline):
    """Below 1e-5 (as vLLM): dividing the logits by 1e-40 would overflow float32 and pick token 0."""
    prompt = "The capital of France is"
    want = offline.generate([prompt], greedy(6), use_tqdm=False)[0].outputs[0].text
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 1e-40})
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == want


def test_the_chat_template_s_bos_is_not_doubled(tokenizer):
    """A template that writes bos_token, with a tokenizer that adds BOS to text (Llama 3, Mistral): one BOS."""
    from eightbit.engine.server.api import TokenizerPool
    from eightbit.quant.testing import bos_chat_tokenizer

    tok = bos_chat_tokenizer(tokenizer)
    assert tok("hi").input_ids[0] == 1  # the kind of tokenizer this is about
    messages = [{"role": "user", "content": "hi there"}]
    pool = TokenizerPool(tok, 1)
    try:
        ids = pool.chat_prompt(messages, True, None)
    finally:
        pool.shutdown()
    assert ids == [1] + tok("hi there", add_special_tokens=False).input_ids


def test_pending_aborts_are_not_counted_as_waiting_requests():
    from eightbit.engine.server.async_engine import AsyncEngine

    engine = tiny_engine()
    loop = AsyncEngine(engine)  # not started: commands stay queued
    for i in range(5):
        loop.abort(f"gone-{i}")
    assert loop.stats["waiting_requests"] == 0
    loop.submit("new", [1, 2, 3], SamplingParams(max_tokens=2), sink=None)
    assert loop.stats["waiting_requests"] == 1


def test_a_stopped_loop_lets_its_engine_go_and_may_be_stopped_again():
    """FastAPI keeps the endpoints it served (and so the loop) for the life of the process: the loop's stop() must
    drop the engine and undo its timers, or the engine's memory is never freed."""
    import gc
    import weakref

    from eightbit.engine.server.async_engine import AsyncEngine

    engine = tiny_engine()
    loop = AsyncEngine(engine).start()
    assert "_launch" in vars(engine)  # timed
    loop.stop()
    loop.stop()  # twice: nothing left to release
    assert loop.engine is None and "_launch" not in vars(engine)
    gone = weakref.ref(engine)
    del engine
    gc.collect()
    assert gone() is None and loop.stats["steps"] == 0


def test_a_step_wakes_each_event_loop_once():
    """Each call_soon_threadsafe wakes the event loop's thread, which then competes with the engine loop for the
    interpreter lock: a step's outputs go to each loop in one call, whatever the number of requests."""
    from eightbit.engine.outputs import RequestOutput
    from eightbit.engine.server.async_engine import AsyncEngine, Sink

    class Loop:
        def __init__(self, closed=False):
            self.calls, self.closed = [], closed

        def call_soon_threadsafe(self, fn, *args):
            if self.closed:
                raise RuntimeError("Event loop is closed")
            self.calls.append((fn, args))

        def is_closed(self):
            return False  # found out only when delivering to it, as when it closes during the step

    class Queue(list):
        put_nowait = list.append

    engine = tiny_engine()
    looper = AsyncEngine(engine)  # not started: _deliver is called by hand
    a, b, gone = Loop(), Loop(), Loop(closed=True)
    sinks = {"r0": Sink(a, Queue()), "r1": Sink(a, Queue()), "r2": Sink(a, Queue()), "r3": Sink(b, Queue()),
             "r4": Sink(gone, Queue())}
    looper._sinks.update(sinks)
    for rid in sinks:
        engine.add_request(rid, [1, 2, 3], SamplingParams(max_tokens=4))

    def out(rid, finished=False):
        return RequestOutput(rid, None, [1, 2, 3], None, [], finished)

    looper._deliver([out("r0"), out("r1", finished=True), out("r2"), out("r3"), out("r4")])
    assert len(a.calls) == 1 and len(b.calls) == 1
    for fn, args in a.calls + b.calls:  # what the event loop would run
        fn(*args)
    assert [[(rid, o.finished) for rid, o in sinks[r].queue] for r in ("r0", "r1", "r2", "r3")] == \
        [[("r0", False)], [("r1", True)], [("r2", False)], [("r3", False)]]
    assert set(looper._sinks) == {"r0", "r2", "r3"}  # r1 finished; r4's loop is closed: nobody listens
    assert "r4" not in engine.requests and "r0" in engine.requests  # r4 aborted, its KV blocks freed


def test_a_non_streamed_request_is_delivered_at_its_first_token_and_its_end():
    """A streamed request hears of every step; a non-streamed one only of its first token (the queue count and the
    TTFT metric need it) and its final output: the other deliveries would only wake the event loop."""
    from eightbit.engine.server.async_engine import AsyncEngine, Sink

    class Loop:
        closed = False

        def call_soon_threadsafe(self, fn, *args):
            fn(*args)

        def is_closed(self):
            return self.closed

    class Queue(list):
        put_nowait = list.append

    engine = tiny_engine()
    looper = AsyncEngine(engine)  # not started: commands and steps driven by hand
    streamed, answered = Sink(Loop(), Queue()), Sink(Loop(), Queue())
    params = SamplingParams(max_tokens=7, ignore_eos=True, temperature=0)
    looper.submit("s", [5, 6, 7], params, streamed, every_step=True)
    looper.submit("a", [5, 6, 7], params, answered, every_step=False)
    looper._drain()
    while engine.has_unfinished_requests():
        looper._deliver(engine.step())
    # a stream's outputs hold each step's new token only (O(1) a step); a non-streamed answer's are cumulative
    assert [len(o.outputs[0].token_ids) for _, o in streamed.queue] == [1] * 7
    assert [(len(o.outputs[0].token_ids), o.finished) for _, o in answered.queue] == [(1, False), (7, True)]
    assert answered.queue[-1][1].outputs[0].token_ids == [t for _, o in streamed.queue for t in o.outputs[0].token_ids]
    assert looper._sinks == {}

    # a handler's event loop closed after the first token: the request is aborted at the next step, though
    # nothing is delivered to that loop until the end
    gone = Sink(Loop(), Queue())
    looper.submit("g", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True), gone, every_step=False)
    looper._drain()
    while not gone.queue:
        looper._deliver(engine.step())
    gone.loop.closed = True
    looper._deliver(engine.step())
    assert "g" not in engine.requests and looper._sinks == {}


def test_streamed_logprob_offsets_equal_the_unstreamed_ones(client):
    """Chinese text: byte tokens whose characters are released a few tokens late (the stream holds partial ones)."""
    args = dict(model=MODEL, prompt="Translate to Chinese: good morning, my friend.\nChinese:", max_tokens=12,
                temperature=0, logprobs=1)
    whole = client.completions.create(**args).choices[0].logprobs
    chunks = [ch.choices[0].logprobs for ch in client.completions.create(stream=True, **args) if ch.choices]
    streamed = [o for lp in chunks if lp for o in lp.text_offset]
    assert streamed == whole.text_offset
    assert [t for lp in chunks if lp for t in lp.tokens] == whole.tokens
    assert whole.text_offset == sorted(whole.text_offset)


def test_chat_logprob_bytes_rebuild_characters_split_over_tokens(client, offline):
    """Chinese output: one character is two or three byte tokens, each of whose text is U+FFFD; their `bytes`
    joined must give back the reply (OpenAI's reason for the field)."""
    tok = offline.get_tokenizer()
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Reply in Chinese: 你好"}],
                                         max_tokens=12, temperature=0, logprobs=True, top_logprobs=1)
    content = out.choices[0].logprobs.content
    assert any(t.token == "\ufffd" for t in content)  # the case this is about
    special = {tok.decode([t]) for t in tok.all_special_ids}
    joined = bytes(b for t in content if t.token not in special for b in t.bytes)
    assert joined.decode("utf-8") == out.choices[0].message.content
    for t in content:  # the top alternatives carry their own bytes the same way
        assert t.top_logprobs[0].bytes == t.bytes  # greedy: the top token is the chosen one


def test_a_stream_event_is_one_line_for_readers_that_split_on_unicode_line_breaks():
    """SSE ends lines at CR and LF only, but httpx's iter_lines (and requests' with decode_unicode) split at every
    line boundary str.splitlines() knows: U+2028, U+2029 and U+0085 raw in an event's JSON would cut it in two."""
    from eightbit.engine.server import api
    from eightbit.engine.server import protocol as P

    text = "a\u2028b\u2029c\x85d\u00e9\U0001f600"
    chunk = P.ChatCompletionChunk(id="c", created=0, model="m", choices=[
        P.ChatChunkChoice(index=0, delta=P.DeltaMessage(content=text))])
    lines = [line for line in httpx.Response(200, content=api._sse(chunk).encode()).iter_lines() if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    event = json.loads(lines[0][6:])
    assert event["choices"][0]["delta"] == {"content": text}  # the same text; no role: null


# --- limits and fields a mutation run found untested (review_s60_server_mutations) ---------------


def test_logprobs_of_20_are_the_inclusive_limit(server):
    """OpenAI's reference: top_logprobs is an integer between 0 and 20 (and vLLM's default max_logprobs is 20)."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    resp = post(server, "/v1/completions", {**body, "logprobs": 20})
    assert resp.status_code == 200, resp.text
    tops = resp.json()["choices"][0]["logprobs"]["top_logprobs"]
    assert len(tops) == 2 and all(len(t) >= 20 for t in tops)  # the sampled token may be a 21st
    resp = post(server, "/v1/completions", {**body, "logprobs": 21})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "logprobs"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 2, "temperature": 0,
            "logprobs": True}
    resp = post(server, "/v1/chat/completions", {**chat, "top_logprobs": 20})
    assert resp.status_code == 200, resp.text
    content = resp.json()["choices"][0]["logprobs"]["content"]
    assert content and all(len(t["top_logprobs"]) == 20 for t in content)
    resp = post(server, "/v1/chat/completions", {**chat, "top_logprobs": 21})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "top_logprobs"
    # top_logprobs defaults to 0: each token's list is empty (OpenAI, vLLM)
    content = post(server, "/v1/chat/completions", chat).json()["choices"][0]["logprobs"]["content"]
    assert content and all(t["top_logprobs"] == [] for t in content)


def test_suffix_is_refused_not_ignored(server):
    """A field that would change the output but is not implemented is a 400, so a client relying on it learns so."""
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": "def f(", "max_tokens": 2, "suffix": "):"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "suffix", resp.text


def test_prompts_that_fill_the_context_exactly(server):
    """As vLLM: a prompt of max_model_len tokens leaves no position to generate into (400,
    context_length_exceeded); prompt + max_tokens equal to max_model_len fits."""
    n = ENGINE_OPTIONS["max_model_len"]
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": [28] * n, "max_tokens": None})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded", resp.text
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": [28] * (n - 2), "max_tokens": 2,
                                            "temperature": 0, "ignore_eos": True})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2, resp.text


def test_choice_indices_of_a_prompt_list_with_n(server):
    """OpenAI and vLLM: choice index = prompt index * n + sample index."""
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": ["Hello", "The sky is"], "n": 2,
                                            "max_tokens": 1, "temperature": 0})
    assert resp.status_code == 200, resp.text
    assert sorted(c["index"] for c in resp.json()["choices"]) == [0, 1, 2, 3]


# --- what a mutation run found untested (review_s61_server_mutations) ---------------------------------------

CAPITAL_PROMPT = "The capital of France is"
COLOUR = [{"role": "user", "content": "Name a colour and say why you like it."}]


def test_a_stop_token_id_is_the_stop_reason(server, offline):
    # vLLM: stop_reason is the stop string or the stop token id that ended the choice (int), None for EOS/length
    free = offline.generate([CAPITAL_PROMPT], greedy(16), use_tqdm=False)[0].outputs[0]
    tid = free.token_ids[3]
    ref = offline.generate([CAPITAL_PROMPT], greedy(16, stop_token_ids=[tid]), use_tqdm=False)[0].outputs[0]
    assert ref.finish_reason == "stop" and ref.stop_reason == tid  # the reference itself
    body = {"model": MODEL, "prompt": CAPITAL_PROMPT, "max_tokens": 16, "temperature": 0, "stop_token_ids": [tid]}
    choice = post(server, "/v1/completions", body).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (ref.text, "stop", tid)
    last = [c for e in stream_events(server, "/v1/completions", {**body, "stream": True}) for c in e["choices"]
            if c["finish_reason"]]
    assert len(last) == 1 and last[0]["stop_reason"] == tid


def test_a_chat_stream_with_n_opens_and_counts_every_choice(server):
    # OpenAI: each choice's first delta carries role "assistant"; usage counts every choice's tokens
    # a seed whose choice 0 ends first: the choices run in lockstep, so a count that reads choice 0's tokens for
    # every choice is wrong only when choice 0 stops before the others
    for seed in range(1, 17):
        body = {"model": MODEL, "messages": COLOUR, "max_tokens": 24, "n": 2, "temperature": 1.0, "seed": seed,
                "logprobs": True, "stop": [".", "!", ","]}
        whole = post(server, "/v1/chat/completions", body).json()
        lengths = [len(c["logprobs"]["content"]) for c in sorted(whole["choices"], key=lambda c: c["index"])]
        if lengths[0] < lengths[1]:
            break
    assert lengths[0] < lengths[1], lengths
    events = stream_events(server, "/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    opened = {}
    for e in events:
        for c in e["choices"]:
            opened.setdefault(c["index"], c["delta"].get("role"))
    assert opened == {0: "assistant", 1: "assistant"}
    assert events[-1]["usage"]["completion_tokens"] == sum(lengths) == whole["usage"]["completion_tokens"]


def test_the_queue_bound_counts_every_prompt_of_a_list(server):
    state = server.app.state.server
    state.max_queue, state.num_queued = 2, state.num_queued + 1  # one prompt waits: room for one more
    try:
        two = post(server, "/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2})
        one = post(server, "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2})
    finally:
        state.num_queued -= 1
        state.max_queue = None
    assert two.status_code == 503 and two.headers["retry-after"] == "1", two.text
    assert one.status_code == 200, one.text


def test_a_running_request_leaves_the_queue_at_its_first_token(server):
    # num_queued counts requests that have not produced a token yet: a long generation must not hold a queue slot
    state = server.app.state.server
    body = {"model": MODEL, "prompt": "Write a long essay about the sea.", "max_tokens": 300, "ignore_eos": True,
            "stream": True}
    state.max_queue = 1
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            assert any(next(lines).startswith("data: {") for _ in range(4))  # it runs
            assert state.num_queued == 0
            other = post(server, "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2})
            assert other.status_code == 200, other.text
    finally:
        state.max_queue = None


def test_histogram_buckets_are_inclusive_and_cumulative():
    # Prometheus: bucket le="x" counts observations <= x, and buckets are cumulative
    from eightbit.engine.server.metrics import Histogram

    h = Histogram((0.1, 0.5))
    for v in (0.1, 0.3, 0.5, 0.7):
        h.observe(v)
    assert h.lines("t") == ['t_bucket{le="0.1"} 1', 't_bucket{le="0.5"} 3', 't_bucket{le="+Inf"} 4',
                            "t_sum 1.6", "t_count 4"]


def _late_stop_token(token_ids, after=17):
    """A token first emitted at position >= after, so that a stop there ends the output past 16 tokens."""
    for i, t in enumerate(token_ids):
        if i >= after and t not in token_ids[:i]:
            return i, t
    raise AssertionError("no fresh token late in the output")


def test_max_tokens_null_means_no_limit_and_chat_has_no_default_limit(server, offline):
    # protocol.py: null max_tokens keeps its meaning (as much as the context leaves), and chat's default is none
    # (OpenAI); the completions default of 16 must not leak into either
    free = offline.generate([CAPITAL_PROMPT], greedy(40), use_tqdm=False)[0].outputs[0]
    i, tid = _late_stop_token(free.token_ids)
    body = {"model": MODEL, "prompt": CAPITAL_PROMPT, "max_tokens": None, "temperature": 0, "stop_token_ids": [tid]}
    choice = post(server, "/v1/completions", body).json()["choices"][0]
    ref = offline.generate([CAPITAL_PROMPT], greedy(None, stop_token_ids=[tid]), use_tqdm=False)[0].outputs[0]
    assert len(ref.token_ids) == i + 1 and ref.finish_reason == "stop"
    assert (choice["text"], choice["finish_reason"]) == (ref.text, "stop")
    messages = [{"role": "user", "content": "Tell me a story about a dragon."}]
    free = offline.chat(messages, greedy(40), use_tqdm=False)[0].outputs[0]
    i, tid = _late_stop_token(free.token_ids)
    ref = offline.chat(messages, greedy(None, stop_token_ids=[tid]), use_tqdm=False)[0].outputs[0]
    resp = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "temperature": 0,
                                                 "stop_token_ids": [tid]}).json()
    assert resp["usage"]["completion_tokens"] == len(ref.token_ids) == i + 1
    assert resp["choices"][0]["message"]["content"] == ref.text and resp["choices"][0]["finish_reason"] == "stop"


def test_an_empty_stream_options_asks_for_no_usage(server):
    # include_usage defaults to false: `stream_options: {}` (sent by some clients always) adds no usage chunk
    for path, body in (("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        events = stream_events(server, path, {"model": MODEL, "max_tokens": 2, "stream": True, "stream_options": {}, **body})
        assert events and all("usage" not in e for e in events) and all(e["choices"] for e in events), path


def test_a_chat_stream_s_last_chunk_has_an_empty_delta(server, offline):
    # OpenAI's streaming example: the chunk with finish_reason "stop" (EOS, whose text is not shown) has delta {}
    messages = [{"role": "user", "content": "Say hi."}]
    ref = offline.chat(messages, greedy(64), use_tqdm=False)[0].outputs[0]
    assert ref.finish_reason == "stop"  # ended by EOS: the last step adds no text
    events = stream_events(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 64,
                                                       "temperature": 0, "stream": True})
    assert "".join(c["delta"].get("content", "") for e in events for c in e["choices"]) == ref.text
    last = [c for e in events for c in e["choices"] if c["finish_reason"]]
    assert len(last) == 1 and last[0]["finish_reason"] == "stop" and last[0]["delta"] == {}, last


def test_n_equal_to_max_num_seqs_is_taken(server):
    # the samples of a prompt run together: n up to max_num_seqs fits, one more does not
    limit = server.app.state.server.max_num_seqs
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "n": limit, "max_tokens": 1})
    assert resp.status_code == 200, resp.text
    assert sorted(c["index"] for c in resp.json()["choices"]) == list(range(limit))
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "n": limit + 1, "max_tokens": 1})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "n"


def test_min_tokens_that_fill_the_context_exactly_fit(server):
    # prompt + min_tokens == max_model_len leaves room for exactly min_tokens (max_tokens null: up to the context)
    n = server.app.state.server.max_model_len
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": [28] * (n - 2), "max_tokens": None,
                                            "min_tokens": 2, "temperature": 0})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 2 and resp.json()["choices"][0]["finish_reason"] == "length"
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": [28] * (n - 2), "max_tokens": None,
                                            "min_tokens": 3})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "min_tokens", resp.text


def test_a_failed_step_fails_what_is_in_flight_and_the_loop_serves_on():
    # async_engine.py: an engine step that raises fails every request in flight with EngineLoopError (the handler
    # answers 500) instead of leaving it to run on unreported; the loop keeps serving
    import asyncio

    from eightbit import SamplingParams
    from eightbit.engine.server.async_engine import AsyncEngine, EngineLoopError, Sink

    engine = tiny_engine()
    real_step, calls = engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real_step()

    engine.step = step
    looper = AsyncEngine(engine, idle_poll_s=0.05).start()

    async def one(rid):
        q = asyncio.Queue()
        looper.submit(rid, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True),
                      Sink(asyncio.get_running_loop(), q), every_step=False)
        while True:
            _, item = await asyncio.wait_for(q.get(), 30)
            if isinstance(item, Exception) or item.finished:
                return item

    try:
        first = asyncio.run(one("a"))
        assert isinstance(first, EngineLoopError) and "boom" in str(first), first
        assert looper.alive and "a" not in engine.requests
        second = asyncio.run(one("b"))
        assert not isinstance(second, Exception) and len(second.outputs[0].token_ids) == 3
    finally:
        looper.stop()


def test_a_request_with_n_samples_is_one_running_request_of_n_sequences(server):
    wait_idle(server)
    body = {"model": MODEL, "prompt": "Write a long essay about the sea.", "max_tokens": 500, "ignore_eos": True,
            "n": 3, "temperature": 1.0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        assert sum(next(lines).startswith("data: {") for _ in range(12)) >= 3  # it runs
        m = metrics(server)
    assert m["eightbit_num_requests_running"] == 1 and m["eightbit_num_sequences_running"] == 3, m
    wait_idle(server)


def test_an_unhandled_error_under_allow_all_origins_names_any_origin():
    # with allowed origins "*", CORSMiddleware answers every origin with "*"; the 500 made outside it must too
    from eightbit.engine.server import api
    from eightbit.engine.server.cli import BackgroundServer

    engine = tiny_engine()
    srv = BackgroundServer(engine, allowed_origins=("*",)).start()
    real = api._check_limits
    try:
        ok = httpx.get(srv.url + "/v1/models", headers={"origin": "https://any.test"})
        assert ok.headers["access-control-allow-origin"] == "*"
        api._check_limits = lambda *a, **k: 1 / 0
        resp = httpx.post(srv.url + "/v1/completions", headers={"origin": "https://any.test"},
                          json={"model": "llama-tiny", "prompt": [1, 2, 3], "max_tokens": 1})
        assert resp.status_code == 500 and resp.headers["access-control-allow-origin"] == "*", resp.headers
    finally:
        api._check_limits = real
        srv.stop()


def test_stopping_the_loop_fails_what_is_in_flight():
    # EngineLoopError's contract: a request in flight when the loop ends hears of it instead of waiting for ever
    import asyncio

    from eightbit import SamplingParams
    from eightbit.engine.server.async_engine import AsyncEngine, EngineLoopError, Sink

    engine = tiny_engine()
    looper = AsyncEngine(engine, idle_poll_s=0.05).start()

    async def main():
        q = asyncio.Queue()
        looper.submit("a", [1, 2, 3], SamplingParams(max_tokens=250, ignore_eos=True),
                      Sink(asyncio.get_running_loop(), q), every_step=True)
        _, item = await asyncio.wait_for(q.get(), 30)  # it runs
        assert not isinstance(item, Exception)
        await asyncio.get_running_loop().run_in_executor(None, looper.stop)
        while True:
            _, item = await asyncio.wait_for(q.get(), 30)
            if isinstance(item, Exception) or item.finished:
                return item

    last = asyncio.run(main())
    assert isinstance(last, EngineLoopError) and "stopped" in str(last), last


def test_every_sample_is_counted_by_its_finish_reason(server):
    key = 'eightbit_request_success_total{finish_reason="length"}'
    before = metrics(server).get(key, 0)
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "n": 3, "max_tokens": 2,
                                            "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    assert metrics(server)[key] == before + 3


def test_a_streamed_prompt_list_with_n_keeps_its_choices_apart(server, offline):
    # OpenAI/vLLM: choice index = prompt index * n + sample index, in a stream as without; usage counts every
    # prompt's own tokens (the prompts end at different lengths here)
    # prompt 0 ends first: the prompts run in lockstep, so a count that reads prompt 0's tokens for every prompt is
    # wrong only when prompt 0 stops before the others
    prompts = ["The sky is", "Hello"]
    free = [r.outputs[0].token_ids for r in offline.generate(prompts, greedy(8), use_tqdm=False)]
    tid = free[0][1]
    assert tid not in free[1] and tid not in free[0][:1]
    ref = offline.generate(prompts, greedy(8, stop_token_ids=[tid]), use_tqdm=False)
    lengths = [len(r.outputs[0].token_ids) for r in ref]
    assert 2 == lengths[0] < lengths[1]
    body = {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 8, "temperature": 0, "stop_token_ids": [tid]}
    events = stream_events(server, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    joined = {}
    for e in events:
        for c in e["choices"]:
            joined[c["index"]] = joined.get(c["index"], "") + c["text"]
    assert joined == {0: ref[0].outputs[0].text, 1: ref[0].outputs[0].text,
                      2: ref[1].outputs[0].text, 3: ref[1].outputs[0].text}
    assert events[-1]["usage"]["completion_tokens"] == 2 * sum(lengths)


def test_prompt_token_ids_must_be_inside_the_vocabulary(server):
    # ids are in [0, vocab_size): the first id past the end is a 400 naming the prompt, not an engine step failure
    v = server.app.state.server.vocab_size
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": [1, v], "max_tokens": 1})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt", resp.text
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": [1, v - 1], "max_tokens": 1})
    assert resp.status_code == 200, resp.text


# --- s62: tool-call plumbing, add_generation_prompt, the engine process's start and stop (mutation gaps) ----------


def test_tools_and_functions_sent_together_both_reach_the_template(server, offline, monkeypatch):
    """A request may carry both `tools` and the deprecated `functions` (each with its "none"): the template gets
    both, the functions in tools' form after the tools. Reference: HF's apply_chat_template with that tool list."""
    tok, seen = offline.get_tokenizer(), watch_rendering(monkeypatch, TOOLS_TEMPLATE)
    lookup = {"name": "lookup", "description": "look a word up", "parameters": {"type": "object", "properties": {}}}
    messages = [{"role": "user", "content": "Hi"}]
    want = tok.apply_chat_template(messages, chat_template=TOOLS_TEMPLATE, add_generation_prompt=True,
                                   tokenize=False, tools=TOOLS + [{"type": "function", "function": lookup}])
    assert "get_weather" in want and "lookup" in want
    resp = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1,
                                                  "tools": TOOLS, "tool_choice": "none", "functions": [lookup],
                                                  "function_call": "none"})
    assert resp.status_code == 200, resp.text
    assert seen[-1].text == want
    assert resp.json()["usage"]["prompt_tokens"] == len(tok(want, add_special_tokens=False).input_ids)


# Llama 3.1's test for an earlier turn's calls: `'tool_calls' in message`, then their number (None has none)
KEYS_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}"
                 "{% if 'tool_calls' in m %} calls {{ m.tool_calls | length }}{% endif %}"
                 "{% if 'tool_call_id' in m %} answers {{ m.tool_call_id }}{% endif %}\n{% endfor %}")


def test_null_tool_fields_of_an_earlier_reply_are_left_out(server, offline, monkeypatch):
    """Clients send an earlier reply back as the SDK gave it: `"tool_calls": null` and other null fields. The
    template gets the message without them (as without the keys), so a template that tests for the key (Llama 3.1's)
    does not read null as calls. Reference: HF's apply_chat_template on the messages without the null fields. (HF
    5.x drops null fields itself; older transformers, which pyproject allows, hand them to the template: so the
    messages the server renders are checked too.)"""
    tok, seen = offline.get_tokenizer(), watch_rendering(monkeypatch, KEYS_TEMPLATE)
    sent = [{"role": "user", "content": "Weather?", "tool_call_id": None},
            {"role": "assistant", "content": "Sunny.", "refusal": None, "tool_calls": None, "function_call": None},
            {"role": "user", "content": "Thanks."}]
    plain = [{"role": m["role"], "content": m["content"]} for m in sent]
    want = tok.apply_chat_template(plain, chat_template=KEYS_TEMPLATE, add_generation_prompt=True, tokenize=False)
    resp = post(server, "/v1/chat/completions", {"model": MODEL, "messages": sent, "max_tokens": 1})
    assert resp.status_code == 200, resp.text
    assert seen[-1].text == want and "calls" not in want
    assert seen[-1].messages == plain


def test_tool_call_history_of_the_wrong_shape(server, monkeypatch):
    """An earlier turn's call whose function is not an object is a 400 naming the message (not a 500); arguments that
    are JSON but not an object (a number, a list, true, sent as themselves rather than as a string) reach the
    template as {} like any other arguments that are not an object; tool_calls that is not a list names the
    message too."""
    seen = watch_rendering(monkeypatch)
    body = {"model": MODEL, "max_tokens": 1}
    for function in ("get_weather", ["get_weather"]):
        call = {"id": "call_1", "type": "function", "function": function}
        body["messages"] = [TOOL_HISTORY[0], {**TOOL_HISTORY[1], "tool_calls": [call]}, TOOL_HISTORY[2]]
        resp = post(server, "/v1/chat/completions", body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages.1", resp.text
    for arguments in (5, [1], True, 2.5):
        call = {**TOOL_CALL, "function": {"name": "get_weather", "arguments": arguments}}
        body["messages"] = [TOOL_HISTORY[0], {**TOOL_HISTORY[1], "tool_calls": [call]}, TOOL_HISTORY[2]]
        assert post(server, "/v1/chat/completions", body).status_code == 200
        assert seen[-1].messages[1]["tool_calls"][0]["function"]["arguments"] == {}, arguments
    for bad in (5, "call", {"function": {"name": "f"}}):
        body["messages"] = [TOOL_HISTORY[0], {**TOOL_HISTORY[1], "tool_calls": bad}, TOOL_HISTORY[2]]
        resp = post(server, "/v1/chat/completions", body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages.1", resp.text


def test_a_named_tool_choice_is_refused_with_or_without_tools(server):
    """tool_choice naming a function asks for a call, which this server never makes: refused, not answered with
    text, whether or not the tools came too."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    base = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "tool_choice": choice}
    for body, param in ((base, "tool_choice"), ({**base, "tools": TOOLS}, "tools"),
                        ({**base, "tool_choice": None, "function_call": {"name": "get_weather"}}, "function_call")):
        resp = post(server, "/v1/chat/completions", body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_tools_and_tool_calls_count_toward_the_character_bound(server, monkeypatch):
    """The template's input is bounded before it is rendered (a template that shows them would turn them into prompt
    text): the tools' and an earlier turn's calls' characters count, not only the messages' text."""
    from eightbit.engine.server import api

    state = server.app.state.server
    limit = state.max_chars_per_token * state.max_model_len

    def render(*args, **kwargs):
        raise AssertionError("rendered past the character bound")

    monkeypatch.setattr(api, "render_chat", render)
    big_tool = {"type": "function", "function": {"name": "f", "description": "d" * limit}}
    big_call = {**TOOL_CALL, "function": {"name": "get_weather", "arguments": json.dumps({"city": "x" * limit})}}
    for extra in ({"tools": [big_tool], "tool_choice": "none"},
                  {"messages": [TOOL_HISTORY[0], {**TOOL_HISTORY[1], "tool_calls": [big_call]}, TOOL_HISTORY[2]]}):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **extra}
        resp = post(server, "/v1/chat/completions", body)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["code"] == "context_length_exceeded", resp.text


def test_add_generation_prompt_false_ends_the_prompt_after_the_last_message(server, offline):
    """vLLM's add_generation_prompt: false, without continue_final_message: the conversation is rendered closed,
    with no assistant turn opened after it. Reference: HF's apply_chat_template with the same option, generated
    from offline."""
    tok = offline.get_tokenizer()
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]
    text = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    ids = tok(text, add_special_tokens=False).input_ids
    opened = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert len(tok(opened, add_special_tokens=False).input_ids) > len(ids)  # the option matters here
    ref = offline.generate([ids], greedy(6), use_tqdm=False)[0].outputs[0]
    resp = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 6,
                                                  "temperature": 0, "add_generation_prompt": False})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == len(ids)
    assert resp.json()["choices"][0]["message"]["content"] == ref.text


def test_an_interrupted_engine_process_start_leaves_nothing_behind(monkeypatch):
    """Ctrl-C while the engine is being built (the engine process ignores it): start() kills the process, closes
    its pipe and starts afresh next time; stop() of a loop that never started does nothing."""
    import signal

    from eightbit.engine.server.engine_process import EngineProcess

    loop = EngineProcess(tiny_config())
    loop.stop()  # never started
    seen = {}

    def interrupted(self):
        seen.update(proc=self._proc, conn=self._conn)
        raise KeyboardInterrupt

    monkeypatch.setattr(EngineProcess, "_wait_for_start", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            loop.start()
        assert loop._proc is None and not loop.alive
        seen["proc"].join(10)
        assert seen["proc"].exitcode == -signal.SIGKILL and seen["conn"].closed
        loop.stop()  # nothing to stop
    finally:
        if seen.get("proc") is not None and seen["proc"].is_alive():
            seen["proc"].kill()


def test_an_engine_process_starts_once_outlives_ctrl_c_and_is_killed_if_it_hangs_at_stop():
    """start() of a started loop is a no-op (build_server starts what it is given); Ctrl-C reaches the engine process
    too, which ignores it while the server drains; stop() kills an engine process that does not end on its stop
    command in time (here: one stopped with SIGSTOP)."""
    import multiprocessing
    import os
    import signal

    from eightbit.engine.server.engine_process import EngineProcess

    others = {p.pid for p in multiprocessing.active_children()}
    srv = BackgroundServer(EngineProcess(tiny_config())).start()
    loop = srv.async_engine
    proc = loop._proc
    try:
        assert loop.start() is loop and loop._proc is proc
        assert [p.pid for p in multiprocessing.active_children() if p.pid not in others] == [proc.pid]
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(0.5)
        assert proc.is_alive() and loop.alive
        body = {"model": "llama-tiny", "prompt": [5, 17, 300], "max_tokens": 3, "ignore_eos": True}
        resp = post(srv, "/v1/completions", body)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3, resp.text
        os.kill(proc.pid, signal.SIGSTOP)
        started = time.monotonic()
        loop.stop(timeout=1)
        assert not proc.is_alive() and proc.exitcode == -signal.SIGKILL
        assert time.monotonic() - started < 8
    finally:
        for p in multiprocessing.active_children():
            if p.pid not in others:
                p.kill()
        srv.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_background_server_that_cannot_serve_fails_its_start_at_once():
    """uvicorn's thread ends when it cannot serve (here: its socket closed): start() says so then, not when its
    timeout runs out."""
    srv = BackgroundServer(tiny_engine())
    try:
        srv._sock.close()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="the server did not start"):
            srv.start(timeout=60)
        assert time.monotonic() - started < 20
    finally:
        srv.async_engine.stop()
