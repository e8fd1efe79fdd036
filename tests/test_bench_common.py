"""Benchmark plumbing: the request list, the roofline byte count, copy bandwidth, tables, records."""

import pytest
import torch

from eightbit.eval.bench_common import (
    BenchRequest,
    append_records,
    decode_step_bytes,
    format_table,
    hf_kv_bytes_per_token,
    latest,
    load_records,
    make_requests,
    measure_copy_bandwidth,
    parse_range,
    weight_bytes,
)


def test_requests_deterministic_and_prefix_stable():
    a = make_requests(16, (5, 40), (3, 9), vocab_size=100, seed=3)
    assert a == make_requests(16, (5, 40), (3, 9), vocab_size=100, seed=3)
    assert a[:5] == make_requests(5, (5, 40), (3, 9), vocab_size=100, seed=3)
    assert a != make_requests(16, (5, 40), (3, 9), vocab_size=100, seed=4)
    for r in a:
        assert isinstance(r, BenchRequest)
        assert 5 <= len(r.prompt) <= 40 and 3 <= r.output_len <= 9
        assert all(0 <= t < 100 for t in r.prompt)
    assert len({len(r.prompt) for r in a}) > 1  # lengths really vary


def test_parse_range():
    assert parse_range("100:1024") == (100, 1024)
    assert parse_range("512") == (512, 512)
    assert parse_range((3, 4)) == (3, 4)
    with pytest.raises(ValueError, match="bad length range '9:3'"):
        parse_range("9:3")


def test_weight_bytes_hf_tied_and_untied():
    from transformers import LlamaConfig, LlamaForCausalLM

    h, inter, layers, vocab, heads, kv_heads = 64, 96, 2, 300, 4, 2
    for tied in (False, True):
        cfg = LlamaConfig(hidden_size=h, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                          num_key_value_heads=kv_heads, vocab_size=vocab, tie_word_embeddings=tied)
        m = LlamaForCausalLM(cfg).to(torch.bfloat16)
        w = weight_bytes(m)
        d = h // heads
        per_layer = (h * heads * d + 2 * h * kv_heads * d + heads * d * h + 3 * h * inter) * 2
        assert w["linear"] == layers * per_layer
        assert w["norms"] == (2 * layers + 1) * h * 2
        assert w["lm_head"] == vocab * h * 2  # the tied embedding matrix is the lm_head read
        assert w["embedding_row"] == h * 2
        assert w["shared"] == w["linear"] + w["lm_head"] + w["norms"]
    assert hf_kv_bytes_per_token(cfg) == 2 * layers * kv_heads * d * 2


def test_decode_step_bytes():
    w = dict(shared=1000, embedding_row=10)
    assert decode_step_bytes(w, 4.0, [5, 7]) == 1000 + 2 * 10 + 4 * 12


def test_copy_bandwidth_cpu():
    r = measure_copy_bandwidth("cpu", nbytes=1 << 20, iters=2)
    assert r["copy_"] > 0 and r["torch_elementwise"] > 0 and r["triton"] is None
    assert r["best_gbs"] == max(r["copy_"], r["torch_elementwise"])


def test_table_and_records(tmp_path):
    text = format_table(["a", "bb"], [["x", 1.234], ["yy", None]], "T")
    lines = text.splitlines()
    assert lines[0] == "T" and "1.23" in lines[3] and lines[4].endswith("-")
    append_records(tmp_path, [dict(k=1, v=1), dict(k=2, v=2)])
    append_records(tmp_path, [dict(k=1, v=3)])
    (tmp_path / "results.jsonl").open("a").write("{not json\n")
    recs = load_records([tmp_path, tmp_path / "missing"])
    assert [r["v"] for r in recs] == [1, 2, 3]
    assert [r["v"] for r in latest(recs, lambda r: r["k"])] == [3, 2]


def test_kernel_times_counts_device_events_once():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from eightbit.eval.bench_common import kernel_times

    def ev(name, dev, us):
        return SimpleNamespace(name=name, device_type=dev, time_range=SimpleNamespace(elapsed_us=lambda: us))

    events = [ev("aten::mm", DeviceType.CPU, 30.0), ev("gemm", DeviceType.CUDA, 20.0),
              ev("gemm", DeviceType.CUDA, 22.0), ev("norm", DeviceType.CUDA, 3.0)]
    assert kernel_times(events) == {"gemm": [42.0, 2], "norm": [3.0, 1]}


def test_parse_range_refuses_a_zero_length():
    assert parse_range("1:1") == (1, 1)
    for text in ("0:5", "0", (0, 3)):  # a request of 0 prompt (or output) tokens is not a request
        with pytest.raises(ValueError, match="need 1 <= lo <= hi"):
            parse_range(text)
