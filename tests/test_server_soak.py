"""Random concurrent workloads through the whole server (HTTP handlers, the engine loop in a thread or in an
EngineProcess, the engine), on a tiny random Llama with a byte-level BPE tokenizer and a chat template whose steps
take about a millisecond, so that the server's own work is what runs; also with engine steps that fail now and then.

Completions and chat, streamed or not, n of 1-3, greedy and seeded sampling, stop strings and tokens, penalties,
log-probs, lists of prompts, shared prefixes, repeated and refused requests; a KV cache small enough to preempt,
chunked prefill, async scheduling, sometimes --max-queue. Clients leave at every point: once the request is sent,
half-way through its body, mid-stream, on a read timeout, by a cancelled task. Every request not cut off must get
what the offline engine gives its prompt alone; afterwards nothing may be left or still generate, every generated
token must belong to an answer or to a request whose client left, and the response counters must add up.

For longer soaks, EIGHTBIT_SOAK_SEEDS (default 13,22) and EIGHTBIT_SOAK_FAULT_SEEDS (216) take other comma-separated
seeds (each workload takes 3-10 s; the defaults were picked for having every kind of client and a --max-queue)."""

import asyncio
import dataclasses
import itertools
import json
import logging
import os
import random
import time
from collections import defaultdict

import httpx
import pytest
import torch

from eightbit import EngineConfig, LLMEngine, SamplingParams
from eightbit.engine.chat import render_chat
from eightbit.engine.server.cli import BackgroundServer
from eightbit.engine.server.engine_process import EngineProcess
from eightbit.quant.testing import WORDS, make_tiny_checkpoint, make_tiny_tokenizer

MAX_MODEL_LEN = 128
VOCAB = 320
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
LOGPROB_TOL = 1e-4


