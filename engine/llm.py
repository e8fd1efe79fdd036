"""`LLM`: the offline Python API (vLLM's names), a thin driver of `LLMEngine`."""

import itertools
import numbers
from collections import deque
from contextlib import closing

from tqdm.auto import tqdm

from eightbit.engine.chat import render_chat
from eightbit.engine.config import EngineConfig
from eightbit.engine.llm_engine import LLMEngine
from eightbit.engine.sampling_params import SamplingParams
from eightbit.engine.signals import CTRL_C, signals_deferred


class LLM:
    """Load a model and generate from it.

    >>> llm = LLM()                               # the embedded SmolLM2-135M-Instruct
    >>> out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    >>> out[0].outputs[0].text
    """

    def __init__(self, model=None, **engine_options):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self._ids = itertools.count()
        self._inboxes = {}  # request id -> the output queue of the call (generate / stream) that owns it

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params=None, use_tqdm=True, priority=None):
        """prompts: one prompt or a list (a prompt: a str, a list of token ids, or vLLM's {"prompt"} /
        {"prompt_token_ids"} dict); sampling_params and priority: one, or one per prompt.

        Returns one RequestOutput per prompt, in prompt order. Invalid input raises before anything runs; an
        exception while it runs (Ctrl-C included) aborts this call's requests, so the engine stays usable.
        """
        prompts = self._as_list(prompts)
        params = self._per_prompt(SamplingParams() if sampling_params is None else sampling_params, len(prompts),
                                  "sampling params", SamplingParams)
        priorities = self._per_prompt(0 if priority is None else priority, len(prompts), "priorities",
                                      numbers.Integral)
        ids = self._add(prompts, params, priorities, final_only=True)
        finished = {}
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm, unit="req") as bar, \
                closing(self._run(ids)) as outputs:
            for out in outputs:
                if out.finished:
                    finished[out.request_id] = out
                    bar.update(1)
        return [finished[i] for i in ids]

    def stream(self, prompts, sampling_params=None, priority=None):
        """An iterator of (prompt index, RequestOutput), one every time a request advances; `outputs[i].delta` is
        its new text. The deltas of one completion, joined, equal its final text.

        Invalid input raises from this call, not from the first `next()`. The requests are added at the first
        `next()` (an iterator never consumed leaves nothing behind) and run as it is consumed; one closed or
        dropped early aborts the requests still running.
        """
        prompts = self._as_list(prompts)
        params = self._per_prompt(SamplingParams() if sampling_params is None else sampling_params, len(prompts),
                                  "sampling params", SamplingParams)
        priorities = self._per_prompt(0 if priority is None else priority, len(prompts), "priorities",
                                      numbers.Integral)
        for i, (prompt, p, prio) in enumerate(zip(prompts, params, priorities)):
            try:
                self.engine.check_request(prompt, p, prio)
            except (ValueError, TypeError) as e:
                if named := _naming_the_prompt(e, i, len(prompts)):
                    raise named from e
                raise
        return self._stream(prompts, params, priorities)

    def _stream(self, prompts, params, priorities):
        ids = self._add(prompts, params, priorities, final_only=False)
        index = {request_id: i for i, request_id in enumerate(ids)}
        with closing(self._run(ids)) as outputs:  # closed, and so aborted, when the consumer stops early
            for out in outputs:
                yield index[out.request_id], out

    def _run(self, ids):
        """Step the engine until the requests `ids` finish, yielding their outputs in the order the engine made
        them. Calls may overlap (two streams consumed in turn, a generate inside a stream's loop): whichever call
        steps the engine puts each output in the queue of the call that owns its request, so no call loses
        another's outputs. However this ends (an error, Ctrl-C, a consumer that stops early), requests of `ids`
        still running are aborted, so that none keeps KV blocks or runs on in a later call. Requests added
        straight to the engine share the batch and advance too, but what `step()` returns for them is dropped
        here: drive those with `engine.step()` alone."""
        unfinished, inbox = set(ids), deque()
        self._inboxes.update((request_id, inbox) for request_id in ids)
        try:
            while unfinished:
                if not inbox:
                    if not any(self.engine.is_unreported(request_id) for request_id in unfinished):
                        raise RuntimeError(f"requests {sorted(unfinished)} ended outside this call, unreported")
                    for out in self.engine.step():
                        if out.request_id in self._inboxes:
                            self._inboxes[out.request_id].append(out)
                    continue
                out = inbox.popleft()
                if out.finished:
                    unfinished.discard(out.request_id)
                yield out
        finally:
            for request_id in ids:
                self._inboxes.pop(request_id, None)
            with signals_deferred(CTRL_C):  # a second Ctrl-C must not leave some of them running unowned
                for request_id in unfinished:
                    self.engine.abort(request_id, report=False)

    def chat(self, messages, sampling_params=None, use_tqdm=True):
        """messages: one conversation (a list of {"role", "content"}) or a list of them."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(f"messages must be a conversation (a non-empty list of messages) or a non-empty list of "
                             f"them, got {messages!r:.80}")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        for conversation in conversations:
            _check_conversation(conversation)
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer and its chat template; this model has none (dummy weights)")
        texts, ids = zip(*(render_chat(tokenizer, c) for c in conversations))
        outputs = self.generate(list(ids), sampling_params, use_tqdm=use_tqdm)
        for out, text in zip(outputs, texts):
            out.prompt = text
        return outputs

    def _add(self, prompts, params, priorities, final_only):
        ids = []
        try:
            for prompt, p, prio in zip(prompts, params, priorities):
                request_id = str(next(self._ids))
                while request_id in self.engine.requests:  # one added straight to the engine has it
                    request_id = str(next(self._ids))
                ids.append(request_id)  # before it is added: a Ctrl-C held back in add_request comes after that
                self.engine.add_request(request_id, prompt, p, prio, final_only=final_only)
        except BaseException as e:
            with signals_deferred(CTRL_C):  # all or nothing: a bad prompt (or Ctrl-C) cancels the whole call
                for request_id in ids:
                    self.engine.abort(request_id, report=False)
            if named := _naming_the_prompt(e, len(ids) - 1, len(prompts)):
                raise named from e
            raise
        return ids

    @staticmethod
    def _as_list(prompts):
        """One prompt (a str, a {"prompt" | "prompt_token_ids": ...} dict or a list of token ids) or a list of
        them -> the list. A list is one prompt of ids if every element is a number (Python, numpy or torch scalars;
        a float among them is the engine's error to name); otherwise each element is a prompt, and the error names
        the malformed one (prompts[i]). An array (numpy, torch, a pandas column) is read as its list: 1-D numbers are
        one prompt of ids, 1-D strings a prompt each, a 2-D one a prompt per row."""
        if getattr(prompts, "ndim", None) in (1, 2) and hasattr(prompts, "tolist"):
            prompts = prompts.tolist()  # a 2-D array's rows, a column's strings: the list of prompts below
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                and all(_is_number(t) for t in prompts)):
            return [prompts]  # one prompt of ids (a float among them: the engine says which)
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a str, a list of str or a list of token-id lists, "
                            f"got {type(prompts).__name__}")
        if not prompts:
            raise ValueError("no prompts given")
        return list(prompts)

    @staticmethod
    def _per_prompt(value, n, what, kind):
        """One value per prompt: a single `kind` is shared by all; a list must have one `kind` for each. A bool is
        no int here."""
        if isinstance(value, kind) and not isinstance(value, bool):
            return [value] * n
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{what}: expected one value or a list of one per prompt, got {type(value).__name__}")
        if len(value) != n:
            raise ValueError(f"got {len(value)} {what} for {n} prompts")
        for i, v in enumerate(value):
            if not isinstance(v, kind) or isinstance(v, bool):
                raise TypeError(f"{what}[{i}] must be {_kind_name(kind)}, got {type(v).__name__}")
        return list(value)


def _naming_the_prompt(e, i, n):
    """The error e of prompts[i] saying which of the n it is (among thousands the user must find the bad one); None
    where there is one prompt, or where a new exception would change e's type (a subclass of ValueError)."""
    return type(e)(f"prompts[{i}]: {e}") if n > 1 and type(e) in (ValueError, TypeError) else None


def _kind_name(kind) -> str:
    return "int" if kind is numbers.Integral else kind.__name__


def _is_number(t) -> bool:
    """A scalar number of any kind (Python, numpy, a 0-d tensor), not a bool: an element of a prompt of ids. (numpy's
    str_ and bool_ scalars are 0-d too: a list of np.str_ is a list of prompts.)"""
    if isinstance(t, bool):
        return False
    if isinstance(t, numbers.Number):
        return True
    dtype = getattr(t, "dtype", None) if getattr(t, "ndim", None) == 0 else None
    if dtype is None:
        return False
    if hasattr(dtype, "kind"):  # numpy: signed, unsigned, float
        return dtype.kind in "iuf"
    return dtype.is_floating_point or str(dtype).startswith(("torch.int", "torch.uint"))  # torch


def _check_conversation(messages):
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"a conversation must be a non-empty list of messages, got {messages!r:.80}")
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"each message must be a dict with a str 'role' and a str 'content', got {m!r:.80}")
