"""eightbit's own benchmarks on the llama-tiny dummy model (CPU): accounting, roofline bytes, outputs on disk."""

import json

import pytest

from eightbit.eval.bench_common import make_requests
from eightbit.eval.bench_engine import (
    Deadline,
    bench_latency,
    bench_throughput,
    build_llm,
    engine_info,
)

# llama-tiny: hidden 128, intermediate 256, 2 layers, 4 heads / 2 KV heads (head_dim 32), vocab 1024, untied
H, I, L, HQ, HKV, D, V = 128, 256, 2, 4, 2, 32, 1024


@pytest.fixture(scope="module")
def int8_llm():
    return build_llm("eightbit-int8", "llama-tiny", "cpu", dtype="float32", kv_cache_memory_gb=0.01, max_model_len=256)


def test_roofline_bytes_by_hand(int8_llm):
    info = engine_info(int8_llm)
    w = info["weights"]
    outs = [HQ * D + 2 * HKV * D, H, 2 * I, H]  # qkv, o, gate_up, down (output rows)
    ins = [H, HQ * D, H, I]
    linear = L * sum(o * i * 1 + o * 4 for o, i in zip(outs, ins))  # int8 weights + float32 per-row scales
    assert w["linear"] == linear == 303104
    assert w["lm_head"] == V * H * 4  # float32 engine here: lm_head stays in the float dtype
    assert w["norms"] == (2 * L + 1) * H * 4
    assert w["embedding_row"] == H * 4
    assert info["kv_bytes_per_token"] == 2 * L * HKV * D * (1 + 2 / 32)  # int8 values + fp16 scale per 32


def test_latency_accounting(int8_llm):
    P, N = 12, 5
    recs = bench_latency(int8_llm, [1, 3], prompt_len=P, new_tokens=N, copy_gbs=10.0, base=dict(system="x"))
    assert [r["batch"] for r in recs] == [1, 3] and all(r["ok"] for r in recs), recs
    r = recs[0]
    assert r["generated_tokens"] == N and r["decode_steps"] == N - 1
    assert r["ttft_ms"] > 0 and r["tpot_ms"] > 0 and r["tok_s"] > 0
    assert r["ttft_samples"] == 9 and r["ttft_ms_single"] > 0  # short prefills: the median of 9 more
    w, kv = r["weights"], r["kv_bytes_per_token"]
    # decode step producing token n (2..N) attends the prompt and the n - 1 tokens before it
    expected = sum(w["shared"] + w["embedding_row"] + kv * (P + n - 1) for n in range(2, N + 1)) / (N - 1)
    assert r["bytes_per_token"] == pytest.approx(expected)
    assert r["roofline_pct"] == pytest.approx(100 * r["achieved_gbs"] / 10.0)
    assert recs[1]["generated_tokens"] == 3 * N
    assert recs[1]["bytes_per_token"] < r["bytes_per_token"]  # the weights are shared by the batch


def test_throughput_counts_each_requests_own_length(int8_llm):
    reqs = make_requests(4, (5, 30), (2, 9), V, seed=1)
    rec = bench_throughput(int8_llm, reqs, base=dict(system="eightbit-int8"))
    assert rec["ok"], rec
    assert rec["output_tokens"] == rec["expected_output_tokens"] == sum(r.output_len for r in reqs)
    assert rec["finished_requests"] == 4 and not rec["partial"]
    assert rec["output_tok_s"] == pytest.approx(rec["output_tokens"] / rec["elapsed_s"])
    assert not int8_llm.engine.has_unfinished_requests()


class StepsDeadline(Deadline):
    """Passes after `n` checks (one check before the run, then one per engine step)."""

    def __init__(self, n):
        super().__init__(None)
        self.n = n

    def passed(self):
        self.n -= 1
        return self.n < 0


def test_time_cap_stops_cleanly(int8_llm):
    reqs = make_requests(3, (5, 10), (50, 60), V, seed=2)
    rec = bench_throughput(int8_llm, reqs, deadline=StepsDeadline(4), warmup=False)
    assert rec["ok"] and rec["partial"] and "time cap" in rec["note"]
    assert rec["output_tokens"] == 3 * 3  # 3 steps: the prefill's token, then two decode steps
    assert rec["finished_requests"] == 0
    assert not int8_llm.engine.has_unfinished_requests()  # aborted, blocks returned
    lat = bench_latency(int8_llm, [1], prompt_len=8, new_tokens=4, deadline=Deadline(-1))
    assert not lat[0]["ok"] and "time cap" in lat[0]["error"]


