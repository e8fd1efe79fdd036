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
    # HF at its best batch size: a later, slower run at another batch (a second call, merged) does not replace it
    later = same + [thr("hf-bf16-compile", 64, 400.0, batch_size=32)]
    goal = next(g for g in check_goals(later) if "HF bf16 compiled" in g["goal"])
    assert goal["value"] == pytest.approx(10.0) and "HF at batch 16" in goal["detail"]
    partial = later + [thr("hf-bf16-compile", 64, 900.0, batch_size=64, partial=True)]  # stopped at its cap
    goal = next(g for g in check_goals(partial) if "HF bf16 compiled" in g["goal"])
    assert goal["value"] == pytest.approx(10.0)
    # another workload's HF run (no int8 run on its list) is not compared; a partial run with a reference is
    other = later + [thr("hf-bf16-compile", 128, 2000.0, batch_size=64)]
    assert next(g for g in check_goals(other) if "HF bf16 compiled" in g["goal"])["value"] == pytest.approx(10.0)
    only_partial = [thr("eightbit-int8", 64, 5000.0), thr("hf-bf16-compile", 128, 800.0, batch_size=64),
                    thr("hf-bf16-compile", 64, 500.0, batch_size=64, partial=True)]
    goal = next(g for g in check_goals(only_partial) if "HF bf16 compiled" in g["goal"])
    assert goal["value"] == pytest.approx(10.0) and "partial" in goal["detail"]
    # the table shows each batch size's run, so it agrees with the goal
    from eightbit.eval.bench_cli import throughput_rows

    rows = [r for r in throughput_rows(later) if r["system"] == "hf-bf16-compile"]
    assert sorted((r["batch"], r["output_tok_s"]) for r in rows) == [(16, 500.0), (32, 400.0)]


def test_latency_table_shows_the_ttft_peers_are_compared_on():
    from eightbit.eval.bench_cli import latency_rows, latency_table

    rec = dict(bench="latency", system="eightbit-int8", batch=64, prompt_len=512, new_tokens=128, ok=True,
               ttft_ms=80.0, ttft_ms_max=150.0, tpot_ms=5.0, tok_s=1.0, decode_tok_s=1.0)
    rows = latency_rows([rec])
    assert rows[0]["ttft_ms"] == 80.0 and rows[0]["ttft_max_ms"] == 150.0
    text = latency_table(rows)
    assert "TTFT all ms" in text and "150" in text


def test_every_roofline_is_taken_against_the_best_copy_bandwidth_of_its_card():
    """Each process measured its own copy bandwidth; the int8 one measured it 3-15 % low (after the capacity
    benchmark's engines), which lifted its % of the roofline and could pass the batch-1 goal by itself."""
    from eightbit.eval.bench_cli import against_best_copy, check_goals, latency_rows

    h200, h100 = {"gpu": "NVIDIA H200", "host": "a"}, {"gpu": "NVIDIA H100", "host": "b"}

    def copy(gbs, env):
        return dict(bench="copy", ok=True, best_gbs=gbs, env=env)

    def lat(system, gbs, own, env):
        return dict(bench="latency", system=system, batch=1, prompt_len=512, new_tokens=128, ok=True, ttft_ms=1.0,
                    tpot_ms=1.0, achieved_gbs=gbs, copy_gbs=own, roofline_pct=100 * gbs / own, env=env)

    records = against_best_copy([copy(4050.0, h200), lat("eightbit-int8", 2900.0, 4050.0, h200),
                                 copy(4230.0, h200), lat("eightbit-bf16", 2000.0, 4230.0, h200),
                                 copy(3000.0, h100), lat("eightbit-int8", 2100.0, 3000.0, h100)])
    int8 = [r for r in records if r.get("system") == "eightbit-int8"]
    assert int8[0]["roofline_pct"] == pytest.approx(100 * 2900 / 4230) and int8[0]["copy_gbs_own"] == 4050.0
    assert int8[1]["roofline_pct"] == pytest.approx(70.0)  # another card: its own best
    rows = latency_rows(records[:4])
    assert [round(r["roofline_pct"], 1) for r in rows] == [68.6, 47.3]
    goal = next(g for g in check_goals(records[:4]) if "roofline" in g["goal"])
    assert goal["status"] == "FAIL" and goal["detail"] == "2900 of 4230 GB/s"  # 71.6 % against its own 4,050


def test_the_throughput_chart_labels_only_speed_ups_on_the_same_requests(tmp_path, monkeypatch):
    import matplotlib.axes

    from eightbit.eval.bench_cli import plot_throughput, throughput_rows

    def thr(system, n, tok_s):
        return dict(bench="throughput", system=system, num_requests=n, ok=True, output_tok_s=tok_s)

    labels = []
    real = matplotlib.axes.Axes.text
    monkeypatch.setattr(matplotlib.axes.Axes, "text",
                        lambda self, x, y, s, **kw: labels.append(s.strip()) or real(self, x, y, s, **kw))
    rows = throughput_rows([thr("eightbit-int8", 256, 12000.0), thr("eightbit-bf16", 256, 10000.0),
                            thr("hf-bf16-compile", 64, 500.0)])
    assert [r["int8_speedup"] for r in rows] == [pytest.approx(1.0), pytest.approx(1.2), pytest.approx(24.0)]
    plot_throughput(rows, tmp_path / "t.png")
    assert labels == ["int8 1.00x", "int8 1.20x"]  # not 24x against 64 requests of another workload


def test_the_summary_refuses_to_pair_records_of_other_models_or_request_lists():
    """Records were paired by system and request count only: a 1B run's int8 against an 8B run's bf16."""
    from eightbit.eval.bench_cli import check_one_workload

    def thr(system, model, lens=("100:1024", "100:1024")):
        return dict(bench="throughput", system=system, model=model, num_requests=64, ok=True, output_tok_s=1.0,
                    input_len=lens[0], output_len=lens[1], seed=0)

    check_one_workload([thr("eightbit-int8", "llama-3-8b"), thr("eightbit-bf16", "llama-3-8b"),
                        dict(bench="copy", model="llama-3.2-1b")])
    with pytest.raises(ValueError, match="several models llama-3-8b, llama-3.2-1b"):
        check_one_workload([thr("eightbit-int8", "llama-3.2-1b"), thr("eightbit-bf16", "llama-3-8b")])
    with pytest.raises(ValueError, match="several request lists"):
        check_one_workload([thr("eightbit-int8", "llama-3-8b"), thr("eightbit-bf16", "llama-3-8b", ("5:20", "2:6"))])
