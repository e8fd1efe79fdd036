"""Request and response bodies of the OpenAI-compatible API (the subset eightbit serves).

Request models ignore fields they do not know (clients send extras; the first request with a field of a new name
logs it); integer fields are strict (a JSON true, false or 3.0 is a 400, not 1, 0 or 3: `"logprobs": false` must not
ask for log-probs); fields that would change the output but are not implemented (OpenAI's, and vLLM's in
UNIMPLEMENTED_EXTRAS) are accepted only at their neutral value and rejected with a 400 otherwise (see api.py), so
that a client relying on one gets an error rather than an answer that ignores it. vLLM-style extras (top_k, min_p,
ignore_eos, stop_token_ids, skip_special_tokens) ride in the body, e.g. via the openai client's ``extra_body``.
"""

import logging
import time
import typing
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, create_model, model_serializer, model_validator

log = logging.getLogger("eightbit.server")


class APIError(Exception):
    """Becomes an OpenAI-style error body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# --- requests --------------------------------------------------------------------------------


class _Request(BaseModel):
    """A request body: unknown fields ignored, and null taken as the default for an optional field whose type has
    no null of its own (OpenAI's schema marks `n`, `stream`, `echo`, `logprobs` ... nullable, and clients send
    `"n": null`); where the type has one (`max_tokens`: null is no limit), null keeps its meaning."""
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        _log_new_unknown_fields(cls, data)
        return {k: v for k, v in data.items()
                if v is not None or k not in fields or fields[k].is_required() or _nullable(fields[k].annotation)}


_unknown_fields_logged: set = set()
MAX_UNKNOWN_FIELDS_LOGGED = 100  # a client sending made-up names must not grow the set, or the log, without bound


def _log_new_unknown_fields(cls, data: dict):
    """Log the request fields this server ignores, each name once per process (clients send the same ones with
    every request), the first MAX_UNKNOWN_FIELDS_LOGGED names only."""
    room = MAX_UNKNOWN_FIELDS_LOGGED - len(_unknown_fields_logged)
    if room <= 0:
        return
    names = {str(k)[:64] for k in data if k not in cls.model_fields}
    new = sorted(k for k in names if (cls.__name__, k) not in _unknown_fields_logged)[:room]
    if new:
        _unknown_fields_logged.update((cls.__name__, k) for k in new)
        last = len(_unknown_fields_logged) >= MAX_UNKNOWN_FIELDS_LOGGED
        log.warning("%s: ignoring field(s) this server does not use: %s%s", cls.__name__,
                    ", ".join(map(ascii, new)),  # escaped: a name with a newline must not forge a log line
                    " (no more unknown fields will be logged)" if last else "")


def _nullable(annotation) -> bool:
    return annotation is None or type(None) in typing.get_args(annotation)


class StreamOptions(_Request):
    include_usage: bool = False


# vLLM extras that change the output and are not implemented, each with the values that leave the output as it
# would be without it; declared as fields (any type, default null) so that api.py can refuse the others
UNIMPLEMENTED_EXTRAS = {
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,), "allowed_token_ids": (None,), "bad_words": (None, []),
    "prompt_logprobs": (None,), "use_beam_search": (None, False), "length_penalty": (None, 1.0),
    "truncate_prompt_tokens": (None,), "return_tokens_as_token_ids": (None, False),
}
_UnimplementedExtras = create_model("_UnimplementedExtras", __base__=_Request,
                                    **{name: (Any, None) for name in UNIMPLEMENTED_EXTRAS})


class _SamplingFields(_UnimplementedExtras):

    model: str | None = None
    n: StrictInt = 1
    temperature: float | None = None  # None: 1.0 (OpenAI's default)
    top_p: float | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM-style extras
    top_k: StrictInt | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: bool = True
    repetition_penalty: float | None = None
    min_tokens: StrictInt = 0
    include_stop_str_in_output: bool = False


class CompletionRequest(_SamplingFields):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: bool = False
    best_of: StrictInt | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    refusal: str | None = None  # a "refusal" part of an earlier assistant turn


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    functions: list[dict] | None = None  # the deprecated form of tools ...
    function_call: str | dict | None = None  # ... and of tool_choice
    response_format: dict | None = None
    add_generation_prompt: bool = True  # vLLM extra
    continue_final_message: bool = False  # vLLM extra: the last (assistant) message is continued, not closed
    chat_template_kwargs: dict | None = None  # vLLM extra, passed to apply_chat_template
    echo: bool = False  # vLLM extra (the last message echoed back), not implemented


# --- responses -------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    system_fingerprint: str | None = None
    usage: Usage | None = None


class DeltaMessage(BaseModel):
    """A stream chunk's delta: only the fields it carries are sent (as OpenAI does)."""

    role: str | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    system_fingerprint: str | None = None
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "eightbit"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
