"""The benchmarks' correctness gates: a kernel output that is wrong (or NaN) stops the run before it is timed."""

import pytest
import torch

from eightbit.eval.bench_attention import check_close
from eightbit.eval.bench_gemm import check_gemm


def test_gemm_gate_takes_one_bf16_rounding_and_nothing_more():
    want = torch.tensor([[1.0, -2.0, 300.0, 0.0]]).to(torch.bfloat16)
    check_gemm("ok", want.clone(), want)
    check_gemm("one rounding", (want.float() * (1 + 2**-8)).to(torch.bfloat16), want)
    with pytest.raises(RuntimeError, match="bad gives a wrong result .*not timed"):
        check_gemm("bad", want.float().mul(1.05).to(torch.bfloat16), want)
    with pytest.raises(RuntimeError, match="not timed"):
        check_gemm("nan", torch.full_like(want, float("nan")), want)


def test_attention_gate_refuses_large_errors_and_nan():
    ref = torch.randn(4, 8)
    assert check_close("ok", ref + 1e-3, ref) == pytest.approx(1e-3, rel=1e-2)
    with pytest.raises(RuntimeError, match="max abs error 0.1 .*not timed"):
        check_close("bad", ref + 0.1, ref)
    out = ref.clone()
    out[1, 2] = float("nan")
    with pytest.raises(RuntimeError, match="nan"):
        check_close("nan", out, ref)


def test_hf_throughput_goal_compares_the_same_requests_only():
    from eightbit.eval.bench_cli import check_goals

    def thr(system, n, tok_s, **kw):
        return dict(bench="throughput", system=system, num_requests=n, ok=True, output_tok_s=tok_s, **kw)

    hf = thr("hf-bf16-compile", 64, 500.0, batch_size=16)
    other_list = [thr("eightbit-int8", 256, 12000.0), hf]
    goal = next(g for g in check_goals(other_list) if "HF bf16 compiled" in g["goal"])
    assert goal["status"] == "n/a" and "no int8 run on the same requests" in goal["detail"]
    same = [thr("eightbit-int8", 64, 5000.0), thr("eightbit-int8", 256, 12000.0), hf]
    goal = next(g for g in check_goals(same) if "HF bf16 compiled" in g["goal"])
    assert goal["status"] == "PASS" and goal["value"] == pytest.approx(10.0)


def test_latency_table_shows_the_ttft_peers_are_compared_on():
    from eightbit.eval.bench_cli import latency_rows, latency_table

    rec = dict(bench="latency", system="eightbit-int8", batch=64, prompt_len=512, new_tokens=128, ok=True,
               ttft_ms=80.0, ttft_ms_max=150.0, tpot_ms=5.0, tok_s=1.0, decode_tok_s=1.0)
    rows = latency_rows([rec])
    assert rows[0]["ttft_ms"] == 80.0 and rows[0]["ttft_max_ms"] == 150.0
    text = latency_table(rows)
    assert "TTFT all ms" in text and "150" in text
