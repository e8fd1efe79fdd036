"""`LLM`: the offline Python API (vLLM's names), a thin driver of `LLMEngine`."""

import itertools

from tqdm.auto import tqdm

from eightbit.engine.config import EngineConfig
from eightbit.engine.llm_engine import LLMEngine
from eightbit.engine.sampling_params import SamplingParams


class LLM:
    """Load a model and generate from it.

    >>> llm = LLM()                               # the embedded SmolLM2-135M-Instruct
    >>> out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    >>> out[0].outputs[0].text
    """

    def __init__(self, model=None, **engine_options):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params=None, use_tqdm=True, priority=None):
        """prompts: a str, a list of str, or a list of token-id lists; sampling_params: one or one per prompt.

        Returns one RequestOutput per prompt, in prompt order. Invalid input raises before anything runs.
        """
        prompts = self._as_list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        priorities = priority or [0] * len(prompts)
        ids = self._add(prompts, params, priorities)
        finished = {}
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm, unit="req") as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[i] for i in ids]

    def stream(self, prompts, sampling_params=None):
        """Yield (prompt index, RequestOutput) every time a request advances; `outputs[i].delta` is its new text.

        The deltas of one completion, joined, equal its final text.
        """
        prompts = self._as_list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        ids = self._add(prompts, params, [0] * len(prompts))
        index = {request_id: i for i, request_id in enumerate(ids)}
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    yield index[out.request_id], out
        finally:  # a consumer that stops early must not leave requests holding KV blocks
            for request_id in ids:
                self.engine.abort(request_id)

    def chat(self, messages, sampling_params=None, use_tqdm=True):
        """messages: one conversation (a list of {"role", "content"}) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        prompts = [
            tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _add(self, prompts, params, priorities):
        ids = []
        try:
            for prompt, p, prio in zip(prompts, params, priorities):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, p, prio)
                ids.append(request_id)
        except Exception:
            for request_id in ids:  # all or nothing: a bad prompt cancels the whole call
                self.engine.abort(request_id)
            raise
        return ids

    @staticmethod
    def _as_list(prompts):
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            return [prompts]
        if not prompts:
            raise ValueError("no prompts given")
        return list(prompts)

    @staticmethod
    def _params_per_prompt(sampling_params, n):
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} sampling params for {n} prompts")
        return list(sampling_params)