def seeds(name, default) -> list[int]:
    return [int(s) for s in os.environ.get(name, default).split(",") if s.strip()]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> dict:
    """The model's EngineConfig options."""
    tok = make_tiny_tokenizer(VOCAB)
    tok.chat_template = CHAT_TEMPLATE
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("soak") / "m", tokenizer=tok, num_hidden_layers=2,
                                  max_position_embeddings=MAX_MODEL_LEN, outliers=False)
    return dict(model=str(folder), dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def alone(model):
    """alone(prompt ids, params): the samples of the request run as the engine's only one (cached)."""
    engine = LLMEngine(EngineConfig(**model, num_kv_blocks=128, enable_prefix_caching=False, async_scheduling=False))
    cache = {}

    def run(prompt, params):
        key = (tuple(prompt), repr(params))
        if key not in cache:
            engine.add_request("alone", list(prompt), params, final_only=True)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    cache[key] = sorted(out.outputs, key=lambda o: o.index)
        return cache[key]

    run.tokenizer = engine.tokenizer
    return run


@pytest.fixture
def logged_errors(caplog):
    """The errors the server and uvicorn log (uvicorn's logger does not propagate to caplog's)."""
    uvicorn_log = logging.getLogger("uvicorn")
    uvicorn_log.addHandler(caplog.handler)
    yield lambda: [r.getMessage() for r in caplog.records
                   if r.levelno >= logging.ERROR and r.name.startswith(("eightbit", "uvicorn"))]
    uvicorn_log.removeHandler(caplog.handler)


# --- the workload --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Request:
    path: str
    body: dict
    prompts: list  # token ids
    params: SamplingParams | None = None
    samples: list = dataclasses.field(default_factory=list)  # each prompt's samples run alone, one after the other
    leave: tuple | None = None  # how the client goes away: (mode, argument)
    bad: str | None = None  # a request the server must refuse: the param its 400 names


def words(rng, lo, hi):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def params_of(body) -> SamplingParams:
    """The SamplingParams the server must make of the body's fields (those the workload sets)."""
    logprobs = (body.get("top_logprobs", 0) if body.get("logprobs") else None) if "messages" in body \
        else body.get("logprobs")
    same = {f: body[f] for f in ("top_p", "top_k", "ignore_eos", "stop", "stop_token_ids", "min_tokens",
                                 "include_stop_str_in_output", "skip_special_tokens", "frequency_penalty",
                                 "presence_penalty") if f in body}
    return SamplingParams(n=body["n"], temperature=float(body["temperature"]), logprobs=logprobs,
                          seed=body["seed"] % 2**63 if "seed" in body else None,  # negative seeds wrap around
                          max_tokens=body.get("max_tokens", body.get("max_completion_tokens")), **same)


def random_prompts(rng, tok, prefixes, systems, body) -> tuple[str, list]:
    """Put a prompt (text, token ids or a list) or chat messages in the body; returns the endpoint and token ids."""
    if rng.random() < 0.35:
        messages = [{"role": "system", "content": rng.choice(systems)}] if rng.random() < 0.7 else []
        messages.append({"role": "user", "content": words(rng, 1, 6)})
        if rng.random() < 0.2:
            messages += [{"role": role, "content": words(rng, 1, 4)} for role in ("assistant", "user")]
        body["messages"] = messages
        return CHAT, [render_chat(tok, messages, True)[1]]
    if rng.random() < 0.7:
        texts = [(rng.choice(prefixes) + " " if rng.random() < 0.8 else "") + words(rng, 1, 6)
                 for _ in range(rng.choice((1, 1, 1, 1, 2, 3)))]
        body["prompt"] = texts if len(texts) > 1 else texts[0]
        return COMPLETIONS, [tok(t).input_ids for t in texts]
    prompts = [(tok(rng.choice(prefixes)).input_ids if rng.random() < 0.7 else []) +
               [rng.randrange(VOCAB) for _ in range(rng.randint(1, 16))] for _ in range(rng.choice((1, 1, 2)))]
    body["prompt"] = prompts if len(prompts) > 1 else prompts[0]
    return COMPLETIONS, prompts


def add_stops(rng, body, sample):
    """Stop strings and stop tokens taken from what the request gives without them, so that they do stop it."""
    stop = sample.text[rng.randrange(len(sample.text)):][: rng.randint(1, 3)] if sample.text else ""
    if stop.strip() and "\ufffd" not in stop and rng.random() < 0.6:
        body["stop"] = [stop, words(rng, 1, 1)] if rng.random() < 0.3 else rng.choice((stop, [stop]))
        if rng.random() < 0.2:
            body["include_stop_str_in_output"] = True
    if sample.token_ids and rng.random() < 0.5:
        body["stop_token_ids"] = [rng.choice(sample.token_ids)]
    if ("stop" in body or "stop_token_ids" in body) and rng.random() < 0.2:
        body["min_tokens"] = rng.randint(1, body.get("max_tokens") or body.get("max_completion_tokens") or 8)


def random_leave(rng, stream):
    r = rng.random()
    if r < 0.07:
        return "raw_close", rng.choice((0.0, 0.0, rng.uniform(0, 0.05)))  # 0.0: at once
    if r < 0.10:
        return "half_body", None
    if r < 0.20 and stream:
        return "mid_stream", rng.randint(1, 5)  # after that many events
    if r < 0.28 and not stream:
        return "read_timeout", rng.uniform(0.02, 0.6)
    return ("cancel", rng.uniform(0, 0.5)) if r < 0.35 else None


def random_request(rng, alone, prefixes, systems) -> Request:
    tok = alone.tokenizer
    body = {"n": rng.choice((1, 1, 1, 1, 2, 2, 3))}
    seeded = rng.random() < 0.4
    if seeded:
        body.update(temperature=rng.choice((0.7, 1.0, 1.3)), seed=rng.choice((rng.randrange(2**40), -1, 7)))
    else:
        body["temperature"] = rng.choice((0, 0.0, 1e-6))  # greedy (a tiny temperature is greedy too)
    path, prompts = random_prompts(rng, tok, prefixes, systems, body)
    if rng.random() < 0.1 or (path == CHAT and rng.random() < 0.25):
        body["max_tokens"] = None  # null: up to the context (chat's default too)
        if path == CHAT and rng.random() < 0.5:
            del body["max_tokens"]
    else:
        room = min(32, MAX_MODEL_LEN - max(map(len, prompts)))
        body["max_completion_tokens" if path == CHAT and rng.random() < 0.5 else "max_tokens"] = rng.randint(1, room)
    for p, field, value in ((0.5, "ignore_eos", True), (0.1, "frequency_penalty", 0.5), (0.1, "presence_penalty", 0.3),
                            (0.05, "skip_special_tokens", False), (0.3 * seeded, "top_p", 0.9),
                            (0.2 * seeded, "top_k", rng.randrange(1, 40))):
        if rng.random() < p:
            body[field] = value
    if rng.random() < 0.25:
        k = rng.randrange(0, 4)
        body.update({"logprobs": k} if path == COMPLETIONS else {"logprobs": True, "top_logprobs": k})
        if path == CHAT and not k and rng.random() < 0.5:
            del body["top_logprobs"]
    if rng.random() < 0.4:
        add_stops(rng, body, rng.choice(alone(prompts[0], params_of(body))))
    if rng.random() < 0.5:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    params = params_of(body)
    return Request(path, body, prompts, params, [s for p in prompts for s in alone(p, params)],
                   leave=random_leave(rng, body.get("stream")))


def bad_request(rng) -> Request:
    body, param = rng.choice([
        ({"prompt": "the time", "n": 99}, "n"), ({"prompt": [7] * MAX_MODEL_LEN}, "prompt"),
        ({"prompt": "the time", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ({"prompt": [5, 6], "stop_token_ids": [VOCAB + 5]}, "stop_token_ids"),
        ({"prompt": "the", "logprobs": 21}, "logprobs"), ({"messages": []}, "messages"),
    ])
    body["stream"] = rng.random() < 0.5
    return Request(CHAT if "messages" in body else COMPLETIONS, body, prompts=[], bad=param)


def random_workload(rng, alone, count) -> list[Request]:
    prefixes, systems = [words(rng, 3, 8) for _ in range(3)], [words(rng, 3, 8) for _ in range(2)]
    workload = []
    for _ in range(count):
        r = rng.random()
        if r < 0.04:
            workload.append(bad_request(rng))
        elif r < 0.12 and workload and not workload[-1].bad:  # the same again: its whole prompt in the prefix cache
            leave = rng.choice((None, None, ("cancel", rng.uniform(0, 0.3)), ("raw_close", 0.0)))
            workload.append(dataclasses.replace(workload[-1], leave=leave))
        else:
            workload.append(random_request(rng, alone, prefixes, systems))
    return workload


def random_config(rng, options) -> EngineConfig:
    """A KV cache of one or two max_model_len sequences (the engine's least): a few requests at once preempt."""
    block_size = rng.choice((4, 8, 16))
    least = -(-MAX_MODEL_LEN // block_size)
    return EngineConfig(**options, block_size=block_size, num_kv_blocks=least + rng.randrange(0, least + 1),
                        max_num_seqs=rng.randrange(3, 17), max_num_batched_tokens=rng.choice((16, 32, 64, 512)),
                        enable_prefix_caching=rng.random() < 0.75, async_scheduling=rng.random() < 0.5)


# --- the clients ---------------------------------------------------------------------------------------------


async def complete(http, req, limit=None, **kw) -> dict:
    """{status, body}, or for a stream {status, events, done} (its first `limit` events only). A 503 of --max-queue
    is retried, as clients do."""
    deadline = time.monotonic() + 30  # (not for ever: a server whose queue count leaks answers only 503s)
    while True:
        if req.body.get("stream"):
            async with http.stream("POST", req.path, json=req.body, **kw) as resp:
                if resp.status_code == 200:
                    events, done = [], False
                    async for line in resp.aiter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line:
                            assert line.startswith("data: ") and not done, line
                            events.append(json.loads(line[len("data: "):]))
                            if len(events) == limit:
                                break
                    return dict(status=200, events=events, done=done)
                status, body = resp.status_code, json.loads(await resp.aread())
        else:
            resp = await http.post(req.path, json=req.body, **kw)
            status, body = resp.status_code, resp.json()
        if status != 503 or time.monotonic() > deadline:
            return dict(status=status, body=body)
        assert resp.headers["retry-after"] == "1" and body["error"]["code"] == "overloaded", body
        await asyncio.sleep(0.02)


async def send_and_close(url, req, delay, half):
    """The request (or half its body) on a socket of its own, closed after `delay` without reading a byte."""
    host, port = url.split("//")[1].split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps(req.body).encode()
    writer.write(f"POST {req.path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + (body[: len(body) // 2] if half else body))
    await writer.drain()
    await asyncio.sleep(delay or 0)
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass


async def run_client(http, url, req) -> dict:
    """What the client got; left=True if it went away first (with the events it read, mid-stream)."""
    mode, arg = req.leave or (None, None)
    if mode in ("raw_close", "half_body"):
        await send_and_close(url, req, arg, half=mode == "half_body")
        return dict(left=True)
    if mode == "mid_stream":
        res = await complete(http, req, limit=arg)
        return res if res["status"] != 200 or res["done"] else dict(left=True, events=res["events"])
    if mode == "read_timeout":
        try:
            return await complete(http, req, timeout=httpx.Timeout(60, read=arg))
        except httpx.ReadTimeout:
            return dict(left=True)
    task = asyncio.ensure_future(complete(http, req))
    if mode == "cancel" and not (await asyncio.wait([task], timeout=arg))[0]:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return dict(left=True)
    return await task


async def run_clients(url, workload, concurrency) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        async def one(req):
            async with sem:
                return await run_client(http, url, req)

        return await asyncio.gather(*map(one, workload))


# --- the checks of each answer -------------------------------------------------------------------------------


def collect_choices(choices, chat) -> dict:
    """{index: text, finish (reason, stop reason), each token's log-prob and top values} of a body's choices, or of
    a stream's chunks in order."""
    got = {}
    for c in choices:
        g = got.setdefault(c["index"], dict(text="", finish=None, values=[], tops=[]))
        assert g["finish"] is None, f"choice {c['index']}: a chunk after its finish"
        g["text"] += (c["message"]["content"] if "message" in c else c["delta"].get("content") or "") if chat \
            else c["text"]
        lp = c.get("logprobs")
        if lp and chat:
            g["values"] += [t["logprob"] for t in lp["content"]]
            g["tops"] += [[x["logprob"] for x in t["top_logprobs"]] for t in lp["content"]]
        elif lp:
            g["values"] += lp["token_logprobs"]
            g["tops"] += [list(top.values()) for top in lp["top_logprobs"]]
            assert lp["text_offset"] == sorted(lp["text_offset"]), lp
        if c["finish_reason"] is not None:
            g["finish"] = (c["finish_reason"], c.get("stop_reason"))
    return got


def check_choices(got, req, where, cut=False):
    """Each sample as offline: its text, finish and stop reasons, log-probs (at most k + 1 top entries: the k most
    likely and the sampled token, each an offline value). cut: a stream the client left, or a failed step ended,
    whose samples so far must be prefixes."""
    k = req.params.logprobs
    assert cut or sorted(got) == list(range(len(req.samples))), f"{where}: choices {sorted(got)}"
    for i, g in got.items():
        ref, w = req.samples[i], f"{where} choice {i}"
        if cut:
            assert ref.text.startswith(g["text"]), f"{w}: {g['text']!r} is not a prefix of {ref.text!r}"
            assert g["finish"] is None or g["finish"][0] == ref.finish_reason, w
            continue
        assert g["text"] == ref.text, f"{w}: {g['text']!r} != offline {ref.text!r}"
        stop_reason = ref.stop_reason if isinstance(ref.stop_reason, (int, str)) else None
        assert g["finish"] == (ref.finish_reason, stop_reason), f"{w}: finish {g['finish']}"
        want = [] if k is None else [entry[t] for entry, t in zip(ref.logprobs, ref.token_ids)]
        assert len(g["values"]) == len(want), f"{w}: {len(g['values'])} log-probs for {len(want)} tokens"
        assert all(abs(a - b) < LOGPROB_TOL for a, b in zip(g["values"], want)), f"{w}: log-probs {g['values']}"
        for top, entry in zip(g["tops"], ref.logprobs or []):
            assert len(top) <= k + 1 and all(any(abs(v - e) < LOGPROB_TOL for e in entry.values()) for v in top), w


def check_answer(req, res, where):
    if req.bad:
        assert res["status"] == 400 and res["body"]["error"]["param"] == req.bad, f"{where}: {res}"
        return
    assert res.get("status") == 200, f"{where}: {res}"
    if "body" in res:
        got, usage = collect_choices(res["body"]["choices"], req.path == CHAT), res["body"]["usage"]
    else:
        events, usage = res["events"], None
        assert res["done"] and not any("error" in e for e in events), f"{where}: {events[-3:]}"
        if req.body.get("stream_options"):  # the usage comes last, alone; the chunks before it have a null one
            assert events[-1]["choices"] == [] and all(e["usage"] is None for e in events[:-1]), where
            usage = events.pop()["usage"]
        else:
            assert all("usage" not in e for e in events), where
        if req.path == CHAT:
            first = events.pop(0)["choices"]
            assert [(c["index"], c["delta"]) for c in first] == [(i, {"role": "assistant", "content": ""})
                                                                  for i in range(req.params.n)], f"{where}: {first}"
        got = collect_choices([c for e in events for c in e["choices"]], req.path == CHAT)
    check_choices(got, req, where)
    prompt_tokens, completion_tokens = sum(map(len, req.prompts)), sum(len(s.token_ids) for s in req.samples)
    assert usage in (None, dict(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                total_tokens=prompt_tokens + completion_tokens)), f"{where}: usage {usage}"


def check_cut_stream(req, events, where):
    assert not any("error" in e for e in events), f"{where}: {events}"
    check_choices(collect_choices([c for e in events for c in e["choices"]], req.path == CHAT), req, where, cut=True)


def failed_by_the_engine(req, res, where) -> bool:
    """Whether a failed engine step ended the request: then a 500, or an SSE error event and [DONE]."""
    if any("error" in e for e in res.get("events", ())):
        *events, error = res["events"]  # (a client that reads k events may leave between it and [DONE])
        assert res.get("left") or res["done"], where
        assert error["error"]["type"] == "server_error" and "engine step failed" in error["error"]["message"], where
        check_cut_stream(req, events, where)
        return True
    if res.get("status") == 500:
        assert res["body"]["error"]["type"] == "server_error", f"{where}: {res}"
        return True
    return False


# --- the checks of the server and the engine afterwards ------------------------------------------------------


def metrics(url) -> dict:
    lines = httpx.get(url + "/metrics").text.splitlines()
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in lines if line and line[0] != "#")}


def status_count(m, status) -> float:
    return sum(m.get(f'eightbit_http_responses_total{{endpoint="{e}",status="{status}"}}', 0)
               for e in (COMPLETIONS, CHAT))


def check_nothing_left(srv, kind) -> dict:
    """Wait for the server to go idle: nothing may be left behind, nor generate afterwards. Returns the metrics."""
    state, loop = srv.app.state.server, srv.async_engine
    deadline = time.monotonic() + 30
    while True:
        m = metrics(srv.url)
        left = dict(running=m["eightbit_num_requests_running"], waiting=m["eightbit_num_requests_waiting"],
                    kv_blocks=m["eightbit_kv_cache_blocks_used"], queued=state.num_queued,
                    open_generations=len(state.open_generations), sinks=len(loop._sinks))
        if not any(left.values()):
            break
        assert time.monotonic() < deadline, f"left behind: {left}"
        time.sleep(0.05)
    if kind == "thread":
        engine, bm = loop.engine, loop.engine.block_manager
        assert not engine.requests and not engine._aborted and not engine.scheduler.has_unfinished()
        assert bm.num_free_blocks == bm.num_blocks and not bm.copies_due
    time.sleep(0.3)
    assert metrics(srv.url)["eightbit_generation_tokens_total"] == m["eightbit_generation_tokens_total"], \
        "tokens generated after every request ended"
    return m


def owners(workload, items, prompt_and_params):
    """{workload index: the items (engine requests, submissions) made for it}, and the indices of the requests
    sent twice, whose items cannot be told apart."""
    def key(prompt, p):
        return tuple(prompt), p.n, p.max_tokens, p.seed, p.temperature, repr(p.stop), repr(p.stop_token_ids)

    by_key = defaultdict(set)
    for i, req in enumerate(workload):
        for prompt in req.prompts:
            by_key[key(prompt, req.params)].add(i)
    out = defaultdict(list)
    for item in items:
        if len(indices := by_key.get(key(*prompt_and_params(item)), ())) == 1:
            out[next(iter(indices))].append(item)
    return out, {i for indices in by_key.values() if len(indices) > 1 for i in indices}


def spy(obj, name, record):
    real = getattr(obj, name)

    def call(*args, **kwargs):
        record(args, result := real(*args, **kwargs))
        return result

    setattr(obj, name, call)


def tokens_of(req) -> int:
    return sum(len(s.token_ids) for s in req.samples)


def check_engine_work(workload, results, submitted, aborted, added, generated) -> list[int]:
    """Nothing refused or half-sent reached the engine, no answered request was aborted, and every generated token
    went to an answer or to a request whose client left (at most its whole answer, less if it left at once).
    Returns the requests whose client left and that may have reached the engine."""
    sent, twice = owners(workload, submitted, lambda s: (s[1], s[2]))
    for i, subs in sent.items():
        assert not workload[i].bad and workload[i].leave != ("half_body", None), f"request {i} reached the engine"
        assert results[i].get("left") or not aborted & {s[0] for s in subs}, f"request {i} answered, and aborted"
    maybe_sent = [i for i, res in enumerate(results) if res.get("left") and (i in sent or i in twice)]
    answered = sum(tokens_of(req) for req, res in zip(workload, results) if not res.get("left"))
    most = answered + sum(tokens_of(workload[i]) for i in maybe_sent)
    assert answered <= generated <= most, (answered, generated, most)
    at_once = [i for i in sent if workload[i].leave == ("raw_close", 0.0) and tokens_of(workload[i]) >= 32]
    for i in at_once:  # gone long before its answer could be: its engine requests were aborted, and cut short
        assert aborted & {s[0] for s in sent[i]}, f"request {i} left at once, yet was not aborted"
    assert not at_once or generated < most, f"requests {at_once} left at once, yet all ran to the end"
    if added is not None:  # the thread kind: how each engine request ended
        assert all(r.is_finished for r in added)
        for i, requests in owners(workload, added, lambda r: (r.prompt_token_ids, r.params))[0].items():
            reasons = [s.finish_reason for r in requests for s in r.seqs]
            assert i not in at_once or "abort" in reasons, f"request {i} left at once, yet ran to its end"
    return maybe_sent


def check_counters(m, workload, results, maybe_sent, failing):
    """Each refusal is one 400; each client gone before its answer at most one 499 (one gone mid-body exactly one);
    each overload one 503; every answered sample is among the finished ones."""
    statuses = {k.split('status="')[1][:3] for k in m if k.startswith('eightbit_http_responses_total{endpoint="/v1/c')}
    assert statuses <= {"200", "400", "499", "503"} | ({"500"} if failing else set()), statuses
    refused = sum(1 for req in workload if req.bad)
    assert status_count(m, 400) == refused, f"{status_count(m, 400)} 400s for {refused} requests to refuse"
    half_bodies = sum(1 for req in workload if req.leave == ("half_body", None))
    assert half_bodies <= status_count(m, 499) <= sum(1 for res in results if res.get("left")), status_count(m, 499)
    assert status_count(m, 503) == m["eightbit_requests_rejected_overload_total"]
    answered = [req for req, res in zip(workload, results) if not res.get("left") and not req.bad]
    assert status_count(m, 200) >= len(answered)
    samples = sum(req.params.n * len(req.prompts) for req in answered)
    left_samples = sum(workload[i].params.n * len(workload[i].prompts) for i in maybe_sent)
    finished = sum(v for k, v in m.items() if k.startswith("eightbit_request_success_total"))
    assert samples <= finished <= samples + left_samples, (samples, finished, left_samples)
    assert m["eightbit_prompt_tokens_total"] >= sum(sum(map(len, req.prompts)) for req in answered)


# --- the soak ------------------------------------------------------------------------------------------------


def start_server(rng, seed, config, kind, fail_rate, max_queue):
    """The server; the engine's requests (None in the process kind) and its failed steps, as they come."""
    if kind == "process":
        return BackgroundServer(EngineProcess(config), max_queue=max_queue).start(), None, []
    engine, added, failures = LLMEngine(config), [], []
    spy(engine, "add_request", lambda args, request: added.append(request))
    if fail_rate or rng.random() < 0.5:  # slower steps: clients leave mid-answer more often
        real_run, faults, calls = engine.runner.run, random.Random(seed), itertools.count(1)
        sure = faults.randrange(40, 200)  # a step every workload reaches: each has a failure

        def run(*args, **kwargs):
            time.sleep(faults.uniform(0, 0.003))
            if fail_rate and (next(calls) == sure or faults.random() < fail_rate):  # what is in flight fails
                failures.append(1)
                raise RuntimeError("an injected failure")
            return real_run(*args, **kwargs)

        engine.runner.run = run
    return BackgroundServer(engine, max_queue=max_queue).start(), added, failures


def soak(seed, kind, model, alone, logged_errors, fail_rate=0.0) -> int:
    """One random workload through a fresh server, and every check; returns the number of failed engine steps."""
    rng = random.Random(seed)
    workload = random_workload(rng, alone, rng.randint(30, 80))
    concurrency, max_queue = rng.randint(8, 24), rng.choice((None, None, rng.randint(3, 12)))
    config = random_config(rng, model)
    srv, added, failures = start_server(rng, seed, config, kind, fail_rate, max_queue)
    submitted, aborted = [], set()
    spy(srv.async_engine, "submit", lambda args, _: submitted.append(args[:3]))
    spy(srv.async_engine, "abort", lambda args, _: aborted.add(args[0]))
    try:
        t0 = time.monotonic()
        results = asyncio.run(run_clients(srv.url, workload, concurrency))
        wall = time.monotonic() - t0
        for i, (req, res) in enumerate(zip(workload, results)):
            where = f"seed {seed} request {i} ({req.path} {req.leave} {json.dumps(req.body)[:300]})"
            if fail_rate and failed_by_the_engine(req, res, where):
                res["left"] = True  # accounted for as a request left before its end
            elif res.get("left"):
                check_cut_stream(req, res.get("events", []), where)
            else:
                check_answer(req, res, where)

        m = check_nothing_left(srv, kind)
        maybe_sent = check_engine_work(workload, results, submitted, aborted, added,
                                       m["eightbit_generation_tokens_total"])
        check_counters(m, workload, results, maybe_sent, failing=bool(fail_rate))
        last = httpx.post(srv.url + COMPLETIONS, json={"prompt": [5, 17, 300, 42], "max_tokens": 12, "temperature": 0})
        if not (fail_rate and last.status_code == 500):  # (a step may fail under it too)
            assert last.json()["choices"][0]["text"] == alone([5, 17, 300, 42], params_of(
                {"n": 1, "temperature": 0, "max_tokens": 12}))[0].text
        assert not [e for e in logged_errors() if not (failures and "engine step failed" in e)], logged_errors()[:3]
        print(f"\nseed {seed} {kind}: {len(workload)} requests, {sum('left' in r for r in results)} left, "
              f"in {wall:.1f} s; {len(failures)} failed steps; {m['eightbit_engine_preemptions_total']:.0f} "
              f"preemptions; {status_count(m, 503):.0f} 503s; {config}")
        return len(failures)
    finally:
        srv.stop()


@pytest.mark.parametrize("kind", ["thread", "process"])
@pytest.mark.parametrize("seed", seeds("EIGHTBIT_SOAK_SEEDS", "13,22"))
def test_random_workload_through_the_server(seed, kind, model, alone, logged_errors):
    soak(seed, kind, model, alone, logged_errors)


@pytest.mark.parametrize("seed", seeds("EIGHTBIT_SOAK_FAULT_SEEDS", "216"))
def test_random_workload_with_failing_engine_steps(seed, model, alone, logged_errors):
    """A step that raises fails every request in flight (a 500; a stream's SSE error event) and the loop serves
    on: the others are answered as offline, and nothing is left behind."""
    assert soak(seed, "thread", model, alone, logged_errors, fail_rate=0.005)
