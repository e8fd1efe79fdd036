"""Request state as plain counters: what a sequence holds, what is computed, why it stopped."""

import itertools
from enum import Enum, auto

import torch

_seq_ids = itertools.count()
_arrivals = itertools.count()


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One generated sample of one request (a request with n > 1 has n sequences).

    The scheduler reasons only with `num_tokens` (prompt + output so far) and
    `num_computed_tokens` (how many of them have KV in the cache): a step computes
    some of the difference. A sequence whose every token is computed samples its
    next token in that step.
    """

    def __init__(self, request, prompt_token_ids, index=0):
        self.seq_id = next(_seq_ids)
        self.request = request  # the Request this sample belongs to
        self.index = index  # which of the request's n samples
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.arrival = next(_arrivals)
        self.finish_reason = None  # "stop" | "length" | "abort"
        self.stop_reason = None  # the stop string or stop token id that ended it
        self.generator = None  # torch.Generator of a seeded request
        self.logprobs = []  # per output token: {token_id: logprob}, when asked for
        self.num_reported = 0  # output tokens reported so far (a delta request's next output starts after them)
        self.cumulative_logprob = 0.0
        self.detokenizer = None
        self._token_tensor = None  # token_ids as int64, filled up to _token_tensor_len (token_tensor())
        self._token_tensor_len = 0

    @property
    def params(self):
        return self.request.params

    @property
    def priority(self):
        return self.request.priority

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """A copy: O(length). For the count, num_output_tokens."""
        return self.output_tokens_from(0)

    def output_tokens_from(self, first: int) -> list[int]:
        """A copy of the output tokens from the first-th on: what an output (or a delta output) carries."""
        return self.token_ids[self.num_prompt_tokens + first :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def token_tensor(self) -> torch.Tensor:
        """token_ids as an int64 CPU tensor, converting only the tokens appended since the last call (token_ids
        only grows): the penalties read every penalized sequence's whole history at every step."""
        n, have = len(self.token_ids), self._token_tensor_len
        if self._token_tensor is None or n > len(self._token_tensor):
            grown = torch.empty(max(2 * n, 64), dtype=torch.int64)
            if have:
                grown[:have] = self._token_tensor[:have]
            self._token_tensor = grown
        if have < n:
            self._token_tensor[have:n] = torch.tensor(self.token_ids[have:n], dtype=torch.int64)
            self._token_tensor_len = n
        return self._token_tensor[:n]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def fork(self, index: int) -> "Sequence":
        """Sample `index` of this sequence's request, a copy of it so far. It keeps the parent's place in line:
        a request's samples are preempted as late as the request itself, not as if they had just arrived."""
        child = Sequence(self.request, self.token_ids, index)
        child.num_prompt_tokens = self.num_prompt_tokens
        child.num_computed_tokens = self.num_computed_tokens
        child.num_reported = self.num_reported
        child.arrival = self.arrival
        return child

    def sort_key(self):
        """Scheduling order: lower priority value first, then first come first served."""
        return (self.priority, self.arrival)


class Request:
    """What the user asked for: one prompt, its sampling parameters, and its n sequences.

    A request starts as one sequence; when its prompt is prefilled, it forks into n
    sequences that share the prompt's KV blocks (copy-on-write).
    """

    def __init__(self, request_id, prompt, prompt_token_ids, params, priority=0, arrival_time=0.0, final_only=False,
                 delta=False, first_token_output=False):
        self.request_id = request_id
        self.final_only = final_only  # reported by step() only when finished (LLMEngine.add_request)
        self.delta = delta  # each output holds only what is new since the previous one (LLMEngine.add_request)
        self.first_token_output = first_token_output  # with final_only: also reported at its first token
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.arrival_time = arrival_time
        self.first_token_time = None
        self.seqs = [Sequence(self, prompt_token_ids)]
        # prompt_logprobs[i] is {token_id: logprob} for prompt token i (None at 0), filled as chunks compute
        self.prompt_logprobs = [None] * len(prompt_token_ids) if params.prompt_logprobs is not None else None

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
