"""The engine loop in a process of its own, so that it shares no interpreter lock with the HTTP server.

In one process, uvicorn's event loop and the engine loop take turns at the lock, and the engine's eager steps are
bound by the host launching kernels. `EngineProcess` offers the server what `AsyncEngine` does (submit, abort,
stats, alive) while the engine runs in a spawned child process, as vLLM's engine core does. Measured against the
thread on one H200 (docs/benchmarks.md, thirtieth session): the same throughput non-streamed, 11 % more streamed,
17-26 % lower median latencies.

    server process                                   engine process
    handlers --submit/abort--> pipe ----------------> command thread -> AsyncEngine's command queue
    event loops <-- call_soon_threadsafe -- reader thread <-- one message per step -- AsyncEngine's loop (main thread)

The child runs the same `AsyncEngine` loop; only where its outputs go differs (`_EngineCore`): each step's
outputs (deltas for streams, first token and end for the rest; without their prompts) and its stats snapshot go
back as one pickled message. If the child dies, every request in flight fails with `EngineLoopError`, `alive`
turns False (/health answers 503), and `exit_reason` says why (`eightbit serve` then exits: cli.uvicorn_server).
"""

import dataclasses
import logging
import multiprocessing
import signal
import threading
import traceback

from eightbit.engine.server.async_engine import AsyncEngine, EngineLoopError, Sink, hand_over, unheard

log = logging.getLogger("eightbit.server")

_PIPE = Sink(loop=None, queue=None)  # the child's one sink (no event loop there): everything goes through the pipe


class EngineProcess:
    """An LLMEngine built from `config` in a spawned process, with AsyncEngine's interface for the server."""

    def __init__(self, config):
        self.config = config
        self.info = None  # EngineInfo, once started
        self._proc = self._conn = self._reader = None
        self._lock = threading.Lock()  # the sinks: handlers and the reader share them
        # the pipe's sending end: handlers, the reader (its aborts) and stop() all send, and a large message goes out
        # as several writes, which another thread's message must not land between
        self._send_lock = threading.Lock()
        self._sinks = {}  # request_id -> Sink
        self._stats = {}
        self.exit_reason = None  # why the engine process ended, once it has

    def start(self):
        """Spawn the engine process and wait until its engine is built; re-raises what building it raised."""
        if self._proc is not None:
            return self
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_engine_main, args=(child_conn, self.config), name="eightbit-engine",
                                 daemon=True)
        self._proc.start()
        child_conn.close()
        try:
            kind, payload, stats = self._wait_for_start()
        except BaseException:  # Ctrl-C (which the child ignores), or the child died while starting
            self._abandon_start(wait_s=0)
            raise
        if kind == "failed":
            self._abandon_start(wait_s=10)  # it is on its way out
            raise payload
        self.info, self._stats = payload, stats
        self._reader = threading.Thread(target=self._read, name="eightbit-engine-reader", daemon=True)
        self._reader.start()
        return self

    def _abandon_start(self, wait_s):
        self._proc.join(wait_s)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
        self._conn.close()
        self._proc = self._conn = None

    def _wait_for_start(self):
        try:
            while not self._conn.poll(0.5):
                if not self._proc.is_alive():
                    raise EOFError
            return self._conn.recv()
        except EOFError:  # killed (out of memory?), or a crash in native code: its stderr says more
            self._proc.join(5)
            raise RuntimeError(f"the engine process exited (code {self._proc.exitcode}) while building the "
                               "engine") from None

    def stop(self, timeout: float = 10.0):
        if self._proc is None:
            return
        self._send(("stop",))
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout)
        if self._reader is not None:
            self._reader.join(timeout)
        self._conn.close()

    @property
    def alive(self) -> bool:
        return self._reader is not None and self._reader.is_alive() and self._proc.is_alive()

    @property
    def stats(self) -> dict:
        """The engine loop's snapshot as of its last step (taken in the engine process; its waiting requests do not
        count adds still in the pipe)."""
        return dict(self._stats, alive=self.alive)

    def submit(self, request_id, prompt_token_ids, params, sink: Sink, priority=0, every_step=True):
        """As AsyncEngine.submit."""
        with self._lock:
            self._sinks[request_id] = sink
            sent = self._send(("add", request_id, list(prompt_token_ids), params, priority, every_step))
        if not sent:
            self._deliver([(request_id, EngineLoopError("the engine process is not running"))])

    def abort(self, request_id):
        with self._lock:
            self._sinks.pop(request_id, None)
            self._send(("abort", request_id))

    def _send(self, message) -> bool:
        try:
            with self._send_lock:
                self._conn.send(message)
            return True
        except (OSError, ValueError):  # the child is gone (or the pipe closed by stop)
            return False

    # --- the reader thread -------------------------------------------------------------------

    def _read(self):
        reason = None
        try:
            while True:
                items, stats = self._conn.recv()
                self._stats = stats
                self._deliver(items)
        except (EOFError, OSError):
            pass
        except Exception as e:  # a bug: end the engine process too, rather than leave it blocked on a full pipe
            log.exception("reading the engine process's outputs failed")
            reason = f"reading the engine process's outputs failed: {e!r}"
            self._proc.kill()
        self._proc.join(5)
        code = self._proc.exitcode
        if reason is None:
            reason = "the engine loop stopped" if code == 0 else f"the engine process died (exit code {code})"
        self.exit_reason = reason
        with self._lock:
            sinks, self._sinks = self._sinks, {}
        hand_over([(sink, [(rid, EngineLoopError(reason))]) for rid, sink in sinks.items()])

    def _deliver(self, items):
        """Hand [(request_id, RequestOutput | Exception)] to their event loops; abort what nobody hears any more."""
        with self._lock:
            gone = unheard(self._sinks)
            for rid in gone:
                del self._sinks[rid]
            deliveries = []
            for rid, out in items:
                sink = self._sinks.get(rid)
                if sink is None:
                    continue
                if isinstance(out, Exception) or out.finished:
                    del self._sinks[rid]
                deliveries.append((sink, [(rid, out)]))
        for rid in gone + hand_over(deliveries):
            self.abort(rid)


