"""eval/bench_server.py on the llama-tiny dummy model (CPU): both runs do the same work, and what it reports adds up."""

import json

import pytest

from eightbit.eval import bench_server


@pytest.mark.parametrize("stream", [False, True])
def test_the_server_run_matches_the_offline_one(stream, tmp_path, capsys):
    out = tmp_path / "server.jsonl"
    argv = ["--model", "llama-tiny", "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-gb", "0.05",
            "--num-requests", "12", "--concurrency", "4", "--input-len", "8:40", "--output-len", "2:9",
            "--json", str(out)] + (["--stream"] if stream else [])
    assert bench_server.main(argv) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["engine_loop"] for r in records] == ["thread", "process"]  # both loops by default, one line each
    requests = bench_server_requests(12, "8:40", "2:9")
    printed = capsys.readouterr().out
    for r in records:
        assert r["output_tokens"] == sum(n for _, n in requests)  # every request came back with its exact max_tokens
        assert r["server_tok_s"] == pytest.approx(r["output_tokens"] / r["server_s"])
        assert r["ratio"] == pytest.approx(r["server_tok_s"] / r["offline_tok_s"])
        assert r["stream"] is stream and (r["ttft_p50_s"] is not None) is stream
        # the engine's counters reach /metrics from either loop
        assert 0 < r["loop_model_s"] <= r["loop_busy_s"] and r["server_steps"] >= r["offline_steps"] / 2
        assert f"engine loop in a {r['engine_loop']}) {r['server_tok_s']:.0f} tok/s" in printed


def bench_server_requests(n, input_len, output_len):
    from eightbit.eval.bench_common import make_requests

    return [(r.prompt, r.output_len) for r in make_requests(n, input_len, output_len, 1024, 0)]


def test_a_request_that_fails_fails_the_run(monkeypatch):
    """A benchmark that lost requests reports no throughput (a failed request would look fast)."""
    real = bench_server.run_client

    def losing_one(url, model, requests, concurrency, stream, processes):
        wall, cpu, results = real(url, model, requests, concurrency, stream, processes)
        results[0] = dict(error="ReadError('')", start=0.0, at=0.1)
        return wall, cpu, results

    monkeypatch.setattr(bench_server, "run_client", losing_one)
    with pytest.raises(RuntimeError, match="1 failed"):
        bench_server.bench_server("llama-tiny", 4, 2, False, "8:16", "2:3", loops=("thread",), device="cpu",
                                  dtype="float32", kv_cache_memory_gb=0.05, **bench_server.ENGINE_OPTIONS)


def test_a_client_that_dies_fails_the_run_instead_of_hanging_it():
    with pytest.raises(RuntimeError, match="ended .exit code 1. without results"):
        bench_server.run_client("http://127.0.0.1:9", "m", [("not a request",)], 1, False)  # the child cannot unpack