def test_cli_run_and_summary(tmp_path, capsys):
    from eightbit.eval.bench_cli import main

    common = ["--model", "llama-tiny", "--device", "cpu", "--out", str(tmp_path), "--kv-cache-memory-gb", "0.01",
              "--max-model-len", "256", "--num-requests", "4", "--input-len", "5:20", "--output-len", "2:6",
              "--prefix", "2", "--batch-sizes", "1,2", "--prompt-len", "8", "--new-tokens", "3",
              "--copy-bytes", str(1 << 20), "--time-cap", "120"]
    assert main(["run", "--system", "eightbit-int8", "--benches", "capacity,latency,throughput", *common]) == 0
    assert main(["run", "--system", "eightbit-bf16", "--benches", "latency,throughput", *common]) == 0
    assert main(["summary", "--out", str(tmp_path), "--expect", "eightbit-int8,eightbit-bf16,hf-bf16-compile"]) == 0
    out = capsys.readouterr().out
    for name in ("capacity", "latency", "throughput"):
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
        data = json.loads((tmp_path / f"{name}.json").read_text())
        assert data["rows"] and data["records"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    status = {g["goal"]: g["status"] for g in summary["goals"]}
    assert status["KV tokens, int8 KV / bf16 KV"] == "PASS"
    assert status["throughput W8A8+KV8 / HF bf16 compiled (best batch)"] == "n/a"
    assert summary["missing"] == ["hf-bf16-compile"]
    thr = {(r["system"], r["requests"]): r for r in summary["throughput"]}
    assert thr[("eightbit-int8", 4)]["int8_speedup"] == 1.0
    assert thr[("eightbit-bf16", 2)]["int8_speedup"] > 0
    assert "Issue 6 goals" in out and "Missing systems" in out
    cap = {r["config"]: r for r in summary["capacity"]}  # same KV budget (0.01 GiB) each way
    assert cap["w8a8 + int8 KV"]["kv_bytes_per_token"] == 272 and cap["w8a8 + bf16 KV"]["kv_bytes_per_token"] == 512
    assert cap["w8a8 + int8 KV"]["vs_bf16_kv"] == pytest.approx(512 / 272, rel=1e-3)


def test_cli_rejects_an_unknown_model_shape_before_anything_runs(tmp_path, capsys):
    from eightbit.cli import main

    out = tmp_path / "out"
    assert main(["bench", "latency", "--model", "lama-3-8b", "--device", "cpu", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "got 'lama-3-8b'" in err and "'llama-3-8b'" in err  # the typo, and the shapes there are
    assert not out.exists()


@pytest.mark.parametrize("option, value, message", [
    ("--batch-sizes", "0,1", "--batch-sizes must be comma-separated integers >= 1, got '0,1'"),  # an ok record of 0 tok/s
    ("--batch-sizes", "1;16", "--batch-sizes must be comma-separated integers >= 1"),  # a bare int() error, minutes in
    ("--hf-batch-sizes", "0", "--hf-batch-sizes must be comma-separated integers >= 1"),
    ("--input-len", "100:10", "--input-len must be LO:HI or N with 1 <= LO <= HI, got '100:10'"),
    ("--prefix", "-5", "--prefix must be >= 1, got -5"),  # ran all but the last 5 requests
    ("--benches", ",", "--benches names no benchmark"),  # did nothing, silently
])
def test_cli_rejects_bad_numbers_before_anything_runs(tmp_path, capsys, monkeypatch, option, value, message):
    import eightbit.eval.bench_cli as bench_cli
    from eightbit.cli import main

    monkeypatch.setattr(bench_cli, "run_system", lambda *a: pytest.fail("the run started"))
    out = tmp_path / "out"
    assert main(["bench", "run", "--model", "llama-tiny", "--device", "cpu", "--out", str(out), option, value]) == 2
    assert message in capsys.readouterr().err and not out.exists()


def test_cli_rejects_a_copy_the_l2_would_hold_on_a_gpu(tmp_path, capsys, monkeypatch):
    import eightbit.eval.bench_cli as bench_cli
    from eightbit.cli import main

    monkeypatch.setattr(bench_cli, "run_system", lambda *a: pytest.fail("the run started"))
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert main(["bench", "latency", "--model", "llama-tiny", "--out", str(tmp_path), "--copy-bytes",
                 str(1 << 20)]) == 2
    assert "--copy-bytes must be >= 268435456 on a GPU" in capsys.readouterr().err
