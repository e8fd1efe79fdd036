"""The OpenAI-compatible HTTP server (`eightbit serve`).

- protocol.py: request/response bodies; async_engine.py: the engine loop (a thread) and its queues;
- engine_process.py: that loop in a process of its own, behind a pipe (`eightbit serve`'s default);
- api.py: the FastAPI app; metrics.py: Prometheus text; cli.py: `add_serve_parser`, `BackgroundServer`.

Nothing heavy is imported here, so `eightbit --help` stays fast: import the submodules.
"""
