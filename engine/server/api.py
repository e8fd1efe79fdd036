"""The FastAPI app: /v1/completions, /v1/chat/completions, /v1/models[/{id}], /health, /metrics.

A handler validates the body, maps it to `SamplingParams`, tokenizes (chat template included) on a
small thread pool, checks the context length and the queue bound, then submits token ids to the
engine loop (async_engine.py) and reads the outputs from its own asyncio.Queue. A client that goes
away — mid-stream or while waiting for a non-streamed answer — has its requests aborted, which
frees their KV blocks at the loop's next iteration.
"""

import asyncio
import codecs
import contextlib
import copy
import functools
import inspect
import json
import logging
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from tokenizers import decoders
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from eightbit.engine.chat import render_chat
from eightbit.engine.sampling_params import SamplingParams
from eightbit.engine.server import protocol as P
from eightbit.engine.server.async_engine import AsyncEngine, Sink
from eightbit.engine.server.metrics import Metrics
from eightbit.engine.server.protocol import APIError

log = logging.getLogger("eightbit.server")

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16  # each generated token is checked against every stop string, on the loop all requests share
MAX_STOP_CHARS = 1024
MAX_TOKEN_IDS = 1024  # logit_bias entries, and stop_token_ids: each is host work at every step of the request
# A prompt of more characters than this many per token of the context cannot fit: refused before tokenizing, so a
# huge body does not hold a tokenizer worker. At least MAX_CHARS_PER_TOKEN; more where the vocabulary has longer
# tokens (SmolLM2's hold up to 81 characters: a newline and 80 spaces), twice its longest token's characters
# (normalization may fold two characters into one)
MAX_CHARS_PER_TOKEN = 32
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class TokenizerPool:
    """Tokenization and chat templates off the event loop and off the engine thread.

    Each worker thread (and the event-loop thread, for logprob token strings) uses its own copy
    of the tokenizer: HF fast tokenizers are not safe to share across threads.
    """

    def __init__(self, tokenizer, workers: int = 2):
        self._base = tokenizer
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="eightbit-tokenizer")
        self._token_text = {}
        self._token_bytes = {}
        self._byte_level = (tokenizer is not None and tokenizer.is_fast
                            and isinstance(tokenizer.backend_tokenizer.decoder, decoders.ByteLevel))
        barrier = threading.Barrier(workers)  # start every worker now and copy its tokenizer up front
        for f in [self._pool.submit(self._warm, barrier) for _ in range(workers)]:
            f.result()

    def _warm(self, barrier):
        self.get()
        barrier.wait(timeout=60)

    def get(self):
        tok = getattr(self._local, "tok", None)
        if tok is None:
            try:
                tok = copy.deepcopy(self._base)
            except Exception:  # an uncopyable tokenizer: share it (slow tokenizers are pure Python)
                tok = self._base
            self._local.tok = tok
        return tok

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def encode(self, text: str) -> list[int]:
        return self.get()(text).input_ids  # exactly what LLMEngine.add_request does with a str

    def chat_prompt(self, messages, add_generation_prompt, kwargs) -> list[int]:
        return render_chat(self.get(), messages, add_generation_prompt, **(kwargs or {}))[1]

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.get().decode([token_id])
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's own bytes (OpenAI's `bytes`): for a token that holds part of a UTF-8 character, its text
        is U+FFFD, so the bytes come from the vocabulary's piece instead."""
        raw = self._token_bytes.get(token_id)
        if raw is None:
            piece = self.get().convert_ids_to_tokens(token_id)
            byte_token = _BYTE_TOKEN.fullmatch(piece)
            if byte_token:  # sentencepiece's byte fallback
                raw = [int(byte_token.group(1), 16)]
            elif self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
                raw = [_BYTE_OF_CHAR[c] for c in piece]
            else:
                raw = list(self.token_text(token_id).encode("utf-8"))
            self._token_bytes[token_id] = raw
        return raw

    def shutdown(self):
        self._pool.shutdown(wait=False, cancel_futures=True)


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE (GPT-2's scheme) writes each byte as one printable character: the printable Latin-1 bytes as
    themselves, the other 68 as the characters from U+0100 on, in byte order. Character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_OF_CHAR = _byte_level_alphabet()


class ServerState:
    def __init__(self, async_engine: AsyncEngine, model_name: str, max_queue: int | None, tokenizer_workers: int,
                 exclude_tools_when_tool_choice_none: bool = False):
        info = async_engine.info
        self.engine = async_engine
        self.model_name = model_name
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.max_num_seqs = info.max_num_seqs
        self.max_queue = max_queue
        self.has_tokenizer = info.tokenizer is not None  # dummy weights have none: token ids in and out
        self.tokenizers = TokenizerPool(info.tokenizer, tokenizer_workers)
        self.template_call_params = _template_call_params(info.tokenizer)
        self.max_chars_per_token = chars_per_token_bound(info.tokenizer)
        self.metrics = Metrics(model_name)
        self.num_queued = 0  # submitted engine requests that have not produced a token yet
        self.created = P.now()
        self.open_generations = set()  # started and not closed

    def end_open_requests(self, error: APIError):
        """Answer every open request with `error` (a stream: its SSE error event and [DONE]); their engine requests
        are aborted as their handlers close them. For a shutdown that will not wait for them any longer."""
        for gen in list(self.open_generations):
            gen.queue.put_nowait((None, error))


# --- one HTTP request's engine requests ---------------------------------------------------------


class Disconnected(Exception):
    pass


_DISCONNECT = object()


class Generation:
    """The engine requests of one HTTP request (one per prompt, each with n choices)."""

    def __init__(self, state: ServerState, base_id: str, prompts: list[list[int]], params: SamplingParams,
                 raw_request: Request, arrival: float):
        self.state = state
        self.prompts = prompts
        self.params = params
        self.ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        self.index = {rid: i for i, rid in enumerate(self.ids)}
        self.raw_request = raw_request
        self.arrival = arrival
        self.queue = asyncio.Queue()
        self.unfinished = set(self.ids)
        self.queued = set(self.ids)  # counted in state.num_queued until their first token
        self.first_token_time = {}
        self.token_counts = {}  # request id -> {choice index: tokens generated so far}
        self.delta = True  # outputs hold only what is new since the previous one (set by start)
        self.closed = False
        self.watcher = None

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def start(self, every_step: bool):
        """Submit the engine requests. every_step=False for a non-streamed answer: the handler then hears of each
        request only at its first token (for the queue count and the TTFT metric) and when it finishes."""
        state = self.state
        self.delta = every_step
        if not state.engine.alive:
            raise APIError("the engine loop is not running", status=503, type="server_error", code="engine_dead")
        if state.max_queue is not None and state.num_queued + len(self.ids) > state.max_queue:
            state.metrics.count_overload()
            raise APIError(f"the server is overloaded: {state.num_queued} prompts are waiting "
                           f"(--max-queue {state.max_queue}); retry later",
                           status=503, type="server_overloaded", code="overloaded", headers={"Retry-After": "1"})
        state.num_queued += len(self.ids)
        state.open_generations.add(self)
        sink = Sink(asyncio.get_running_loop(), self.queue)
        for rid, prompt in zip(self.ids, self.prompts):
            state.engine.submit(rid, prompt, self.params, sink, every_step=every_step)
        self.watcher = asyncio.create_task(self._watch_disconnect())

    async def _watch_disconnect(self):
        try:
            while True:
                message = await self.raw_request.receive()
                if message["type"] == "http.disconnect":
                    break
        except Exception:
            pass
        if not self.closed:
            self.close(from_watcher=True)
            self.queue.put_nowait((None, _DISCONNECT))

    def _dequeue(self, rid):
        if rid in self.queued:
            self.queued.discard(rid)
            self.state.num_queued -= 1

    def close(self, from_watcher=False):
        """Abort what is still running (its KV blocks go back to the pool) and stop watching."""
        if self.closed:
            return
        self.closed = True
        self.state.open_generations.discard(self)
        for rid in self.unfinished:
            self.state.engine.abort(rid)
        for rid in list(self.queued):
            self._dequeue(rid)
        if self.watcher is not None and not from_watcher:
            self.watcher.cancel()

    async def results(self):
        """Yield (prompt index, RequestOutput) as the engine produces them, until all finish."""
        try:
            while self.unfinished:
                rid, item = await self.queue.get()
                if item is _DISCONNECT:
                    raise Disconnected()
                if isinstance(item, APIError):
                    raise item
                if isinstance(item, Exception):
                    self.unfinished.discard(rid)
                    if isinstance(item, ValueError):
                        raise APIError(str(item))
                    raise APIError(str(item), status=500, type="server_error")
                self._account(rid, item)
                yield self.index[rid], item
        finally:
            self.close()

    def num_tokens(self, rid, index) -> int:
        """Tokens generated so far by choice `index` of engine request `rid`."""
        return self.token_counts.get(rid, {}).get(index, 0)

    def _account(self, rid, out):
        t = time.monotonic()
        counts = self.token_counts.setdefault(rid, {})
        for c in out.outputs:
            counts[c.index] = len(c.token_ids) + (counts.get(c.index, 0) if self.delta else 0)
        if rid not in self.first_token_time and any(counts.values()):
            self.first_token_time[rid] = t
            self._dequeue(rid)
        if out.finished:
            self.unfinished.discard(rid)
            self._dequeue(rid)
            first = self.first_token_time.get(rid)
            num = max(counts.values(), default=0)
            tpot = (t - first) / (num - 1) if first is not None and num > 1 else None
            self.state.metrics.observe_request(
                None if first is None else first - self.arrival, tpot, t - self.arrival,
                len(self.prompts[self.index[rid]]), [c.finish_reason for c in out.outputs])


# --- mapping requests ---------------------------------------------------------------------------


def _check_model(state: ServerState, model: str | None):
    if model is not None and model != state.model_name:
        raise APIError(f"the model {model!r} does not exist; this server serves {state.model_name!r}",
                       status=404, param="model", code="model_not_found")


def _reject_unless(condition: bool, param: str, message: str):
    if not condition:
        raise APIError(message, param=param, code="unsupported_parameter")


def _need_tokenizer(state: ServerState, condition: bool, param: str, what: str):
    """Refuse `what` (a request needing text) when the model has no tokenizer."""
    if condition and not state.has_tokenizer:
        raise APIError(f"this model has no tokenizer (dummy weights): {what}", param=param)


def _check_completion_needs_no_text(state: ServerState, req: P.CompletionRequest):
    """What a completion cannot have from a model without a tokenizer: stop strings, and log-probs (their tokens
    are text). Its prompts are checked as they are tokenized."""
    _need_tokenizer(state, bool(req.stop), "stop", "stop strings cannot be matched; use stop_token_ids")
    _need_tokenizer(state, req.logprobs is not None, "logprobs", "log-probs name their tokens as text")


def _sampling_params(req, max_tokens, logprobs, max_tokens_field="max_tokens") -> SamplingParams:
    """max_tokens_field: the request field max_tokens came from (chat's max_completion_tokens), for the error."""
    # as vLLM: an empty object passes (some clients always send `stream_options: {}`)
    _reject_unless(req.stream or req.stream_options is None or not req.stream_options.model_fields_set,
                   "stream_options", "stream_options is only allowed when stream is true")
    logit_bias = None
    if req.logit_bias:  # OpenAI's keys are token ids as strings
        if len(req.logit_bias) > MAX_TOKEN_IDS:
            raise APIError(f"logit_bias takes at most {MAX_TOKEN_IDS} entries, got {len(req.logit_bias)}",
                           param="logit_bias")
        if not all(k.strip().isascii() and k.strip().isdigit() for k in req.logit_bias):
            raise APIError(f"logit_bias keys must be token ids, got {[k for k in req.logit_bias][:5]}",
                           param="logit_bias")
        logit_bias = {int(k): v for k, v in req.logit_bias.items()}
        if len(logit_bias) < len(req.logit_bias):
            raise APIError("logit_bias names a token id twice (e.g. '7' and '07')", param="logit_bias")
    if req.stop_token_ids is not None and len(req.stop_token_ids) > MAX_TOKEN_IDS:
        raise APIError(f"stop_token_ids takes at most {MAX_TOKEN_IDS} ids, got {len(req.stop_token_ids)}",
                       param="stop_token_ids")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOP_STRINGS or any(len(x) > MAX_STOP_CHARS for x in stops):
        raise APIError(f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters, "
                       f"got {len(stops)} (the longest {max(map(len, stops))})", param="stop")
    if req.seed is not None and not -2**63 <= req.seed < 2**63:
        raise APIError(f"seed must be a 64-bit integer, got {req.seed}", param="seed")
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=None if req.seed is None else req.seed % 2**63,  # any int64, as vLLM takes (clients send -1)
            max_tokens=max_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=logit_bias,
            min_tokens=req.min_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
    except ValueError as e:  # SamplingParams' messages start with the field name
        field = str(e).split()[0]
        if field == "max_tokens":  # named as the client sent it
            raise APIError(str(e).replace(field, max_tokens_field, 1), param=max_tokens_field) from None
        raise APIError(str(e), param=field) from None


def _check_limits(state: ServerState, params: SamplingParams, num_prompts: int):
    """What the engine would refuse, refused here, so that it never fails a step shared with other requests; before
    the prompts are tokenized."""
    if params.n > state.max_num_seqs:  # a prompt's samples run together; the prompts of a list queue as requests do
        raise APIError(f"n = {params.n} exceeds this server's max_num_seqs ({state.max_num_seqs}): the samples of "
                       f"a prompt run together", param="n")
    if state.max_queue is not None and num_prompts > state.max_queue:
        raise APIError(f"this request has {num_prompts} prompts and the server queues at most "
                       f"{state.max_queue} (--max-queue): send fewer prompts per request", param="prompt")
    try:
        params.check_vocabulary(state.vocab_size)  # the engine's own rule
    except ValueError as e:  # its messages start with the field name
        raise APIError(str(e), param=str(e).split("=")[0].split()[0]) from None


def chars_per_token_bound(tokenizer) -> int:
    """How many characters one token may stand for, at most (MAX_CHARS_PER_TOKEN's comment). A vocabulary's token
    strings have a character per byte (byte-level BPE) or per character (SentencePiece), so none is shorter than
    its text."""
    if tokenizer is None:
        return MAX_CHARS_PER_TOKEN
    return max(MAX_CHARS_PER_TOKEN, 2 * max((len(t) for t in tokenizer.get_vocab()), default=0))


def _check_chars(state: ServerState, num_chars: int, param: str):
    limit = state.max_chars_per_token * state.max_model_len
    if num_chars > limit:
        raise APIError(f"the prompt has {num_chars} characters, more than {state.max_chars_per_token} per token of this "
                       f"model's maximum context length ({state.max_model_len} tokens): it cannot fit", param=param,
                       code="context_length_exceeded")


def _template_call_params(tokenizer) -> frozenset:
    """apply_chat_template's own parameters (chat_template, tokenize, tools, ...): chat_template_kwargs may not set
    them, only the template's variables (e.g. enable_thinking). A client's own template could run for ever on a
    tokenizer worker."""
    try:
        params = inspect.signature(tokenizer.apply_chat_template).parameters
    except (TypeError, ValueError, AttributeError):
        params = {}
    names = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    # and render_chat's own (engine/chat.py), which the server passes beside them
    return frozenset(names | {"chat_template", "tokenize", "tools", "documents", "messages", "tokenizer"})


def _check_template_kwargs(state: ServerState, kwargs: dict | None):
    bad = sorted(set(kwargs or {}) & state.template_call_params)
    if bad:
        raise APIError(f"chat_template_kwargs may set the chat template's variables only, not {bad} "
                       "(parameters of apply_chat_template)", param="chat_template_kwargs")


def _check_length(state: ServerState, prompts: list[list[int]], max_tokens: int | None, min_tokens: int,
                  max_tokens_param: str = "max_tokens", prompt_param: str = "prompt"):
    for ids in prompts:
        if not ids:
            raise APIError("the prompt is empty", param=prompt_param)
        if len(ids) >= state.max_model_len:
            raise APIError(f"this model's maximum context length is {state.max_model_len} tokens, but the prompt "
                           f"has {len(ids)} tokens (no room left to generate)", param=prompt_param,
                           code="context_length_exceeded")
        if max_tokens is not None and len(ids) + max_tokens > state.max_model_len:
            raise APIError(f"this model's maximum context length is {state.max_model_len} tokens, but "
                           f"{len(ids) + max_tokens} were requested ({len(ids)} in the prompt, {max_tokens} "
                           f"{max_tokens_param})", param=max_tokens_param, code="context_length_exceeded")
        if len(ids) + min_tokens > state.max_model_len:  # with max_tokens null, what the context leaves
            raise APIError(f"min_tokens={min_tokens} does not fit this model's maximum context length of "
                           f"{state.max_model_len} tokens after the prompt's {len(ids)}", param="min_tokens",
                           code="context_length_exceeded")


def _prompt_list(prompt) -> list:
    """A completion request's prompts: one string or token-id list, or a list of them."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise APIError("prompt is empty", param="prompt")
    return prompt


async def _completion_prompts(state: ServerState, prompt: list, check) -> list[list[int]]:
    """Each prompt as token ids, checked (`check(ids)`) as soon as it is: a long list stops at its first bad one."""
    out = []
    for p in prompt:
        if isinstance(p, str):
            if not p:
                raise APIError("prompt is empty", param="prompt")
            _need_tokenizer(state, True, "prompt", "send the prompt as a list of token ids")
            _check_chars(state, len(p), "prompt")
            _check_unicode(p, "the prompt", "prompt")
            try:
                out.append(await state.tokenizers.run(state.tokenizers.encode, p))
            except (TypeError, ValueError) as e:  # e.g. a lone surrogate, which UTF-8 cannot encode
                raise APIError(f"cannot tokenize the prompt: {e}", param="prompt") from None
        else:
            bad = [t for t in p if not 0 <= t < state.vocab_size]
            if bad:
                raise APIError(f"prompt token ids outside the vocabulary [0, {state.vocab_size}): {bad[:5]}",
                               param="prompt")
            out.append(list(p))
        check(out[-1])
    return out


def _template_chars(messages: list[dict], template_kwargs: dict | None) -> int:
    """The characters the chat template gets: every message's fields (role, content, name, tool calls) and its
    variables (tools among them)."""
    return (sum(len(v) if isinstance(v, str) else len(json.dumps(v, ensure_ascii=False))
                for m in messages for v in m.values())
            + len(json.dumps(template_kwargs or {}, ensure_ascii=False)))


def _chat_messages(req: P.ChatCompletionRequest) -> list[dict]:
    if not req.messages:
        raise APIError("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(req.messages):
        content = _content_text(m.content, i)
        message = {"role": m.role, "content": content if content is not None else ""}
        if m.name is not None:
            message["name"] = m.name
        for key in ("content", "name"):
            _check_unicode(message.get(key, ""), f"messages[{i}].{key}", f"messages.{i}.{key}")
        message.update(_tool_fields(m, i))
        out.append(message)
    return out


# content part types that hold text: OpenAI's, the Responses API's spelling, and an earlier turn's refusal
_TEXT_PARTS = {"text": "text", "input_text": "text", "refusal": "refusal"}


def _content_text(content, i: int):
    """A message's content as one string: text parts joined by newlines (as vLLM joins them, so that parts do not
    run into each other)."""
    if not isinstance(content, list):
        return content
    texts = []
    for j, part in enumerate(content):
        field = _TEXT_PARTS.get(part.type)
        if field is None:
            raise APIError(f"messages[{i}]: only text content parts are supported, got {part.type!r}",
                           param=f"messages.{i}.content", code="unsupported_parameter")
        text = getattr(part, field)
        if text is None:
            raise APIError(f"messages[{i}].content[{j}]: a {part.type!r} part needs its {field!r} field",
                           param=f"messages.{i}.content.{j}.{field}")
        texts.append(text)
    return "\n".join(texts)


def _check_unicode(text: str, where: str, param: str):
    """A lone surrogate (JSON allows "\\ud800") cannot be encoded, so the tokenizer would refuse it with its own
    words."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(f"{where} is not valid Unicode text (a lone surrogate)", param=param) from None


