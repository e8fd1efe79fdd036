"""What the engine hands back: vLLM's RequestOutput / CompletionOutput shapes."""

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str  # all text released so far (final text once finished)
    token_ids: list  # all so far; for a request added with delta=True, those since its previous output
    cumulative_logprob: float | None = None
    logprobs: list | None = None  # per token of token_ids {token_id: logprob}, when asked for
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: object = None  # the stop string or stop token id, if one ended it
    delta: str = ""  # text released by the step that produced this output (a final-only request: all its text)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list
    prompt_logprobs: list | None
    outputs: list = field(default_factory=list)
    finished: bool = False
