"""`eightbit serve`: the OpenAI-compatible server on uvicorn, and a background-thread launcher.

Wire it into eightbit/cli.py with `add_serve_parser(sub)` next to the other subcommands.
"""

import argparse
import asyncio
import dataclasses
import logging
import signal
import socket
import sys
import threading
import time
import types

from eightbit.engine.config import LOAD_FORMATS, EngineConfig

log = logging.getLogger("eightbit.server")

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
# How long an idle HTTP/1.1 connection stays open. Longer than clients keep idle connections in their pools (httpx
# and the OpenAI SDK: 5 s, aiohttp: 15 s), so that the client, not the server, closes them: with uvicorn's default
# of 5 s, a load of 2,000 requests at 256 in flight lost 2-5 requests a run to resets (docs/benchmarks.md).
KEEP_ALIVE_S = 60
# How long a shutdown (Ctrl-C, SIGTERM) waits for open requests before closing them: without a bound, uvicorn waits
# for every open stream, which may run to the end of the context, and SIGTERM from systemd or Kubernetes hangs until
# SIGKILL.
GRACEFUL_SHUTDOWN_S = 5
# The requests still open this long before that wait ends are answered with a 503 (a stream: its SSE error event and
# [DONE]), so that clients get an error they can read rather than a connection cut mid-answer.
SHUTDOWN_ANSWER_S = 0.5