def _check_unimplemented_extras(req):
    for name, neutral in P.UNIMPLEMENTED_EXTRAS.items():
        _reject_unless(getattr(req, name) in neutral, name, f"{name} is not supported")


def _chat_tools(req: P.ChatCompletionRequest, exclude_when_none: bool = False) -> list | None:
    """The tools the template gets: `tools`, and the deprecated `functions` in tools' form. Only with tool_choice
    (function_call) "none": the server parses no tool calls, so it takes them only where the client says so
    (agent frameworks often send them every time). exclude_when_none (vLLM's --exclude-tools-when-tool-choice-none):
    the template gets none of them, as the client said "none"; the checks stay, and earlier turns' tool calls and
    results still reach the template (as in vLLM, which drops only the tool definitions)."""
    functions = [{"type": "function", "function": f} for f in req.functions or []]
    _reject_unless(not req.tools or req.tool_choice == "none", "tools",
                   'tools are supported with tool_choice "none" only (this server does not parse tool calls)')
    _reject_unless(req.tool_choice in (None, "none"), "tool_choice", 'tool_choice other than "none" is not '
                   "supported")
    _reject_unless(not functions or req.function_call == "none", "functions",
                   'functions are supported with function_call "none" only (this server does not parse calls)')
    _reject_unless(req.function_call in (None, "none"), "function_call", 'function_call other than "none" is not '
                   "supported")
    if exclude_when_none:  # every tool taken above came with tool_choice (function_call) "none"
        return None
    return (req.tools or []) + functions or None


