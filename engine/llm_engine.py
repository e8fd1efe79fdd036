"""The engine core: add requests, step (schedule → run → postprocess), abort.

`LLM.generate`, streaming and the server all drive this one loop. A step runs one
packed batch; afterwards every sequence that finished its pending tokens samples
one token, is checked for stop conditions and detokenized incrementally.
"""

import copy
import gc
import operator
import time
from dataclasses import dataclass

import torch

from eightbit.engine.block_manager import BlockManager
from eightbit.engine.config import EngineConfig
from eightbit.engine.detokenizer import IncrementalDetokenizer, NoTextDetokenizer
from eightbit.engine.loader import load_model
from eightbit.engine.model_runner import ModelRunner, kv_bytes_per_token
from eightbit.engine.models.llama import context_limit
from eightbit.engine.outputs import CompletionOutput, RequestOutput
from eightbit.engine.sampler import (
    SamplingTensors,
    adjust_logits,
    gather_logprobs,
    logprobs_to_dicts,
    make_generator,
    sample,
)
from eightbit.engine.sampling_params import SamplingParams, is_int
from eightbit.engine.scheduler import Scheduler
from eightbit.engine.sequence import Request, Sequence
from eightbit.engine.signals import CTRL_C, signals_deferred
from eightbit.engine.transfer import to_device
from eightbit.quant.schemes import DEFAULT_KV_GROUP_SIZE, KVCacheScheme, head_dim

CPU_KV_CACHE_GB = 1.0
MAX_GRAPH_BATCH = 512  # decode batches above this run eagerly
MAX_GRAPH_PREFILL = 1024  # the prefill graphs' largest bucket; a longer prompt chunk runs eagerly (GPU-bound)
GRAPH_RESERVE_BYTES = 512 * 2**20  # CUDA graphs' own pool and workspace, kept out of the KV budget


@dataclass
class LaunchedStep:
    """A step whose sampled tokens may still be on the device."""

    scheduled: list  # [(Sequence, num_new_tokens)] as run
    seqs: list  # the sequences that sampled, in row order (n > 1 forks included)
    tokens: torch.Tensor | None  # [len(seqs)] int64 on the device (the next step's input)
    host_tokens: torch.Tensor | None = None  # the sampled tokens, on the host
    host_logprobs: tuple = ()  # gather_logprobs' three tensors on the host, where a sequence asked for log-probs
    ready: object = None  # CUDA event: the host tensors are filled once it has passed


def freeze_startup_heap():
    """Leave what exists now (torch, transformers, the model: some 400k objects) out of every later garbage
    collection. A full collection walks every tracked object, a quarter of a second on a small CPU, and stalls
    every running request's next token; the collections a step triggers are short once they skip these.
    What is unreachable is collected first, not frozen. A frozen object still goes when its last reference does,
    so a dropped engine is freed (a test checks); but an object in a reference cycle is never collected, which is
    why only processes that are the engine's own call this (`eightbit serve`'s engine process and server, the
    benchmarks), not `LLM` in a user's program, whose data in cycles would stay for good."""
    gc.collect()
    gc.freeze()


