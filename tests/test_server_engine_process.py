"""The engine loop in a process of its own (EngineProcess): what building it raises reaches the caller, a dying
engine process fails what is in flight instead of hanging it, and stopping it leaves no process behind.
(Requests and their answers through it: tests/test_server.py runs every server test against both loops.)"""

import json
import os
import signal
import time

import httpx
import pytest

from eightbit import EngineConfig
from eightbit.engine.server.async_engine import AsyncEngine
from eightbit.engine.server.cli import BackgroundServer
from eightbit.engine.server.engine_process import EngineProcess

ENGINE_OPTIONS = dict(model="llama-tiny", load_format="dummy", dtype="float32", device="cpu", kv_cache_memory_gb=0.05)
PROMPT = [5, 17, 300, 42, 7, 99, 1000, 3]


def completion(srv, **body):
    return httpx.post(srv.url + "/v1/completions", json=dict(model="llama-tiny", prompt=PROMPT, **body), timeout=60)


def test_what_building_the_engine_raises_is_raised_by_start():
    import multiprocessing

    others = {p.pid for p in multiprocessing.active_children()}  # e.g. tests/test_server.py's server, still up
    loop = EngineProcess(EngineConfig(**dict(ENGINE_OPTIONS, kv_cache_memory_gb=1e-4)))
    with pytest.raises(ValueError, match="the KV cache holds .* fewer than one max_model_len"):
        loop.start()
    assert not loop.alive and loop._proc is None  # a second start() starts afresh
    assert not [p for p in multiprocessing.active_children() if p.pid not in others]


def test_answers_come_back_and_stop_ends_the_process():
    """(Greedy answers equal to the offline engine's: tests/test_server.py, on SmolLM2, for both loops.)"""
    srv = BackgroundServer(EngineProcess(EngineConfig(**ENGINE_OPTIONS))).start()
    proc = srv.async_engine._proc
    try:
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json=dict(
                model="llama-tiny", prompt=PROMPT, max_tokens=7, ignore_eos=True, stream=True)) as resp:
            chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 6 + ["length"]  # a chunk per token
        r = completion(srv, max_tokens=7, temperature=0, ignore_eos=True).json()
        assert r["usage"]["completion_tokens"] == 7 and r["choices"][0]["finish_reason"] == "length"
        stats = httpx.get(srv.url + "/metrics").text
        assert "eightbit_generation_tokens_total 14" in stats  # the engine process's counters reach /metrics
    finally:
        srv.stop()
    assert not proc.is_alive() and proc.exitcode == 0