def _tool_fields(m: P.ChatMessage, i: int) -> dict:
    """An earlier turn's tool calls and a tool result's call id, for the chat template (which reads them where the
    model knows tools). OpenAI sends a call's arguments as a JSON string; HF templates take a dict, which vLLM
    passes: arguments missing, empty or not JSON become {} as there (a bad call in the history must not lock the
    conversation out), and an empty list of calls is dropped (Llama 3's template refuses it)."""
    extra = m.model_extra or {}
    fields = {k: extra[k] for k in ("tool_calls", "tool_call_id") if extra.get(k) is not None}
    calls = fields.get("tool_calls")
    if calls is None:
        return fields
    if not isinstance(calls, list):
        raise APIError(f"messages[{i}].tool_calls must be a list, got {type(calls).__name__}", param=f"messages.{i}")
    if not calls:
        del fields["tool_calls"]
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise APIError(f"messages[{i}].tool_calls[{j}] must be an object with a function",
                           param=f"messages.{i}")
        arguments = function.get("arguments")
        if not isinstance(arguments, dict):
            function["arguments"] = _json_object(arguments, f"messages[{i}].tool_calls[{j}]")
    return fields


def _json_object(text, where: str) -> dict:
    try:
        value = json.loads(text) if isinstance(text, str) and text.strip() else {}
    except (ValueError, RecursionError):  # not JSON, too deep, a number too long to parse
        value = None
    if not isinstance(value, dict):
        log.warning("%s: function.arguments is not a JSON object; the template gets {}", where)
        return {}
    return value


