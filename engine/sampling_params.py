"""Per-request sampling settings, named and defaulted as in vLLM's ``SamplingParams``."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields


def is_bool(x) -> bool:
    # numpy's bool is no Python bool (numpy.bool_, named numpy.bool since numpy 2)
    return isinstance(x, bool) or (type(x).__module__ == "numpy" and type(x).__name__ in ("bool", "bool_"))


def is_int(x) -> bool:
    """An integer of any kind (Python, numpy), not a bool."""
    return isinstance(x, numbers.Integral) and not is_bool(x)


def is_finite_number(x) -> bool:
    """A finite real number of any kind (Python, numpy), not a bool."""
    return isinstance(x, numbers.Real) and not is_bool(x) and math.isfinite(x)


def fields_as_python_numbers(obj) -> None:
    """A dataclass's fields that hold numpy bools, ints or floats (already checked) become Python ones, which is
    what the engine computes with (SamplingParams, EngineConfig)."""
    for f in fields(obj):
        v = getattr(obj, f.name)
        if is_bool(v):
            setattr(obj, f.name, bool(v))
        elif is_int(v):
            setattr(obj, f.name, int(v))
        elif is_finite_number(v):
            setattr(obj, f.name, float(v))


GREEDY_BELOW = 1e-5  # temperatures under this sample greedily, as in vLLM


@dataclass
class SamplingParams:
    """How to pick the tokens of one request.

    ``temperature == 0`` (any below 1e-5, as in vLLM) means greedy (argmax); ``top_k`` of -1 or 0 and
    ``top_p == 1`` and ``min_p == 0`` switch those filters off. ``top_k`` keeps every token tied with the k-th most
    likely one, as vLLM and HF transformers do. ``max_tokens=None`` means up to the context limit.
    ``stop`` and ``stop_token_ids`` are normalized to lists (empty when None); generation ends at the first
    token that completes a stop string, and the text ends before that string, or after it with
    ``include_stop_str_in_output`` (of several stop strings, the one that ends first in the text). A stop token
    (end-of-sequence or ``stop_token_ids``) stays in the token ids; its text is in the output only with
    ``include_stop_str_in_output`` (and then not where it is a special token that ``skip_special_tokens`` skips).
    ``logprobs``/``prompt_logprobs`` ask for that many most-likely tokens besides the chosen one;
    their values are the model's raw log-softmax, before penalties, temperature and top-k/top-p/min-p.
    The penalties are vLLM's (and OpenAI's), applied to the logits before everything else, greedy rows
    included: ``presence_penalty`` is subtracted from every token the output holds, ``frequency_penalty``
    once per occurrence there, and a token in the prompt or the output has a positive logit divided by
    ``repetition_penalty`` and a negative one multiplied by it (HF transformers' rule). ``logit_bias``
    ({token id: bias in [-100, 100]}) is added to the logits first. Until ``min_tokens`` tokens are generated,
    the end-of-sequence and ``stop_token_ids`` tokens cannot be sampled and stop strings are not looked for;
    after that, as in vLLM, a stop string counts if it ends in the text that follows, even where it starts
    before.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field and normalize stop, stop_token_ids, logit_bias and numpy numbers. Construction runs it,
        and the engine again for each request it takes, so a field changed after construction is checked too."""
        def bad(field: str, value, need: str):
            raise ValueError(f"{field} must be {need}, got {value!r}")

        if not is_int(self.n) or self.n < 1:
            bad("n", self.n, "an int >= 1")
        if not is_finite_number(self.temperature) or self.temperature < 0:
            bad("temperature", self.temperature, "a finite number >= 0")
        if not is_finite_number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            bad("top_k", self.top_k, "-1 or 0 (disabled) or an int >= 1")
        if not is_finite_number(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", self.min_p, "in [0, 1]")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", self.max_tokens, "an int >= 1 (or unset: up to max_model_len)")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            bad("seed", self.seed, "None or an int in [0, 2**63)")

        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif isinstance(stop, (list, tuple)):
            stop = list(stop)
        else:
            bad("stop", self.stop, "None, a str or a list of str")
        if not all(isinstance(s, str) and s for s in stop):
            bad("stop", self.stop, "a list of non-empty str")
        self.stop = stop

        ids = self.stop_token_ids
        if ids is None:
            ids = []
        elif isinstance(ids, (list, tuple)):
            ids = list(ids)
        else:
            bad("stop_token_ids", self.stop_token_ids, "None or a list of int")
        if not all(is_int(t) and t >= 0 for t in ids):
            bad("stop_token_ids", self.stop_token_ids, "a list of ints >= 0")
        self.stop_token_ids = ids

        for field in ("logprobs", "prompt_logprobs"):
            v = getattr(self, field)
            if v is not None and (not is_int(v) or v < 0):
                bad(field, v, "None or an int >= 0")
        for field in ("presence_penalty", "frequency_penalty"):
            if not is_finite_number(getattr(self, field)) or not -2 <= getattr(self, field) <= 2:
                bad(field, getattr(self, field), "in [-2, 2]")
        if not is_finite_number(self.repetition_penalty) or not 0.01 <= self.repetition_penalty <= 100:
            bad("repetition_penalty", self.repetition_penalty, "in [0.01, 100]")  # further, float32 overflows
        if not is_int(self.min_tokens) or self.min_tokens < 0 or (
                self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", self.min_tokens, f"an int in [0, max_tokens={self.max_tokens}]")
        bias = self.logit_bias
        if bias is not None and (not isinstance(bias, dict) or not all(
                is_int(t) and t >= 0 and is_finite_number(b) and -100 <= b <= 100 for t, b in bias.items())):
            bad("logit_bias", bias, "None or a dict of token ids >= 0 to biases in [-100, 100]")
        self.logit_bias = {int(t): float(b) for t, b in bias.items()} if bias else None
        for field in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not is_bool(getattr(self, field)):
                bad(field, getattr(self, field), "a bool")
        fields_as_python_numbers(self)
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]

    def check_vocabulary(self, vocab_size: int) -> None:
        """Raise ValueError (naming the field first) if a setting reaches past a vocabulary of vocab_size
        tokens: the engine checks this on every request, the server before a request reaches the engine."""
        for field in ("logprobs", "prompt_logprobs", "top_k"):
            if (getattr(self, field) or 0) > vocab_size:
                raise ValueError(f"{field}={getattr(self, field)} exceeds the vocabulary size {vocab_size}")
        for field, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias or ())):
            outside = [t for t in ids if t >= vocab_size]
            if outside:
                raise ValueError(f"{field} has token ids outside the vocabulary [0, {vocab_size}): {outside[:5]}")

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the tokens so far (the penalties)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusts_logits(self) -> bool:
        """Whether anything changes the logits before sampling: penalties, a bias or a minimum length."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW  # dividing by a tinier one overflows float32