def add_serve_parser(subparsers):
    from eightbit.cli import add_engine_args

    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API (/v1/completions, "
                              "/v1/chat/completions, /v1/models, /health, /metrics)")
    add_engine_args(p)
    _add_missing_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients pass as `model` (default: --model as given, or "
                        f"{EMBEDDED_MODEL_NAME} for the embedded model)")
    p.add_argument("--max-queue", type=_at_least_one, default=None,
                   help="most prompts waiting for their first token; past it, 503 with Retry-After "
                        "(default: no bound, requests wait)")
    p.add_argument("--tokenizer-workers", type=_at_least_one, default=2,
                   help="threads tokenizing requests (default: 2)")
    p.add_argument("--timeout-keep-alive", type=_at_least_one, default=KEEP_ALIVE_S,
                   help=f"seconds an idle connection stays open (default: {KEEP_ALIVE_S}, longer than clients' "
                        "pools keep them, so clients close them first)")
    p.add_argument("--timeout-graceful-shutdown", type=_at_least_one, default=GRACEFUL_SHUTDOWN_S,
                   help=f"seconds a shutdown (Ctrl-C, SIGTERM) waits for open requests before it closes them "
                        f"(default: {GRACEFUL_SHUTDOWN_S})")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine loop in a process of its own, so that it does not share the interpreter "
                        "lock with the HTTP server (default: on; --no-engine-process runs it in a thread)")
    p.add_argument("--allowed-origins", type=_origins, default=("local",), metavar="ORIGINS",
                   help="comma-separated web origins (e.g. https://chat.example.com) whose pages may call the API "
                        "from a browser (CORS); 'local' (the default) pages served from this machine (localhost, "
                        "127.0.0.1, [::1], any port), '*' any page the user has open (vLLM's default), '' none")
    p.add_argument("--exclude-tools-when-tool-choice-none", action=argparse.BooleanOptionalAction, default=False,
                   help='as vLLM: the chat template does not get a request\'s tools when tool_choice is "none" (here '
                        "the only tool_choice taken; also functions with function_call \"none\"), so that the model "
                        "does not see them (default: off, the template gets them)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run_serve)
    return p


def _arg_type(annotation):
    """(type, is_bool) from a dataclass field annotation such as `int | None`."""
    if isinstance(annotation, types.UnionType):
        annotation = next(a for a in annotation.__args__ if a is not type(None))
    return annotation, annotation is bool


# What each engine option not in eightbit.cli.add_engine_args does (a new EngineConfig field needs a line here).
_ENGINE_HELP = {
    "block_size": "tokens per KV-cache block, a power of two (default: 16)",
    "max_num_seqs": "most sequences in one step (default: 256)",
    "max_num_batched_tokens": "most new tokens in one step; longer prompts are prefilled in chunks (default: 8192)",
    "enable_prefix_caching": "reuse the KV blocks of a prompt prefix seen before (default: on)",
    "load_format": "dummy: random weights of the model's shapes, for benchmarks (default: auto)",
    "gpu_memory_utilization": "share of the GPU's memory the engine may take; the KV cache gets what the weights "
                              "and activations leave (default: 0.9)",
    "kv_cache_memory_gb": "a fixed KV-cache size in GiB (default: from --gpu-memory-utilization; 1 GiB on the CPU)",
    "num_kv_blocks": "a fixed number of KV-cache blocks, over the memory-based sizing (default: none)",
    "enforce_eager": "run every step eagerly, without CUDA graphs (default: off)",
    "async_scheduling": "launch the next decode step before this one's tokens reach the host (default: on CUDA only)",
    "seed": "seeds the sampling of requests that carry no seed, and dummy weights (default: 0)",
}


def _add_missing_engine_args(parser):
    """Every EngineConfig field as a flag, unless eightbit.cli.add_engine_args already has it."""
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "model" or flag in parser._option_string_actions:
            continue  # add_engine_args defines it
        typ, is_bool = _arg_type(f.type)
        kwargs = dict(default=f.default, help=_ENGINE_HELP[f.name])
        if is_bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = typ
        if f.name == "load_format":
            kwargs["choices"] = list(LOAD_FORMATS)
        parser.add_argument(flag, **kwargs)


def serve_engine_options(args) -> dict:
    from eightbit.cli import engine_options

    options = engine_options(args)
    for f in dataclasses.fields(EngineConfig):
        if f.name != "model" and f.name not in options and hasattr(args, f.name):
            options[f.name] = getattr(args, f.name)
    return options


def default_model_name(model) -> str:
    return EMBEDDED_MODEL_NAME if model is None else str(model)


def check_address(host, port):
    """Raise ValueError unless this process could listen on host:port now."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            s.bind((host, port))
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def build_server(engine, model_name=None, max_queue=None, tokenizer_workers=2, allowed_origins=("local",),
                 exclude_tools_when_tool_choice_none=False):
    """(engine loop started, FastAPI app). engine: an LLMEngine (its loop then runs in a thread of this process), or
    an engine loop (an EngineProcess, an AsyncEngine)."""
    from eightbit.engine.server.api import build_app
    from eightbit.engine.server.async_engine import AsyncEngine

    loop = (engine if hasattr(engine, "submit") else AsyncEngine(engine)).start()
    name = model_name or default_model_name(loop.info.model)
    return loop, build_app(loop, name, max_queue=max_queue, tokenizer_workers=tokenizer_workers,
                           allowed_origins=allowed_origins,
                           exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none)


def _origins(text: str) -> tuple:
    return tuple(o.strip() for o in text.split(",") if o.strip())


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:  # argparse's own message would name this function
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def run_serve(args) -> int:
    from eightbit.engine.llm_engine import LLMEngine, freeze_startup_heap
    from eightbit.engine.server.engine_process import EngineProcess

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_address(args.host, args.port)  # before the model loads, not after
    config = EngineConfig(model=args.model, **serve_engine_options(args))
    engine = EngineProcess(config) if args.engine_process else LLMEngine(config)
    freeze_startup_heap()  # this process is the server's (the engine process freezes its own)
    async_engine, app = build_server(engine, args.served_model_name, args.max_queue, args.tokenizer_workers,
                                     args.allowed_origins, args.exclude_tools_when_tool_choice_none)
    server = uvicorn_server(app, engine=async_engine, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_keep_alive=args.timeout_keep_alive,
                            timeout_graceful_shutdown=args.timeout_graceful_shutdown)
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again under the handler it found: the default
    # one ended the process there, before the engine process was stopped below, which then outlived us
    main_thread = threading.current_thread() is threading.main_thread()  # where signal handlers can be set
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main_thread else None
    try:
        server.run()
    finally:
        async_engine.stop()
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    if server.engine_lost is not None:
        print(f"eightbit serve: error: {server.engine_lost}; the server stopped", file=sys.stderr)
        return 1
    return 0


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # the shell's status for a process that SIGTERM ended


def uvicorn_server(app, engine=None, **config):
    """uvicorn's Server for our app, whose shutdown answers the requests still open near the end of its graceful
    wait (SHUTDOWN_ANSWER_S) instead of cutting them off when the wait ends.

    engine: the engine loop to watch (`eightbit serve`). If it stops while the server runs (the engine process
    killed, a crash), the server shuts down, with the reason in `engine_lost`, so that the command exits non-zero
    and a supervisor (systemd, Kubernetes) restarts it, rather than answering 503 for ever."""
    import uvicorn

    from eightbit.engine.server.protocol import APIError

    class Server(uvicorn.Server):
        engine_lost = None  # why the engine loop stopped, once it has
        _dead_ticks = 0

        async def on_tick(self, counter):
            # (not once a shutdown has begun: then the engine stops as part of it)
            if engine is not None and self.engine_lost is None and not self.should_exit and not engine.alive:
                # an EngineProcess's reason is None until its reader thread has joined the process (within 5 s)
                self._dead_ticks += 1
                reason = getattr(engine, "exit_reason", "the engine loop stopped (its error is logged above)")
                if reason is None and self._dead_ticks > 100:  # 10 s: its reader is gone too
                    reason = "the engine process stopped"
                if reason is not None:
                    self.engine_lost = reason
                    log.error("%s: shutting down", reason)
                    self.should_exit = True
            return await super().on_tick(counter)

        def handle_exit(self, sig, frame):
            if self.should_exit and sig == signal.SIGINT:  # a second Ctrl-C: uvicorn quits now, cancelling requests
                logging.getLogger("uvicorn.error").addFilter(_not_a_cancellation)
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None):
            timeout = self.config.timeout_graceful_shutdown
            if timeout is None:  # uvicorn waits for open requests as long as they run
                return await super().shutdown(sockets)
            answer = asyncio.create_task(_answer_open_requests(max(timeout - SHUTDOWN_ANSWER_S, timeout / 2)))
            try:
                await super().shutdown(sockets)
            finally:
                answer.cancel()

    async def _answer_open_requests(after_s):
        await asyncio.sleep(after_s)
        app.state.server.end_open_requests(APIError("the server is shutting down", status=503, type="server_error",
                                                    code="shutting_down"))

    return Server(uvicorn.Config(app, **config))


def _not_a_cancellation(record) -> bool:
    """A log filter: False for the traceback of a task that uvicorn's forced exit cancelled (one per open request,
    and the lifespan task's, which starlette hands over as text), True for everything else."""
    if record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError):
        return False
    return not str(record.msg).rstrip().endswith("asyncio.exceptions.CancelledError")


class BackgroundServer:
    """The server on uvicorn in a daemon thread (tests, notebooks). port=0 picks a free port.

    >>> srv = BackgroundServer(LLMEngine(EngineConfig(dtype="float32"))).start()
    >>> srv.url   # http://127.0.0.1:<port>
    >>> srv.stop()
    """

    def __init__(self, engine, host="127.0.0.1", port=0, model_name=None, max_queue=None, tokenizer_workers=2,
                 log_level="warning", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, allowed_origins=("local",),
                 exclude_tools_when_tool_choice_none=False):
        self.async_engine, self.app = build_server(engine, model_name, max_queue, tokenizer_workers,
                                                   allowed_origins, exclude_tools_when_tool_choice_none)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        self.server = uvicorn_server(self.app, log_level=log_level, timeout_keep_alive=KEEP_ALIVE_S,
                                     timeout_graceful_shutdown=timeout_graceful_shutdown)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="eightbit-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0):
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        return self

    def stop(self):
        self.server.should_exit = True
        self._thread.join(10)
        self.async_engine.stop()
        self._sock.close()