# --- building responses -------------------------------------------------------------------------


def _top(entry: dict, k: int) -> list:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


class TextPosition:
    """Where a completion's next token starts in its text (`text_offset`, in characters): the characters its tokens'
    bytes complete, a token holding part of a multi-byte character adding none until a later one completes it."""

    def __init__(self):
        self.offset = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, token_bytes: list[int]):
        self.offset += len(self._decoder.decode(bytes(token_bytes)))


def _completion_logprobs(state, token_ids, logprobs, k, position: TextPosition) -> P.CompletionLogprobs:
    out = P.CompletionLogprobs()
    name = functools.partial(_token_name, state.tokenizers)
    for tid, entry in zip(token_ids, logprobs):
        s = name(tid)
        out.tokens.append(s)
        out.token_logprobs.append(entry[tid])
        # the k most likely and, as OpenAI's legacy API promises, the sampled token's own (up to k + 1)
        top = {name(t): lp for t, lp in _top(entry, k)}
        top.setdefault(s, entry[tid])
        out.top_logprobs.append(top)
        out.text_offset.append(position.offset)
        position.advance(state.tokenizers.token_bytes(tid))
    return out


def _token_name(tokenizers, token_id) -> str:
    """A token's text; for one holding part of a UTF-8 character (whose text alone is U+FFFD), OpenAI's
    "bytes:\\xNN..." naming of its bytes, so that such tokens stay apart."""
    text = tokenizers.token_text(token_id)
    if "\ufffd" in text:
        raw = bytes(tokenizers.token_bytes(token_id))
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text