def test_a_dying_engine_process_fails_what_is_in_flight_and_health_says_so():
    srv = BackgroundServer(EngineProcess(EngineConfig(**ENGINE_OPTIONS))).start()
    try:
        assert httpx.get(srv.url + "/health").status_code == 200
        body = dict(model="llama-tiny", prompt=PROMPT, max_tokens=1000, ignore_eos=True, stream=True)
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: {")  # generating
            os.kill(srv.async_engine._proc.pid, signal.SIGKILL)
            rest = list(lines)
        errors = [json.loads(line[6:])["error"] for line in rest if line.startswith('data: {"error"')]
        assert len(errors) == 1 and "the engine process died (exit code -9)" in errors[0]["message"]
        assert [line for line in rest if line][-1] == "data: [DONE]"
        deadline = time.monotonic() + 10
        while srv.async_engine.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(srv.url + "/health").status_code == 503
        late = completion(srv, max_tokens=3)
        assert late.status_code == 503 and late.json()["error"]["code"] == "engine_dead"
    finally:
        srv.stop()


def test_the_engine_process_outlives_a_sigterm_so_that_the_server_can_drain():
    """systemd stops a service by sending SIGTERM to every process in it. The engine process ignores it: the server
    process drains its open requests, then stops the engine (with a command, or SIGKILL, which stop() falls back to)."""
    srv = BackgroundServer(EngineProcess(EngineConfig(**ENGINE_OPTIONS))).start()
    proc = srv.async_engine._proc
    try:
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(0.5)
        assert proc.is_alive() and srv.async_engine.alive
        r = completion(srv, max_tokens=3, ignore_eos=True)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        srv.stop()
    assert not proc.is_alive() and proc.exitcode == 0  # it ended on the stop command


SERVER_PROCESS = """
import sys, time
from eightbit import EngineConfig
from eightbit.engine.server.engine_process import EngineProcess
loop = EngineProcess(EngineConfig(**%r)).start()
print(loop._proc.pid, flush=True)
time.sleep(600)
"""


def _running(pid) -> bool:
    """Whether pid is a live process (not gone, not a zombie that its new parent has yet to reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_engine_process_stops_when_the_server_process_is_killed(tmp_path):
    """A server process killed with SIGKILL (the OOM killer) runs no clean-up: its end of the pipe closes with it,
    and the engine process stops instead of idling for ever as an orphan holding the model's memory. (A real server
    process, so that nothing else holding the pipe could hide the close.)"""
    import subprocess
    import sys

    server = subprocess.Popen([sys.executable, "-c", SERVER_PROCESS % ENGINE_OPTIONS], stdout=subprocess.PIPE,
                              text=True, cwd=tmp_path)
    engine_pid = None
    try:
        line = server.stdout.readline()
        assert line, "the server process ended before its engine process had started"
        engine_pid = int(line)
        assert _running(engine_pid)
        server.kill()
        server.wait(10)
        deadline = time.monotonic() + 20
        while _running(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(engine_pid), "the engine process outlived its server process by 20 s"
    finally:
        server.kill()
        if engine_pid is not None and _running(engine_pid):
            os.kill(engine_pid, signal.SIGKILL)


@pytest.mark.parametrize("flags, loop_type", [([], EngineProcess),
                                               (["--no-engine-process", "--exclude-tools-when-tool-choice-none"],
                                                AsyncEngine)])
def test_serve_runs_the_engine_in_its_own_process_unless_told_not_to(flags, loop_type, monkeypatch):
    """(and a server option, --exclude-tools-when-tool-choice-none, reaches the app; off by default)"""
    import uvicorn

    from eightbit.cli import main as cli_main

    def serve(server, sockets=None):  # instead of serving: check the loop behind the app, and that it answers
        state = server.config.app.state.server
        loop = state.engine
        assert type(loop) is loop_type and loop.alive
        assert state.exclude_tools_when_tool_choice_none == ("--exclude-tools-when-tool-choice-none" in flags)
        seen.append(loop)

    seen = []
    monkeypatch.setattr(uvicorn.Server, "run", serve)
    assert cli_main(["serve", "--model", "llama-tiny", "--load-format", "dummy", "--device", "cpu", "--dtype",
                     "float32", "--kv-cache-memory-gb", "0.05", "--port", "0", *flags]) == 0
    assert len(seen) == 1 and not seen[0].alive  # stopped when uvicorn returned


def test_serve_stops_its_engine_process_before_it_exits_on_sigterm(monkeypatch):
    """uvicorn shuts down on SIGTERM, then raises it again under the handler it found when it started. With the
    default handler the process ended right there and its engine process outlived it."""
    import uvicorn

    from eightbit.cli import main as cli_main

    def serve(server, sockets=None):  # uvicorn's end after a SIGTERM, its own handlers restored
        seen.append(server.config.app.state.server.engine)
        signal.raise_signal(signal.SIGTERM)

    def process_ends(signum, frame):  # stands in for the default handler, which would end pytest too
        raise RuntimeError("the process ended here")

    seen = []
    monkeypatch.setattr(uvicorn.Server, "run", serve)
    before = signal.signal(signal.SIGTERM, process_ends)
    try:
        with pytest.raises(SystemExit) as exited:
            cli_main(["serve", "--model", "llama-tiny", "--load-format", "dummy", "--device", "cpu", "--dtype",
                      "float32", "--kv-cache-memory-gb", "0.05", "--port", "0"])
        assert signal.getsignal(signal.SIGTERM) is process_ends  # put back
    finally:
        signal.signal(signal.SIGTERM, before)
    assert exited.value.code == 128 + signal.SIGTERM
    assert len(seen) == 1 and type(seen[0]) is EngineProcess and not seen[0].alive
    assert not seen[0]._proc.is_alive()  # stopped and joined


def test_serve_exits_non_zero_when_its_engine_process_dies(monkeypatch, capsys):
    """Killed as the OOM killer would, the engine process takes `eightbit serve` down with it: the server shuts down
    and the command exits 1 with the reason, so that a supervisor restarts it (before: 503 for ever)."""
    import threading

    from eightbit.cli import main as cli_main
    from eightbit.engine.server import cli as serve_cli

    made = {}
    real_start, real_server = EngineProcess.start, serve_cli.uvicorn_server
    monkeypatch.setattr(EngineProcess, "start", lambda self: made.setdefault("engine", real_start(self)))
    monkeypatch.setattr(serve_cli, "uvicorn_server",
                        lambda *a, **kw: made.setdefault("server", real_server(*a, **kw)))

    def kill_the_engine_process():
        deadline = time.monotonic() + 120
        while not getattr(made.get("server"), "started", False) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(made["engine"]._proc.pid, signal.SIGKILL)
        time.sleep(30)
        made["server"].should_exit = True  # so that a server that does not notice fails the test, not hangs it

    threading.Thread(target=kill_the_engine_process, daemon=True).start()
    code = cli_main(["serve", "--model", "llama-tiny", "--load-format", "dummy", "--device", "cpu", "--dtype",
                     "float32", "--kv-cache-memory-gb", "0.05", "--port", "0", "--log-level", "warning"])
    assert code == 1
    assert ("eightbit serve: error: the engine process died (exit code -9); the server stopped"
            in capsys.readouterr().err)
    assert not made["engine"]._proc.is_alive()


def test_messages_to_the_engine_process_never_interleave():
    """Handlers (submit, abort), the reader (aborts for closed event loops) and stop() all send on one pipe, and a
    large message goes out as several writes: no send may start while another is under way."""
    import threading

    class SlowPipe:  # a send that takes a while, like a large message's several writes
        def __init__(self):
            self.inside = self.most_inside = 0
            self.guard = threading.Lock()

        def send(self, message):
            with self.guard:
                self.inside += 1
                self.most_inside = max(self.most_inside, self.inside)
            time.sleep(0.002)
            with self.guard:
                self.inside -= 1

    loop = EngineProcess(EngineConfig(**ENGINE_OPTIONS))
    loop._conn = pipe = SlowPipe()
    sink = None  # never delivered to: nothing comes back from this pipe

    def handler(i):
        for j in range(20):
            loop.submit(f"{i}-{j}", PROMPT, None, sink)
            loop.abort(f"{i}-{j}")

    def reader():
        for j in range(40):
            loop._send(("abort", f"gone-{j}"))

    threads = [threading.Thread(target=handler, args=(i,)) for i in range(3)] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pipe.most_inside == 1


class NeedsTwoArguments(Exception):
    def __init__(self, a, b):
        super().__init__(a)


def test_what_crosses_the_pipe_unpickles_and_leaves_the_prompt_behind():
    """An error that pickles but does not unpickle would kill the reading thread; a stream's output would carry its
    whole prompt at every step."""
    import pickle

    from eightbit.engine.outputs import CompletionOutput, RequestOutput
    from eightbit.engine.server.engine_process import _slim

    with pytest.raises(TypeError):
        pickle.loads(pickle.dumps(NeedsTwoArguments("x", 1)))
    err = pickle.loads(pickle.dumps(_slim(NeedsTwoArguments("bad thing", 1))))
    assert type(err) is RuntimeError and str(err) == "NeedsTwoArguments: bad thing"
    assert type(_slim(ValueError("too long"))) is ValueError  # kept as it is: the server maps it to a 400
    out = RequestOutput("r", "a prompt", list(range(2000)), None, [CompletionOutput(0, "hi", [5, 6], delta="hi")])
    slim = pickle.loads(pickle.dumps(_slim(out)))
    assert slim.prompt is None and slim.prompt_token_ids is None and slim.outputs == out.outputs
    assert out.prompt_token_ids == list(range(2000))  # the engine's own output is left alone


def test_an_engine_process_killed_while_starting_is_reported_with_its_exit_code(monkeypatch):
    loop = EngineProcess(EngineConfig(**ENGINE_OPTIONS))
    real_wait = EngineProcess._wait_for_start

    def kill_first(self):  # as the kernel's OOM killer would, while the engine is still being built
        os.kill(self._proc.pid, signal.SIGKILL)
        return real_wait(self)

    monkeypatch.setattr(EngineProcess, "_wait_for_start", kill_first)
    with pytest.raises(RuntimeError, match=r"the engine process exited \(code -9\) while building the engine"):
        loop.start()
    assert loop._proc is None and not loop.alive
