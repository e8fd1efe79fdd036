"""The engine loop in its own thread, fed by a thread-safe command queue.

`LLMEngine` is not thread-safe, so every call into it happens on the loop thread. Request
handlers (on an asyncio event loop) `submit` token ids and sampling params with a sink — an
asyncio.Queue and the loop it belongs to — and `abort` ids; the loop picks these commands up at
the start of its next iteration, so new requests join the running batch at the next step. Each
step's outputs are handed to the sinks with one `call_soon_threadsafe` per event loop (not per request).

The loop also times itself: the wall time of iterations that had work, and within it the time
in model execution, in sampling and in per-token postprocessing (detokenization, stop strings),
so /metrics can show the share of loop time spent outside the model.
"""

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

log = logging.getLogger("eightbit.server")


class EngineLoopError(RuntimeError):
    """The engine raised inside a step; every request in flight is failed with this."""


@dataclass(frozen=True)
class EngineInfo:
    """What the server needs to know of the engine behind a loop, in this process or another."""

    model: str | None  # EngineConfig.model: None for the embedded default
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    tokenizer: object  # None for dummy weights: token ids in and out

    @classmethod
    def of(cls, engine) -> "EngineInfo":
        return cls(engine.config.model, engine.max_model_len, engine.hf_config.vocab_size, engine.config.max_num_seqs,
                   engine.tokenizer)


@dataclass
class Sink:
    loop: object  # the asyncio event loop of the handler waiting on `queue`
    queue: object  # asyncio.Queue receiving (request_id, RequestOutput | Exception)


class _Timer:
    """Wraps a bound method of the engine and adds its wall time to a counter."""

    def __init__(self, fn, sync_cuda: bool):
        self.fn = fn
        self.sync_cuda = sync_cuda
        self.seconds = 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.fn(*args, **kwargs)
        if self.sync_cuda:  # CUDA work is asynchronous: charge it here, not to whatever syncs next
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - t0
        return out