def _chat_logprobs(state, token_ids, logprobs, k) -> P.ChatLogprobs:
    text = state.tokenizers.token_text

    def item(cls, tid, lp, **extra):
        s = text(tid)
        return cls(token=s, logprob=lp, bytes=state.tokenizers.token_bytes(tid), **extra)

    content = [
        item(P.TokenLogprob, tid, entry[tid], top_logprobs=[item(P.TopLogprob, t, lp) for t, lp in _top(entry, k)])
        for tid, entry in zip(token_ids, logprobs)
    ]
    return P.ChatLogprobs(content=content)


def _usage(gen: Generation, completion_tokens: int) -> P.Usage:
    return P.Usage(prompt_tokens=gen.prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=gen.prompt_tokens + completion_tokens)


# Characters that end a line for Python's str.splitlines() (httpx's iter_lines, requests' iter_lines with
# decode_unicode) but not for SSE: written raw into an event, they would cut it in two for such readers
# (the ASCII ones among them are control characters, which JSON escapes anyway)
_LINE_BREAKS_TO_ESCAPE = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def _wants_usage(req) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _sse(model: P.BaseModel, with_usage: bool = True) -> str:
    """One event. Without stream_options.include_usage a chunk has no usage field at all (OpenAI: it is "only
    present" when asked for, then null but in the last chunk; vLLM leaves it out too)."""
    body = model.model_dump_json(exclude=None if with_usage else {"usage"})
    return f"data: {body.translate(_LINE_BREAKS_TO_ESCAPE)}\n\n"