# --- the engine process ------------------------------------------------------------------------


class _EngineCore(AsyncEngine):
    """AsyncEngine whose outputs go back through the pipe: one message per iteration that had work."""

    def __init__(self, engine, conn):
        super().__init__(engine)
        self.conn = conn
        self._items = []

    def _abort_unheard(self):
        pass  # the server process knows which handlers are gone, and sends their aborts

    def _send_all(self, deliveries):
        for _, items in deliveries:
            self._items.extend((rid, _slim(out)) for rid, out in items)

    def _publish(self, stats):
        super()._publish(stats)
        items, self._items = self._items, []
        try:
            self.conn.send((items, stats))
        except OSError:  # the server process is gone
            self._stop.set()


def _slim(out):
    """What crosses the pipe: an output without the prompt (the server has it, and reads neither field; a stream would
    otherwise carry its whole prompt at every step), an error in a form that unpickles."""
    if isinstance(out, Exception):
        return out if _picklable(out) else RuntimeError(f"{type(out).__name__}: {out}")
    return dataclasses.replace(out, prompt=None, prompt_token_ids=None)


def _engine_main(conn, config):
    from eightbit.engine.llm_engine import LLMEngine, freeze_startup_heap

    # Ctrl-C reaches the whole process group, and systemd stops a service by sending SIGTERM to each of its processes:
    # the server process drains its open requests first, then stops us (with a command, or SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        engine = LLMEngine(config)
    except Exception as e:  # sent back to be raised by start(): the same error as building it in the server
        conn.send(("failed", e if _picklable(e) else RuntimeError(traceback.format_exc()), None))
        return
    freeze_startup_heap()  # this process is the engine's
    core = _EngineCore(engine, conn)
    conn.send(("ready", core.info, core.stats))
    threading.Thread(target=_read_commands, args=(conn, core), name="eightbit-engine-commands", daemon=True).start()
    core._run()  # until a stop command, or the server process going away


def _read_commands(conn, core):
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the server process is gone
            message = ("stop",)
        except Exception:  # an unreadable message: stop, so that the server sees the engine end instead of a hang
            log.exception("the engine process could not read a command; stopping")
            message = ("stop",)
        if message[0] == "add":
            _, request_id, token_ids, params, priority, every_step = message
            core.submit(request_id, token_ids, params, _PIPE, priority, every_step)
        elif message[0] == "abort":
            core.abort(message[1])
        else:
            core.stop(timeout=0)
            return


def _picklable(e) -> bool:
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return True
    except Exception:
        return False