class AsyncEngine:
    def __init__(self, engine, idle_poll_s: float = 0.5):
        self.engine = engine
        self.info = EngineInfo.of(engine)
        self.idle_poll_s = idle_poll_s
        self._commands = queue.SimpleQueue()
        self._adds_submitted = self._adds_taken = 0  # each written by one thread only (the caller's, the loop's)
        self._sinks = {}  # request_id -> Sink, touched only on the loop thread
        self._thread = None
        self._stop = threading.Event()
        self.steps = 0
        self.busy_s = 0.0
        # Model time = launching a step (run + sampling on the device) + waiting for its tokens. With async
        # scheduling the launch must not sync (the next step is launched while this one runs), so the GPU
        # time the loop does not overlap shows up in the wait; without it, the launch syncs, as before.
        sync = str(engine.config.device).startswith("cuda") and not engine.config.async_scheduling
        # Instance attributes shadow the methods step() calls through self: no engine change needed.
        self._timers = {name: _Timer(getattr(engine, name), sync and name == "_launch")
                        for name in ("_launch", "_tokens_to_host", "_complete_step", "_process_token")}
        for name, timer in self._timers.items():
            setattr(engine, name, timer)
        self._stats = self._snapshot()

    # --- called from any thread ------------------------------------------------------------

    def start(self):
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="eightbit-engine-loop", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0):
        self._stop.set()
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive() and self.engine is not None:
                self._release_engine()

    def _release_engine(self):
        """Unwrap the engine's timed methods and drop it, so that its memory goes with the caller's last reference:
        FastAPI caches the endpoints it served, which hold this object, for the life of the process."""
        for name, timer in self._timers.items():
            self.engine.__dict__.pop(name, None)
            timer.fn = None
        self.engine = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, request_id, prompt_token_ids, params, sink: Sink, priority=0, every_step=True):
        """every_step=True (a stream): deliver every step's output, each holding only the tokens and log-probs new
        since the previous one (LLMEngine.add_request's delta). every_step=False (a non-streamed answer): deliver
        only the request's first output with a token (its time to first token) and its last, both cumulative.
        Each delivery wakes the handlers' event loop, whose thread then competes with the engine loop for the
        interpreter lock."""
        self._adds_submitted += 1
        self._commands.put(("add", request_id, prompt_token_ids, params, sink, priority, every_step))

    def abort(self, request_id):
        self._commands.put(("abort", request_id))

    @property
    def stats(self) -> dict:
        """The latest snapshot of the engine's state and the loop's timers (a plain dict)."""
        s = dict(self._stats)
        s["waiting_requests"] += self._adds_submitted - self._adds_taken  # not yet taken in (aborts not counted)
        s["alive"] = self.alive
        return s

    # --- the loop thread -----------------------------------------------------------------------

    def _run(self):
        engine = self.engine
        while not self._stop.is_set():
            if not engine.has_unfinished_requests():
                try:  # idle: sleep until a command comes (not counted as busy time)
                    cmd = self._commands.get(timeout=self.idle_poll_s)
                except queue.Empty:
                    continue
                if cmd is None:
                    break
                t0 = time.perf_counter()
                self._handle(cmd)
            else:
                t0 = time.perf_counter()
            self._drain()
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                    self.steps += 1
                except Exception as e:  # a bug in the engine: fail what is in flight, keep serving
                    log.exception("engine step failed")
                    self._fail_all(EngineLoopError(f"engine step failed: {e!r}"))
                    outputs = []
                self._deliver(outputs)
            self.busy_s += time.perf_counter() - t0
            self._publish(self._snapshot())
        self._fail_all(EngineLoopError("the engine loop stopped"))
        self._publish(self._snapshot())

    def _publish(self, stats):
        """The end of each iteration that took a command or ran a step, and of the loop: its snapshot becomes
        `stats`."""
        self._stats = stats

    def _drain(self):
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd is None:
                self._stop.set()
                return
            self._handle(cmd)

    def _handle(self, cmd):
        if cmd[0] == "add":
            self._adds_taken += 1
            _, request_id, token_ids, params, sink, priority, every_step = cmd
            try:
                # a stream's outputs hold only what is new (O(new tokens) a step, not O(length)); a non-streamed
                # request is reported at its first token and its end only
                self.engine.add_request(request_id, token_ids, params, priority, delta=every_step,
                                        final_only=not every_step, first_token_output=not every_step)
            except Exception as e:  # validated by the handler already; report anything left over
                self._send(sink, [(request_id, e)])
                return
            self._sinks[request_id] = sink
        else:
            _, request_id = cmd
            self.engine.abort(request_id, report=False)  # frees its KV blocks now
            self._sinks.pop(request_id, None)

    def _deliver(self, outputs):
        self._abort_unheard()
        by_sink = {}
        for out in outputs:
            rid = out.request_id
            sink = self._sinks.get(rid)
            if sink is None:
                continue
            if out.finished:
                self._sinks.pop(rid, None)
            by_sink.setdefault(id(sink), (sink, []))[1].append((rid, out))
        self._send_all(list(by_sink.values()))

    def _abort_unheard(self):
        # nobody listens: a non-streamed request would otherwise run on to its end before a delivery failed
        for rid in unheard(self._sinks):
            self.engine.abort(rid, report=False)
            self._sinks.pop(rid, None)

    def _send(self, sink, items):
        self._send_all([(sink, items)])

    def _send_all(self, deliveries):
        for request_id in hand_over(deliveries):
            self.engine.abort(request_id, report=False)
            self._sinks.pop(request_id, None)

    def _fail_all(self, error):
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id, report=False)
        sinks, self._sinks = self._sinks, {}
        for request_id, sink in sinks.items():
            self._send(sink, [(request_id, error)])

    def _snapshot(self) -> dict:
        engine = self.engine
        sched, bm = engine.scheduler, engine.block_manager
        running = sched.running
        seconds = {name: timer.seconds for name, timer in self._timers.items()}
        model_s = seconds["_launch"] + seconds["_tokens_to_host"]
        busy = self.busy_s
        return {
            "running_requests": len({s.request.request_id for s in running}),
            "running_seqs": len(running),
            "waiting_requests": len({s.request.request_id for s in sched.waiting}),
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "kv_blocks_total": bm.num_blocks,
            "generated_tokens": engine.num_generated_tokens,
            "computed_tokens": engine.num_computed_tokens,
            "preemptions": sched.num_preemptions,
            "steps": self.steps,
            "busy_s": busy,
            "model_s": model_s,
            "sample_s": seconds["_complete_step"],
            "postprocess_s": seconds["_process_token"],
            "outside_model_ratio": (busy - model_s) / busy if busy > 0 else 0.0,
        }


def unheard(sinks) -> list:
    """The request ids of {request_id: Sink} whose handler's event loop has closed."""
    return [rid for rid, sink in sinks.items() if sink.loop.is_closed()]


def hand_over(deliveries) -> list:
    """Hand [(sink, [(request_id, item)])] to their event loops: one call_soon_threadsafe per loop, not per request.
    Each call wakes that loop's thread through its self-pipe, and in one process a woken thread competes with the
    engine loop for the interpreter lock while a step's kernels are being launched. Returns the request ids whose
    event loop had closed: nobody is listening for them."""
    by_loop = {}
    for sink, items in deliveries:
        by_loop.setdefault(sink.loop, []).append((sink.queue, items))
    unheard_ids = []
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_batch, batch)
        except RuntimeError:
            unheard_ids += [request_id for _, items in batch for request_id, _ in items]
    return unheard_ids


def _put_batch(batch):
    for q, items in batch:
        for item in items:
            q.put_nowait(item)