def _sse_error(e: APIError) -> str:
    return f"data: {json.dumps(e.body())}\n\n"  # json.dumps escapes every non-ASCII and control character


def _stop_reason(c):
    return c.stop_reason if isinstance(c.stop_reason, (int, str)) else None


# --- the app ------------------------------------------------------------------------------------


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_type_tag(loc_part: str) -> bool:
    """pydantic names the union member that failed in an error's location ("prompt.str", "stop.list[str]"); the
    field is what a client needs."""
    return loc_part in _TYPE_TAGS or "[" in loc_part


# CORS: the keyword for pages served from this machine (localhost, 127.0.0.1, [::1], any port or scheme); any
# other web page the user has open is refused, since the server has no API keys
LOCAL_ORIGINS = "local"
_LOCAL_ORIGIN_RE = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"


def _cors_options(allowed_origins) -> dict | None:
    """CORSMiddleware's arguments for the allowed origins (origins, "*", LOCAL_ORIGINS); None for none."""
    origins = [o for o in allowed_origins if o != LOCAL_ORIGINS]
    regex = _LOCAL_ORIGIN_RE if LOCAL_ORIGINS in allowed_origins else None
    if not origins and regex is None:
        return None
    return dict(allow_origins=origins, allow_origin_regex=regex, allow_methods=["*"], allow_headers=["*"])


