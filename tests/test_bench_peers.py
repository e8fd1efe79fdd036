"""The HF peers' benchmark accounting: left padding, real tokens only, time caps, quantized weight bytes."""

import pytest
import torch

from eightbit.eval.bench_common import BenchRequest, make_requests
from eightbit.eval.bench_engine import Deadline
from eightbit.eval.bench_peers import HFSystem


class FakeHF(HFSystem):
    """generate() without a model: every row of a batch runs to the batch's max_new_tokens."""

    def __init__(self, stop_after_calls=None):
        self.calls = []
        self.stop_after_calls = stop_after_calls
        self.device = torch.device("cpu")

    def generate(self, prompts, max_new_tokens, cache_len=None, deadline=None):
        self.calls.append((len(prompts), max_new_tokens, cache_len))
        if self.stop_after_calls is not None and len(self.calls) > self.stop_after_calls:
            return max_new_tokens // 2, 1.0, True  # the deadline fired half-way through this batch
        return max_new_tokens, 1.0, False


def test_static_batches_count_only_real_tokens():
    reqs = [BenchRequest((1,) * p, o) for p, o in [(3, 5), (7, 2), (2, 9), (4, 4), (6, 1)]]
    fake = FakeHF()
    r = fake.throughput_at_batch(reqs, 2, warmup=False)
    assert [c[:2] for c in fake.calls] == [(2, 5), (2, 9), (1, 1)]  # each batch runs to its longest output
    assert all(c[2] == 7 + 9 for c in fake.calls)  # one static cache length for the whole list
    assert r["real_output_tokens"] == 5 + 2 + 9 + 4 + 1
    assert r["padded_output_tokens"] == 2 * 5 + 2 * 9 + 1
    assert r["output_tok_s"] == pytest.approx(21 / 3.0) and not r["partial"]


def test_partial_batch_at_the_time_cap():
    reqs = [BenchRequest((1,) * 4, o) for o in (10, 3, 8, 6)]
    r = FakeHF(stop_after_calls=1).throughput_at_batch(reqs, 2, warmup=False)
    # batch 1 complete (10 + 3); batch 2 stopped after 8 // 2 = 4 steps: min(8, 4) + min(6, 4)
    assert r["real_output_tokens"] == 13 + 4 + 4 and r["partial"] and r["finished_requests"] == 2


def test_best_batch_prefers_complete_runs():
    class Varying(FakeHF):
        def throughput_at_batch(self, requests, batch, deadline=None, warmup=True):
            tok_s = {4: 100.0, 2: 50.0}[batch]
            return dict(batch=batch, real_output_tokens=10, padded_output_tokens=12, elapsed_s=1.0,
                        output_tok_s=tok_s, finished_requests=4 if batch == 2 else 2, partial=batch == 4)

    rec = Varying().bench_throughput(make_requests(4, 5, 5, 50), [4, 2], base=dict(system="hf-bf16"))
    assert rec["ok"] and rec["batch_size"] == 2 and rec["output_tok_s"] == 50.0 and not rec["partial"]
    assert set(rec["per_batch"]) == {"4", "2"}


@pytest.fixture(scope="module")
def hf_tiny():
    return HFSystem("hf-bf16", "llama-tiny", "cpu", seed=0)


def test_hf_left_padding_generates_to_the_batch_max(hf_tiny):
    reqs = make_requests(3, (4, 12), (2, 6), hf_tiny.vocab_size, seed=5)
    r = hf_tiny.throughput_at_batch(reqs, 3, warmup=False)
    longest = max(q.output_len for q in reqs)
    assert r["padded_output_tokens"] == 3 * longest  # no EOS: every row runs to the batch max
    assert r["real_output_tokens"] == sum(q.output_len for q in reqs)
    n, _, stopped = hf_tiny.generate([[1, 2, 3], [4]], 3, deadline=Deadline(-1))
    assert stopped and n == 1  # the deadline criterion ends generate after the first token


def test_hf_latency_record(hf_tiny):
    (rec,) = hf_tiny.bench_latency([2], prompt_len=6, new_tokens=3, copy_gbs=1.0, base=dict(system="hf-bf16"))
    assert rec["ok"], rec
    assert rec["decode_steps"] == 2 and rec["generated_tokens"] == 6
    w, kv = hf_tiny.weights, hf_tiny.kv_bytes_per_token
    assert kv == 2 * 2 * 2 * 32 * 2  # bf16 K and V, 2 layers x 2 KV heads x 32
    expected = sum(w["shared"] + 2 * w["embedding_row"] + kv * 2 * (6 + i) for i in (1, 2)) / 4
    assert rec["bytes_per_token"] == pytest.approx(expected)


@pytest.mark.parametrize("name", ["hf-bnb-int8", "hf-torchao-int8"])
def test_quantized_peers_build_and_generate(name, hf_tiny):
    system = HFSystem(name, "llama-tiny", "cpu", seed=0)
    assert system.weights["linear"] < 0.6 * hf_tiny.weights["linear"]  # int8 (+ scales) vs bf16
    assert system.weights["lm_head"] == hf_tiny.weights["lm_head"]  # left in bf16, like HF's default
    n, _, _ = system.generate([[5, 6, 7], [8]], 2)
    assert n == 2


def test_bitsandbytes_per_matmul_log_lines_are_silenced(caplog):
    """'MatMul8bitLt: inputs will be cast ...' comes through logging at every int8 matmul (hundreds of lines a
    perplexity window), where warnings filters do not reach."""
    import logging

    from eightbit.eval.peers import quiet_bitsandbytes

    log = logging.getLogger("bitsandbytes.autograd._functions")
    quiet_bitsandbytes()
    with caplog.at_level(logging.NOTSET):
        log.warning("MatMul8bitLt: inputs will be cast from torch.bfloat16 to float16 during quantization")
        log.error("a real error")
    assert [r.getMessage() for r in caplog.records] == ["a real error"]