def _copy_to_host(tensors):
    """Start copying device tensors to pinned host memory; returns (host tensors, event to wait on).
    The copies are queued now, right after sampling: a plain .tolist() later would queue behind the
    step launched ahead and wait for it too."""
    if not tensors[0].is_cuda:
        return tuple(tensors), None
    host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        # max_model_len and the KV groups are checked against the model's config before its weights load
        loaded = load_model(config, check=lambda hf_config, group: (self._max_model_len(hf_config),
                                                                    self._kv_format(hf_config, group)))
        self.model, self.hf_config, self.tokenizer = loaded.model, loaded.hf_config, loaded.tokenizer
        self.eos_token_ids = set(loaded.eos_token_ids)
        self.quantized = loaded.quantized
        self.max_model_len = self._max_model_len(self.hf_config)
        self.kv_dtype, self.kv_group_size = self._kv_format(self.hf_config, loaded.kv_group_size)
        self.runner = ModelRunner(self.model, config.block_size, config.device)
        if self.on_cuda:
            self.runner.compile_gemms(config.max_num_batched_tokens)
        num_blocks = self._num_kv_blocks()
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          -(-self.max_model_len // config.block_size))
        self.runner.block_manager = self.block_manager
        self.runner.allocate_kv_cache(num_blocks, self.kv_dtype, self.kv_group_size)
        if self.on_cuda and not config.enforce_eager:
            self.runner.capture_graphs(self._max_graph_batch(), self.max_model_len,
                                       min(config.max_num_batched_tokens, self.max_model_len, MAX_GRAPH_PREFILL))
        self.scheduler = Scheduler(config, self.block_manager)
        self.generator = make_generator(config.seed, config.device)  # for requests without a seed of their own
        self.requests = {}  # request_id -> Request, until finished
        self._in_flight = None  # the LaunchedStep launched ahead by async scheduling
        self._aborted = []  # final outputs of requests aborted with report=True, for the next step to return
        self.num_computed_tokens = 0  # tokens run through the model (prefix-cache hits excluded)
        self.num_generated_tokens = 0

    # --- set-up -------------------------------------------------------------------------

    @property
    def on_cuda(self) -> bool:
        return torch.device(self.config.device).type == "cuda"

    def _max_model_len(self, hf_config) -> int:
        limit = context_limit(hf_config)
        wanted = self.config.max_model_len or limit
        if wanted > hf_config.max_position_embeddings:
            raise ValueError(f"max_model_len={wanted} exceeds the model's max_position_embeddings="
                             f"{hf_config.max_position_embeddings}")
        if wanted > limit:
            raise ValueError(f"max_model_len={wanted} exceeds the model's sliding window of {limit} tokens "
                             f"(sliding-window attention is not implemented; up to the window it equals full attention)")
        return wanted

    def _kv_format(self, hf_config, checkpoint_group_size):
        if self.config.kv_cache_dtype != "int8":
            return self.config.torch_dtype, None
        group = self.config.kv_group_size or checkpoint_group_size or DEFAULT_KV_GROUP_SIZE
        KVCacheScheme(group_size=group).check_head_dim(head_dim(hf_config))
        return torch.int8, group

    @property
    def kv_bytes_per_token(self) -> float:
        a = self.model.attention_layers()
        return kv_bytes_per_token(len(a), a[0].num_kv_heads, a[0].head_dim, self.kv_dtype, self.kv_group_size)

    def _transient_attention_bytes(self) -> int:
        """Room for the 16-bit float copy that long int8-cache prefills dequantize their blocks into
        (kernels/kv_dequant.py); the profiled step's own copy is smaller than the largest a step may take."""
        from eightbit.kernels import attention_configs

        return attention_configs.PREFILL_INT8_VIA_FLOAT_MAX_BYTES if self.kv_dtype == torch.int8 else 0

    def _graph_bytes(self) -> int:
        """Room for the CUDA graphs: their pool and workspace, and the decode graphs' logits (float32, and the
        model's dtype they are cast from: 0.2 GB at 256 sequences and a 128k vocabulary). With enforce_eager the
        fixed part stays reserved, so the KV cache does not grow with a flag meant for debugging."""
        if self.config.enforce_eager:
            return GRAPH_RESERVE_BYTES
        rows = self._max_graph_batch()
        return GRAPH_RESERVE_BYTES + rows * self.hf_config.vocab_size * (4 + self.config.torch_dtype.itemsize)

    def _max_graph_batch(self) -> int:
        """The largest decode batch a graph is captured for: a step holds at most max_num_seqs sequences, and at
        most max_num_batched_tokens, since each takes at least one token of the budget."""
        return min(self.config.max_num_seqs, self.config.max_num_batched_tokens, MAX_GRAPH_BATCH)

    def _num_kv_blocks(self) -> int:
        c = self.config
        bytes_per_block = self.kv_bytes_per_token * c.block_size
        if c.num_kv_blocks is not None:
            num_blocks = c.num_kv_blocks
        elif c.kv_cache_memory_gb is not None or not self.on_cuda:
            num_blocks = int((c.kv_cache_memory_gb or CPU_KV_CACHE_GB) * 2**30 // bytes_per_block)
        else:  # what is left under gpu_memory_utilization after the weights and the biggest step's activations
            peak = self.runner.profile_peak_memory(c.max_num_batched_tokens, c.max_num_seqs, self.max_model_len,
                                                   self.kv_dtype, self.kv_group_size)
            free, total = torch.cuda.mem_get_info()
            other_processes = total - free - torch.cuda.memory_reserved()
            reserved = self._graph_bytes() + self._transient_attention_bytes()
            budget = total * c.gpu_memory_utilization - other_processes - peak - reserved
            if budget < bytes_per_block:
                raise ValueError(
                    f"no GPU memory is left for the KV cache: {c.gpu_memory_utilization} of {total / 2**30:.1f} GiB, "
                    f"less {other_processes / 2**30:.1f} GiB held by other processes, the weights and the biggest "
                    f"step's activations ({peak / 2**30:.1f} GiB, measured at max_num_batched_tokens="
                    f"{c.max_num_batched_tokens} and max_num_seqs={c.max_num_seqs}) and "
                    f"{reserved / 2**30:.1f} GiB for CUDA graphs and transient attention copies, leaves "
                    f"{budget / 2**30:.2f} GiB: raise gpu_memory_utilization, or lower max_num_batched_tokens / "
                    f"max_num_seqs")
            num_blocks = int(budget // bytes_per_block)
        capacity = num_blocks * c.block_size
        if capacity < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {c.block_size}), fewer than one "
                f"max_model_len={self.max_model_len} sequence: raise kv_cache_memory_gb / gpu_memory_utilization / "
                f"num_kv_blocks, or lower max_model_len"
            )
        return num_blocks

    # --- requests -----------------------------------------------------------------------

    def add_request(self, request_id, prompt, sampling_params=None, priority=0, final_only=False, delta=False,
                    first_token_output=False):
        """Queue a prompt (text, token ids, or vLLM's {"prompt"} / {"prompt_token_ids"} dict). Invalid input raises
        and changes nothing. By default `step()` reports the request at every step with each sample's tokens and
        log-probs so far: O(length) a step. final_only: only when it finishes (all `generate` needs); with
        first_token_output, also at its first token (a server's queue count and time to first token). delta: at
        every step, each sample's tokens and log-probs since the request's previous output (vLLM's DELTA
        outputs; `text` stays cumulative, `delta` is the new text), O(new tokens) a step, for streaming."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if final_only and delta:
            raise ValueError("final_only and delta exclude each other: a final-only request has one output")
        if first_token_output and not final_only:
            raise ValueError("first_token_output goes with final_only: other requests are reported at every step")
        params = SamplingParams() if sampling_params is None else sampling_params
        if isinstance(params, SamplingParams):  # a copy, as vLLM's: the caller may change its object while it runs
            params = copy.deepcopy(params)
        text, token_ids = self._check_request(prompt, params, priority)
        request = Request(request_id, text, token_ids, params, int(priority), time.monotonic(), final_only, delta,
                          first_token_output)
        self._init_sequence(request.seqs[0])
        with signals_deferred(CTRL_C):  # known to the engine and to the scheduler, or to neither
            self.requests[request_id] = request
            self.scheduler.add(request.seqs[0])
        return request

    def check_request(self, prompt, sampling_params, priority=0):
        """Raise what `add_request` would raise for this prompt and these SamplingParams; else return the
        prompt's (text or None, token ids). Changes nothing, the caller's SamplingParams included."""
        if isinstance(sampling_params, SamplingParams):
            sampling_params = copy.deepcopy(sampling_params)
        return self._check_request(prompt, sampling_params, priority)

    def _check_request(self, prompt, params, priority):
        """check_request on params that may be normalized in place (validate() does)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        params.validate()  # again: a field may have changed since construction
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        if not is_int(priority):
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}: the samples of a "
                             f"request run together")
        params.check_vocabulary(self.hf_config.vocab_size)
        text, token_ids = self._tokenize(prompt)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(token_ids)} tokens leaves no room to generate within max_model_len={self.max_model_len}"
            )
        return text, token_ids

    def _tokenize(self, prompt):
        if isinstance(prompt, dict):  # vLLM's TextPrompt / TokensPrompt
            prompt = _prompt_from_dict(prompt)
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, (str, list, tuple)) and \
                getattr(prompt, "ndim", None) != 1:
            raise TypeError(f"a prompt must be a str, a list of token ids or a dict with 'prompt' or "
                            f"'prompt_token_ids', got {type(prompt).__name__}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer (dummy weights): pass prompts as token-id lists")
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.tokenizer(prompt).input_ids
        prompt = list(prompt)
        if not prompt:
            raise ValueError("prompt is empty")
        vocab = self.hf_config.vocab_size
        token_ids = [as_token_id(t) for t in prompt]  # numpy and torch integers too
        bad = [t for t, i in zip(prompt, token_ids) if i is None or not 0 <= i < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in the vocabulary [0, {vocab}), got {bad[:5]}")
        return None, token_ids

    def _init_sequence(self, seq: Sequence):
        params = seq.params
        if params.seed is not None:
            seq.generator = make_generator(params.seed + seq.index, self.config.device)
        if self.tokenizer is None:
            seq.detokenizer = NoTextDetokenizer()
            return
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.token_ids[: seq.num_prompt_tokens], params.stop,
                                                 params.skip_special_tokens, params.include_stop_str_in_output)

    def abort(self, request_id, report=True):
        """Stop a request now; its KV blocks go back to the pool at once. Unknown ids are ignored. report: the next
        step() returns its final output (finish_reason "abort" for the samples it stopped), as for any request
        that ends; False for a caller that has stopped listening."""
        with signals_deferred(CTRL_C):  # generate and stream abort in their clean-up, where a second Ctrl-C may come
            if not report:  # nor the outputs of a step that a Ctrl-C ended (step keeps them for the next)
                self._aborted = [out for out in self._aborted if out.request_id != request_id]
            request = self.requests.pop(request_id, None)
            if request is None:
                return
            for seq in request.seqs:
                if not seq.is_finished:
                    seq.finish_reason = "abort"
                    self.scheduler.finish(seq)
            if report:
                self._aborted.append(self._output(request, {}))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._aborted)

    def is_unreported(self, request_id) -> bool:
        """Whether step() is still to return the request's final output."""
        return request_id in self.requests or any(out.request_id == request_id for out in self._aborted)

    # --- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule → launch → complete one step. Returns the requests that produced tokens or finished.

        Async scheduling (on by default on CUDA): when the step after this one can only be one more token
        for each sequence of it, that step is launched before this one's tokens are copied to the
        host, with those tokens as its input straight from the device. The GPU then runs it while
        the host detokenizes, checks stop conditions and builds outputs. A sequence that stops here
        (a stop token or string; length limits are known in advance) has its extra row dropped.

        A Ctrl-C in the host's bookkeeping (scheduling; appending the tokens, stop checks, outputs) takes effect at
        its end, so that no sequence is left half scheduled, or with a token appended but not checked (it would run
        past its stop or length); the step's outputs then come with the next step. The model run and the wait for
        the GPU stay interruptible (a Ctrl-C in the wait for a CUDA event takes effect when the event is reached).
        """
        aborted, self._aborted = self._aborted, []
        outputs = None
        try:
            launched, self._in_flight = self._in_flight, None
            if launched is not None and all(s.is_finished for s in launched.seqs):
                launched = None  # every sequence of it stopped or was aborted after it was launched
            if launched is None:
                with signals_deferred(CTRL_C):  # the scheduler and the block manager change together
                    sched = self.scheduler.schedule()
                if not sched.scheduled:
                    return aborted
                launched = self._launch(sched.scheduled)
            if self.config.async_scheduling:
                self._in_flight = self._launch_continuation(launched)
            tokens = self._tokens_to_host(launched)
            with signals_deferred(CTRL_C):
                outputs = aborted + self._complete_step(launched, tokens)
            return outputs
        except BaseException:  # a Ctrl-C or an error: the requests of other callers must still run on
            if outputs is not None:  # a Ctrl-C held back until the step completed: nothing to undo
                self._aborted = outputs + self._aborted
                raise
            self._aborted = aborted + self._aborted
            # a request that finished in this step before the failure still reports its end (its stream would wait)
            self._aborted += [self._output(r, {}) for r in list(self.requests.values()) if r.is_finished]
            self._resample_lost_tokens()
            raise

    def _resample_lost_tokens(self):
        """After a step that did not complete: a sequence counted as computed up to its last token has lost the
        token sampled from it (it never reached token_ids), so its last token runs again and samples anew (its KV is
        written again, the same up to rounding; a seeded generator has moved on, so the sample may differ). The
        likely place for a Ctrl-C is the wait for the GPU (_tokens_to_host); the host's processing after it holds
        Ctrl-C back (step)."""
        self._in_flight = None
        for seq in self.scheduler.running:
            if not seq.is_finished and seq.num_computed_tokens >= seq.num_tokens:
                seq.num_computed_tokens = seq.num_tokens - 1

    def _copy_due_blocks(self):
        """Do the copy-on-write copies the block manager has handed out (KVCache.copy_blocks) before the model run
        that reads them. Copies that did not run (a step that failed or was interrupted first) stay due for the next
        launch; nothing writes the cache in between, and a copy whose destination was freed meanwhile (its request
        aborted or preempted) is dropped by the block manager. The copies and their clearing hold Ctrl-C back: a
        batch done twice could copy a block that an earlier copy of it had already overwritten."""
        due = self.block_manager.copies_due
        if not due:
            return
        with signals_deferred(CTRL_C):
            self.runner.kv_cache.copy_blocks(due)
            due.clear()

    def _launch(self, scheduled, input_tokens=None) -> LaunchedStep:
        """Run the model, count the new tokens as computed, fork the n > 1 samples of prompts that just finished
        (_fork_and_rows), and sample on the device; nothing waits for the GPU here."""
        self._copy_due_blocks()
        result = self.runner.run(scheduled, input_tokens)
        for seq, n in scheduled:
            seq.num_computed_tokens += n
            self.num_computed_tokens += n
        for seq, entries in result.prompt_logprobs.items():
            for index, entry in entries:
                seq.request.prompt_logprobs[index] = entry
        seqs, rows = self._fork_and_rows(result.sample_seqs)
        if not seqs:
            return LaunchedStep(scheduled, [], None)
        logits = result.logits
        if rows != list(range(len(logits))):  # n > 1 forks repeat rows
            logits = logits[to_device(rows, torch.int64, logits.device)]
        params = [s.params for s in seqs]
        tokens = sample(self._adjusted_logits(logits, seqs, input_tokens),
                        SamplingTensors.from_params(params, logits.device), [s.generator for s in seqs], self.generator)
        k = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        logprobs = gather_logprobs(logits, tokens, k) if k is not None else ()  # raw logits, as vLLM reports
        host, ready = _copy_to_host((tokens, *logprobs))
        return LaunchedStep(scheduled, seqs, tokens, host[0], host[1:], ready)

    def _adjusted_logits(self, logits, seqs, in_flight):
        """The logits as the sequences' SamplingParams change them before sampling (sampler.adjust_logits: bias,
        stop tokens banned before min_tokens, penalties), or the logits themselves where nothing does.
        in_flight: a continuation's input tokens on the device, one per sequence (its row order): the tokens the
        host has not appended yet, which count as each sequence's last output token."""
        params = [s.params for s in seqs]
        if not any(p.adjusts_logits for p in params):
            return logits
        before = [s.num_output_tokens + (in_flight is not None) for s in seqs]
        banned = [self._stop_tokens(p) if n < p.min_tokens else () for p, n in zip(params, before)]
        histories = [s.token_tensor() if p.penalized else s.token_ids for s, p in zip(seqs, params)]
        return adjust_logits(logits, params, histories, [s.num_prompt_tokens for s in seqs], banned, in_flight)

    def _stop_tokens(self, params) -> list[int]:
        """The tokens that would end a sequence of these params (not sampled before its min_tokens)."""
        return sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids))

    def _launch_continuation(self, launched: LaunchedStep) -> LaunchedStep | None:
        """Launch the next decode step of `launched`'s sequences now, or None if it must wait for the host
        (the scheduler also declines when a running sequence did not sample in it, e.g. a prompt chunk)."""
        keep = [i for i, s in enumerate(launched.seqs) if not s.is_finished and not self._ends_by_length(s)]
        if not keep:
            return None
        seqs = [launched.seqs[i] for i in keep]
        with signals_deferred(CTRL_C):
            sched = self.scheduler.schedule_continuation(seqs, launched.seqs)
        if sched is None:
            return None
        tokens = launched.tokens
        if len(keep) < len(tokens):
            tokens = tokens[to_device(keep, torch.int64, tokens.device)]
        return self._launch(sched.scheduled, tokens)

    def _ends_by_length(self, seq) -> bool:
        """Whether the token being sampled for seq now is its last (max_tokens or max_model_len)."""
        max_tokens = self.max_model_len if seq.params.max_tokens is None else seq.params.max_tokens
        return seq.num_output_tokens + 1 >= max_tokens or seq.num_tokens + 1 >= self.max_model_len

    def _complete_step(self, launched: LaunchedStep, tokens: list[int]) -> list[RequestOutput]:
        """Append the step's tokens (on the host: _tokens_to_host), register computed blocks, check stops."""
        live = [(i, s) for i, s in enumerate(launched.seqs) if not s.is_finished]
        logprob_dicts = None
        if launched.host_logprobs and live:
            ks = [s.params.logprobs or 0 for s in launched.seqs]
            logprob_dicts = logprobs_to_dicts(launched.host_tokens, *launched.host_logprobs, ks)
        for i, seq in live:
            seq.token_ids.append(tokens[i])
        for seq, _ in launched.scheduled:  # after the append: a continuation in flight counts as computed
            if not seq.is_finished:
                self.block_manager.mark_computed(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        deltas, started = {}, set()
        now = time.monotonic()
        for i, seq in live:
            token = tokens[i]
            self.num_generated_tokens += 1
            if seq.request.first_token_time is None:
                seq.request.first_token_time = now
                started.add(seq.request.request_id)
            if seq.params.logprobs is not None:
                seq.logprobs.append(logprob_dicts[i])
                seq.cumulative_logprob += logprob_dicts[i][token]
            deltas[seq] = self._process_token(seq, token)
        advanced = {s.request.request_id: s.request for s in deltas}.values()
        return [self._output(r, deltas) for r in advanced
                if r.is_finished or not r.final_only or (r.first_token_output and r.request_id in started)]

    def _tokens_to_host(self, launched: LaunchedStep) -> list[int]:
        """The step's sampled tokens as ints ([] if every sequence of it has finished since its launch): where the
        host waits for the GPU to finish the step."""
        if all(s.is_finished for s in launched.seqs):
            return []
        if launched.ready is not None:
            launched.ready.synchronize()
        return launched.host_tokens.tolist()

    def _fork_and_rows(self, sample_seqs):
        """Expand requests with n > 1 whose prompt just finished: the n samples share its blocks."""
        seqs, rows = [], []
        for row, seq in enumerate(sample_seqs):
            request = seq.request
            family = [seq]
            if len(request.seqs) < request.params.n:
                with signals_deferred(CTRL_C):  # a request's samples fork together
                    for index in range(1, request.params.n):
                        child = seq.fork(index)
                        self._init_sequence(child)
                        self.block_manager.fork(seq.seq_id, child.seq_id)
                        self.scheduler.add_running(child)
                        request.seqs.append(child)
                        family.append(child)
            seqs += family
            rows += [row] * len(family)
        return seqs, rows

    def _process_token(self, seq, token) -> str:
        """Detokenize the new token and finish the sequence if a stop condition holds."""
        params, detok = seq.params, seq.detokenizer
        delta = ""
        check_stop = seq.num_output_tokens > params.min_tokens  # vLLM's: not in the first min_tokens' text
        eos = not params.ignore_eos and token in self.eos_token_ids
        if eos or token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", None if eos else token
            # a stop token stays in token_ids; its text (where it is not a skipped special token) reaches the
            # output only with include_stop_str_in_output, as in vLLM
            if params.include_stop_str_in_output:
                delta = detok.add_tokens([token], check_stop=False)
        else:
            delta = detok.add_tokens([token], check_stop)
            if detok.stopped:
                seq.finish_reason, seq.stop_reason = "stop", detok.stop_string
            elif seq.num_output_tokens >= (self.max_model_len if params.max_tokens is None else params.max_tokens):
                seq.finish_reason = "length"
            elif seq.num_tokens >= self.max_model_len:
                seq.finish_reason = "length"
        if seq.finish_reason is not None:
            if not detok.stopped:
                delta += detok.finish(check_stop)
                if detok.stopped:  # a held-back stop string confirmed only at the end
                    seq.finish_reason, seq.stop_reason = "stop", detok.stop_string
            self.scheduler.finish(seq)
        return delta

    def _output(self, request, deltas) -> RequestOutput:
        outputs = []
        for s in request.seqs:
            first = s.num_reported if request.delta else 0  # the tokens this output carries start here
            s.num_reported = s.num_output_tokens
            outputs.append(CompletionOutput(
                index=s.index,
                text=s.detokenizer.text,
                token_ids=s.output_tokens_from(first),
                cumulative_logprob=s.cumulative_logprob if s.params.logprobs is not None else None,
                logprobs=s.logprobs[first:] if s.params.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                # a final-only request's outputs skip steps: its delta is then all the text so far
                delta=s.detokenizer.text if request.final_only else deltas.get(s, ""),
            ))
        finished = request.is_finished
        if finished:
            self.requests.pop(request.request_id, None)
            # aborted before its prompt finished, an n > 1 request has not forked its samples: report all n
            params = request.params
            outputs += [CompletionOutput(index=i, text="", token_ids=[], finish_reason=outputs[0].finish_reason,
                                         cumulative_logprob=0.0 if params.logprobs is not None else None,
                                         logprobs=[] if params.logprobs is not None else None)
                        for i in range(len(outputs), params.n)]
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             request.prompt_logprobs, outputs, finished)


def _prompt_from_dict(prompt: dict):
    """{"prompt": str} or {"prompt_token_ids": [...]} (vLLM's TextPrompt / TokensPrompt) -> the str or the ids."""
    keys = set(prompt)
    if keys == {"prompt"}:
        return prompt["prompt"]
    if keys == {"prompt_token_ids"}:
        ids = prompt["prompt_token_ids"]
        if isinstance(ids, (str, bytes, bytearray, dict)):
            raise TypeError(f"prompt_token_ids must be a list of token ids, got {type(ids).__name__}")
        return ids
    raise ValueError(f"a dict prompt must have exactly one key, 'prompt' (a str) or 'prompt_token_ids' (a list of "
                     f"token ids), got keys {sorted(keys)}")


def as_token_id(t):
    """t as a Python int if it is an integer of any kind (not a bool or float, not a one-element array), else
    None."""
    if isinstance(t, bool) or getattr(t, "ndim", 0) != 0:  # a tensor([5]) would pass operator.index
        return None
    try:
        return operator.index(t)
    except TypeError:
        return None