def build_app(async_engine: AsyncEngine, model_name: str, max_queue: int | None = None,
              tokenizer_workers: int = 2, allowed_origins=(LOCAL_ORIGINS,),
              exclude_tools_when_tool_choice_none: bool = False) -> FastAPI:
    """The ASGI app around a started engine loop: an AsyncEngine (this process) or an EngineProcess (its own).
    allowed_origins: the web origins whose pages may call the API from a browser (CORS): origins, "*" (any) or
    LOCAL_ORIGINS; empty, none. exclude_tools_when_tool_choice_none: the chat template never gets a request's tools
    (vLLM's flag; here tools come only with tool_choice "none")."""
    state = ServerState(async_engine, model_name, max_queue, tokenizer_workers, exclude_tools_when_tool_choice_none)
    cors = _cors_options(allowed_origins)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        state.tokenizers.shutdown()

    app = FastAPI(title="eightbit", version="0.1.0", lifespan=lifespan)
    app.state.server = state
    app.add_middleware(_CountResponses, metrics=state.metrics)
    if cors:  # added last, so outermost: a browser's preflight (OPTIONS) is answered, and not counted
        app.add_middleware(CORSMiddleware, **cors)
    # the 500 of an unhandled error is made outside every middleware (Starlette's), so it adds CORS's header itself:
    # a browser shows a failed call's body only with it
    cors_check = CORSMiddleware(None, **cors) if cors else None

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            message = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
            param = None
        elif not loc and "json" not in request.headers.get("content-type", ""):
            # FastAPI reads a body of another content type as a string: "Input should be a valid dictionary"
            message, param = "the body must be a JSON object, sent with Content-Type: application/json", None
        else:
            param = ".".join(x for x in loc if not _is_type_tag(x)) or None
            message = f"{param or 'body'}: {first.get('msg', 'invalid request')}"
            if len(errors) > 1:
                message += f" (and {len(errors) - 1} more errors)"
        return JSONResponse(APIError(message, param=param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        if isinstance(e.__cause__, ClientDisconnect):  # gone while its body was read: no bad body, and nobody to tell
            return Response(status_code=499)
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        message = str(e.detail)
        if e.status_code == 400 and e.__cause__ is not None:  # FastAPI's "There was an error parsing the body"
            # (bytes that are not UTF-8, JSON nested too deep, a number of too many digits): say which
            message = f"malformed JSON body: {type(e.__cause__).__name__}: {e.__cause__}"[:500]
        return JSONResponse(APIError(message, status=e.status_code, type=type_).body(),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("unhandled error")  # the details go to the log, not to the client
        origin = request.headers.get("origin")
        headers = None
        if cors_check is not None and origin and cors_check.is_allowed_origin(origin):
            headers = {"access-control-allow-origin": "*" if cors_check.allow_all_origins else origin, "vary": "Origin"}
        return JSONResponse(APIError("internal server error", status=500, type="server_error").body(),
                            status_code=500, headers=headers)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if not async_engine.alive:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.render(async_engine.stats),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card():
        return P.ModelCard(id=state.model_name, created=state.created, max_model_len=state.max_model_len)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        return P.ModelList(data=[model_card()])

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])  # :path: ids have slashes ("org/name")
    async def model(model_id: str):
        _check_model(state, model_id)
        return model_card()

    @app.post("/v1/completions")
    async def completions(req: P.CompletionRequest, raw_request: Request):
        arrival = time.monotonic()
        _check_model(state, req.model)
        _reject_unless(not req.echo, "echo", "echo is not supported")
        _reject_unless(req.suffix is None, "suffix", "suffix is not supported")
        _reject_unless(req.best_of in (None, req.n), "best_of", "best_of other than n is not supported")
        _check_unimplemented_extras(req)
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise APIError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}", param="logprobs")
        _check_completion_needs_no_text(state, req)
        params = _sampling_params(req, req.max_tokens, req.logprobs)
        prompts = _prompt_list(req.prompt)
        _check_limits(state, params, len(prompts))
        prompts = await _completion_prompts(
            state, prompts, lambda ids: _check_length(state, [ids], req.max_tokens, params.min_tokens))
        request_id = P.random_id("cmpl")
        gen = Generation(state, request_id, prompts, params, raw_request, arrival)
        gen.start(every_step=bool(req.stream))
        created, n = P.now(), params.n
        if req.stream:
            return StreamingResponse(_stream_completion(state, gen, req, request_id, created),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        finals = {}
        try:
            async for i, out in gen.results():
                if out.finished:
                    finals[i] = out
        except Disconnected:
            return Response(status_code=499)
        choices, completion_tokens = [], 0
        for i in range(len(prompts)):
            for c in finals[i].outputs:
                completion_tokens += len(c.token_ids)
                lp = None
                if req.logprobs is not None:
                    lp = _completion_logprobs(state, c.token_ids, c.logprobs, req.logprobs, TextPosition())
                choices.append(P.CompletionChoice(index=i * n + c.index, text=c.text, logprobs=lp,
                                                  finish_reason=c.finish_reason, stop_reason=_stop_reason(c)))
        return P.CompletionResponse(id=request_id, created=created, model=state.model_name, choices=choices,
                                    usage=_usage(gen, completion_tokens))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: P.ChatCompletionRequest, raw_request: Request):
        arrival = time.monotonic()
        _check_model(state, req.model)
        _need_tokenizer(state, True, "messages", "chat needs its chat template and tokenizer; use /v1/completions "
                        "with token-id prompts")
        messages = _chat_messages(req)
        # they reach the chat template (the model may read them), unless the server excludes them; never called
        tools = _chat_tools(req, state.exclude_tools_when_tool_choice_none)
        _reject_unless(req.response_format is None or req.response_format.get("type") == "text",
                       "response_format", "only response_format {\"type\": \"text\"} is supported")
        _reject_unless(not req.echo, "echo", "echo is not supported")
        _check_unimplemented_extras(req)
        if req.continue_final_message and req.add_generation_prompt:
            raise APIError("continue_final_message needs add_generation_prompt: false", param="continue_final_message")
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
            if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
                raise APIError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                               param="top_logprobs")
        max_tokens_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = getattr(req, max_tokens_field)
        top_k = (req.top_logprobs or 0) if req.logprobs else None
        params = _sampling_params(req, max_tokens, top_k, max_tokens_field)
        _check_limits(state, params, 1)
        _check_template_kwargs(state, req.chat_template_kwargs)
        template_kwargs = dict(req.chat_template_kwargs or {}, **({"tools": tools} if tools else {}))
        _check_chars(state, _template_chars(messages, template_kwargs), "messages")
        if req.continue_final_message:  # apply_chat_template's own option (after the count: it is not text)
            template_kwargs["continue_final_message"] = True
        try:
            prompt = await state.tokenizers.run(state.tokenizers.chat_prompt, messages, req.add_generation_prompt,
                                                template_kwargs)
        except Exception as e:  # the template rejects the conversation (roles out of order, ...)
            reason = str(e)
            reason = reason if len(reason) <= 500 else reason[:500] + " ..."  # HF's may quote the whole prompt
            raise APIError(f"cannot apply the chat template: {reason}", param="messages") from None
        _check_length(state, [prompt], max_tokens, params.min_tokens, max_tokens_field, "messages")
        request_id = P.random_id("chatcmpl")
        gen = Generation(state, request_id, [prompt], params, raw_request, arrival)
        gen.start(every_step=bool(req.stream))
        created = P.now()
        if req.stream:
            return StreamingResponse(_stream_chat(state, gen, req, request_id, created, top_k),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        final = None
        try:
            async for _, out in gen.results():
                if out.finished:
                    final = out
        except Disconnected:
            return Response(status_code=499)
        choices, completion_tokens = [], 0
        for c in final.outputs:
            completion_tokens += len(c.token_ids)
            lp = _chat_logprobs(state, c.token_ids, c.logprobs, top_k) if top_k is not None else None
            choices.append(P.ChatChoice(index=c.index, message=P.AssistantMessage(content=c.text), logprobs=lp,
                                        finish_reason=c.finish_reason, stop_reason=_stop_reason(c)))
        return P.ChatCompletionResponse(id=request_id, created=created, model=state.model_name, choices=choices,
                                        usage=_usage(gen, completion_tokens))

    return app


class _CountResponses:
    """Pure ASGI middleware counting responses by endpoint and status (streams pass through untouched)."""

    ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if path.startswith("/v1/models/"):
            path = "/v1/models/{id}"  # one label for every id, so a client cannot grow the metric without bound
        elif path not in self.ENDPOINTS:
            path = "other"

        started = False

        async def counting_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.count_response(path, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            # an unhandled error: Starlette's outermost middleware, outside this one, turns it into the 500
            if not started:
                self.metrics.count_response(path, 500)
            raise


def _unsent(unsent: dict, key, c) -> tuple[list, list]:
    """The tokens and log-probs of choice `key` not yet sent, with this (delta) output's appended."""
    ids, lps = unsent.setdefault(key, ([], []))
    ids += c.token_ids
    lps += c.logprobs or []
    return ids, lps


async def _stream_completion(state, gen: Generation, req, request_id, created):
    n, k = gen.params.n, req.logprobs
    unsent, token_offset, done = {}, {}, set()
    completion_tokens = 0
    with_usage = _wants_usage(req)
    try:
        async for i, out in gen.results():
            for c in out.outputs:
                key = (i, c.index)
                ids, lps = _unsent(unsent, key, c)
                if key in done or not (c.delta or c.finish_reason or (ids and not state.has_tokenizer)):
                    continue  # text held back (a partial character or stop string): its tokens wait too
                del unsent[key]
                lp = None
                if k is not None:
                    # running over the tokens, as without streaming
                    lp = _completion_logprobs(state, ids, lps, k, token_offset.setdefault(key, TextPosition()))
                if c.finish_reason:
                    done.add(key)
                    completion_tokens += gen.num_tokens(gen.ids[i], c.index)
                choice = P.CompletionChoice(index=i * n + c.index, text=c.delta, logprobs=lp,
                                            finish_reason=c.finish_reason, stop_reason=_stop_reason(c))
                yield _sse(P.CompletionResponse(id=request_id, created=created, model=state.model_name,
                                                choices=[choice]), with_usage)
        if with_usage:
            yield _sse(P.CompletionResponse(id=request_id, created=created, model=state.model_name, choices=[],
                                            usage=_usage(gen, completion_tokens)))
    except Disconnected:
        return
    except APIError as e:
        yield _sse_error(e)
    yield "data: [DONE]\n\n"


async def _stream_chat(state, gen: Generation, req, request_id, created, k):
    n = gen.params.n
    unsent, done = {}, set()
    completion_tokens = 0

    with_usage = _wants_usage(req)

    def chunk(choices, usage=None):
        return _sse(P.ChatCompletionChunk(id=request_id, created=created, model=state.model_name, choices=choices,
                                          usage=usage), with_usage)

    try:
        yield chunk([P.ChatChunkChoice(index=i, delta=P.DeltaMessage(role="assistant", content=""))
                     for i in range(n)])
        async for _, out in gen.results():
            for c in out.outputs:
                ids, lps = _unsent(unsent, c.index, c)
                if c.index in done or not (c.delta or c.finish_reason):
                    continue  # text held back: its tokens wait too
                del unsent[c.index]
                lp = None
                if k is not None:
                    lp = _chat_logprobs(state, ids, lps, k)
                if c.finish_reason:
                    done.add(c.index)
                    completion_tokens += gen.num_tokens(gen.ids[0], c.index)
                delta = P.DeltaMessage(content=c.delta) if c.delta else P.DeltaMessage()
                yield chunk([P.ChatChunkChoice(index=c.index, delta=delta, logprobs=lp,
                                               finish_reason=c.finish_reason, stop_reason=_stop_reason(c))])
        if with_usage:
            yield chunk([], usage=_usage(gen, completion_tokens))
    except Disconnected:
        return
    except APIError as e:
        yield _sse_error(e)
    yield "data: [DONE]\n\n"
