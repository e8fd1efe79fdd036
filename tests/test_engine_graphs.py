"""The CUDA-graph steps' padding, checked on the CPU.

A graph runs its step from static buffers padded to a bucket: decode pads the batch with
length-0 sequences, prefill pads the tokens with one more sequence whose slots are -1, after
its sequence slots (those a step leaves unused are empty: no tokens, length 0). On
the CPU nothing can be captured, so `EagerReplay` stands in for the graph and runs the same
forward from the same buffers, with the reference ops; the engine must give the same tokens
and log-probs as its plain eager path, and padding must never write to the cache.
(`tests/test_engine_gpu.py` checks the real graphs on a GPU.)
"""

import pytest
import torch

from eightbit import LLM, SamplingParams
from eightbit.engine.context import reset_context, set_context
from eightbit.engine.cuda_graphs import DecodeGraphs, PrefillGraphs, batch_buckets, token_buckets
from eightbit.engine.model_runner import PREFILL_GRAPH_SEQS, pack_sequences
from eightbit.kernels.reference import v_token_major

OPTIONS = dict(load_format="dummy", device="cpu", dtype="float32", kv_cache_memory_gb=0.05)


class EagerReplay:
    """A captured graph's forward, run eagerly from its static buffers."""

    def __init__(self, graphs, size):
        self.graphs, self.size = graphs, size

    def replay(self):
        set_context(self.graphs._context(self.size, warm_up=False))
        try:
            self.graphs._forward(self.size)
        finally:
            reset_context()


def _with_fake_graphs(llm, max_batch, max_prefill, max_seqs=PREFILL_GRAPH_SEQS):
    runner = llm.engine.runner
    shape = (-(-llm.engine.max_model_len // runner.block_size), runner.model.config.hidden_size,
             torch.float32, runner.device)
    runner.decode_graphs = DecodeGraphs(runner.model, max_batch, *shape)
    runner.prefill_graphs = PrefillGraphs(runner.model, max_prefill, max_seqs, *shape)
    replays = []
    for graphs in (runner.decode_graphs, runner.prefill_graphs):
        graphs.graphs = {size: EagerReplay(graphs, size) for size in graphs.buckets}
        run = graphs.run
        graphs.run = lambda *a, run=run, kind=type(graphs).__name__: replays.append((kind, len(a[0]))) or run(*a)
    return replays


def _prompt(i, n):
    return [(7 * i + 3 * j) % 1000 + 1 for j in range(n)]


def _chosen(dicts):
    return torch.tensor([next(iter(d.values())) for d in dicts if d is not None])


def test_buckets():
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(3) == [1, 2, 3]
    assert token_buckets(300) == [16, 32, 64, 128, 256, 300]
    assert token_buckets(1024)[-3:] == [768, 896, 1024]
    assert token_buckets(10) == []


def test_pack_sequences():
    # token offsets of sequences of 5, 3, 9 and 2 tokens
    cu = [0, 5, 8, 17, 19]
    assert pack_sequences(cu, 8, 1024) == [(0, 4)]
    assert pack_sequences(cu, 2, 1024) == [(0, 2), (2, 4)]
    assert pack_sequences(cu, 8, 9) == [(0, 2), (2, 3), (3, 4)]
    assert pack_sequences(cu, 8, 8) is None  # the 9-token sequence fits no graph
    assert pack_sequences([0, 4], 1, 4) == [(0, 1)]


@pytest.mark.parametrize("max_seqs, batch_replays", [(PREFILL_GRAPH_SEQS, [30]), (2, [19, 11])])
def test_graph_padding_matches_eager_cpu(max_seqs, batch_replays):
    scored = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    cached = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0)
    requests = [([_prompt(i, n)], scored) for i, n in enumerate((1, 5, 16, 17, 40, 200, 300))]
    # a prefix-cache hit (a 20-token chunk after 96 cached tokens), then a batch of 3 (decode bucket 4)
    requests += [([_prompt(50, 100)], cached), ([_prompt(50, 100)[:96] + _prompt(51, 20)], cached)]
    requests += [([_prompt(60 + i, 9 + i) for i in range(3)], cached)]

    ref = LLM("llama-tiny", **OPTIONS)
    want = [ref.generate(p, sp, use_tqdm=False) for p, sp in requests]
    llm = LLM("llama-tiny", **OPTIONS)
    replays = _with_fake_graphs(llm, max_batch=8, max_prefill=256, max_seqs=max_seqs)
    got = [llm.generate(p, sp, use_tqdm=False) for p, sp in requests]

    prefills = sorted(n for kind, n in replays if kind == "PrefillGraphs")
    # prefills up to 256 tokens, the batch of 3 in as few replays as max_seqs allows (300 runs eagerly; a 1-token
    # prompt is a decode step)
    assert prefills == sorted([5, 16, 17, 40, 200, 100, 20] + batch_replays)
    assert ("DecodeGraphs", 3) in replays and ("DecodeGraphs", 1) in replays
    for (prompts, _), w_outs, g_outs in zip(requests, want, got):
        for p, w, g in zip(prompts, w_outs, g_outs):
            msg = f"prompt of {len(p)} tokens"
            assert g.outputs[0].token_ids == w.outputs[0].token_ids, msg
            torch.testing.assert_close(_chosen(g.outputs[0].logprobs), _chosen(w.outputs[0].logprobs),
                                       atol=1e-4, rtol=0, msg=msg)
            if g.prompt_logprobs is not None and len(p) > 1:
                torch.testing.assert_close(_chosen(g.prompt_logprobs), _chosen(w.prompt_logprobs),
                                           atol=1e-4, rtol=0, msg=msg)


def test_prefill_padding_writes_nowhere_cpu():
    llm = LLM("llama-tiny", **OPTIONS)
    replays = _with_fake_graphs(llm, max_batch=4, max_prefill=64)
    cache = llm.engine.runner.kv_cache
    cache.k.zero_()
    cache.v.zero_()
    lens = (20, 7)
    llm.generate([_prompt(i, n) for i, n in enumerate(lens)], SamplingParams(temperature=0, max_tokens=1),
                 use_tqdm=False)
    assert replays == [("PrefillGraphs", 27)]
    # two prompts in one replay, 27 tokens padded to the 32-token bucket: exactly their 27 slots were written, in
    # K and V of every layer
    bs = llm.engine.runner.block_size
    tables = llm.engine.runner.prefill_graphs.block_tables
    want = sorted(int(tables[r, p // bs]) * bs + p % bs for r, n in enumerate(lens) for p in range(n))
    assert cache.k.shape[0] == llm.engine.runner.model.config.num_hidden_layers
    for layer in range(cache.k.shape[0]):
        for name, c in (("K", cache.k[layer]), ("V", v_token_major(cache.k[layer], cache.v[layer]))):
            written = (c != 0).any(-1).any(-1).flatten().nonzero().flatten().tolist()  # [blocks * block_size]
            assert written == want, f"layer {layer} {name}"


def test_decode_graph_steps_with_prompt_chunks_match_eager_cpu():
    """A token budget of 2 makes every step of two sequences decode-shaped (one new token each) while the second
    prompt is fed a token at a time: rows that do not sample (the graph computed their logits; the step takes the
    sampling rows') and prompt log-probs scored from the graph's hidden states."""
    opts = dict(OPTIONS, max_num_batched_tokens=2, max_num_seqs=2)
    first = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    second = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    prompts = [_prompt(1, 2), _prompt(2, 7)]

    ref = LLM("llama-tiny", **opts)
    want = ref.generate(prompts, [first, second], use_tqdm=False)
    llm = LLM("llama-tiny", **opts)
    replays = _with_fake_graphs(llm, max_batch=2, max_prefill=16)
    got = llm.generate(prompts, [first, second], use_tqdm=False)

    assert replays.count(("DecodeGraphs", 2)) >= 6  # the second prompt's one-token chunks beside the first's decodes
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        torch.testing.assert_close(_chosen(g.outputs[0].logprobs), _chosen(w.outputs[0].logprobs), atol=1e-4, rtol=0)
    torch.testing.assert_close(_chosen(got[1].prompt_logprobs), _chosen(want[1].prompt_logprobs), atol=1e-4, rtol=0)


def test_kv_budget_reserves_the_decode_graphs_logits_cpu():
    """The decode graphs' static logits (and the model-dtype logits they are cast from, in the graphs' pool) are
    held for the engine's life, so the KV budget must leave room for them beside the graphs' fixed reserve."""
    from eightbit.engine.llm_engine import GRAPH_RESERVE_BYTES

    llm = LLM("llama-tiny", **dict(OPTIONS, max_num_seqs=8))
    _with_fake_graphs(llm, max_batch=8, max_prefill=64)
    logits = llm.engine.runner.decode_graphs.logits
    cast_from = logits.numel() * llm.engine.config.torch_dtype.itemsize
    assert llm.engine._graph_bytes() - GRAPH_RESERVE_BYTES >= logits.numel() * logits.element_size() + cast_from
    eager = LLM("llama-tiny", **dict(OPTIONS, max_num_seqs=8, enforce_eager=True))
    assert eager.engine._graph_bytes() == GRAPH_RESERVE_BYTES
    # a decode step holds at most max_num_batched_tokens sequences (each takes a token of the budget): no graph
    # and no logits rows for more (64 seats with a budget of 16 captured 32, 48 and 64 and reserved 64 rows)
    engine = LLM("llama-tiny", **dict(OPTIONS, max_num_seqs=64, max_num_batched_tokens=16)).engine
    per_row = engine.hf_config.vocab_size * (4 + engine.config.torch_dtype.itemsize)
    assert engine._max_graph_batch() == 16 and engine._graph_bytes() - GRAPH_RESERVE_BYTES == 16 * per_row


def test_a_kv_budget_used_up_by_the_step_says_what_took_it(monkeypatch):
    """It said the cache "holds 0 tokens (0 blocks of 16)", as if it were merely small, without the measured step or
    the options that size it. (Simulated: an 80 GiB card whose weights and biggest step take 70 GiB.)"""
    from eightbit.engine import llm_engine

    llm = LLM("llama-tiny", **dict(OPTIONS, max_model_len=256))
    engine = llm.engine
    monkeypatch.setattr(llm_engine.LLMEngine, "on_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 10 * 2**30)
    monkeypatch.setattr(engine.runner, "profile_peak_memory", lambda *args: 70 * 2**30)
    monkeypatch.setattr(engine.config, "num_kv_blocks", None)
    monkeypatch.setattr(engine.config, "kv_cache_memory_gb", None)
    with pytest.raises(ValueError, match=r"no GPU memory is left for the KV cache: 0.9 of 80.0 GiB, less 10.0 GiB held "
                                         r"by other processes, the weights and the biggest step's activations \(70.0 "
                                         r"GiB, measured at max_num_batched_tokens=\d+ and max_num_seqs=\d+\).*raise "
                                         r"gpu_memory_utilization, or lower max_num_batched_tokens / max_num_seqs"):
        engine._num_kv_blocks()


def test_sample_logits_takes_the_graph_rows_that_sample_and_computes_the_rest():
    """A decode graph hands back the logits of its first `have` rows; rows that sample are taken from them, the others
    go through the lm_head. Reference: the lm_head over every row, indexed by the sampling rows. (A one-token row that
    does not sample, a 1-token prompt chunk beside decodes, is where the graph's rows are not all taken.)"""
    from eightbit.engine.model_runner import ModelRunner

    class Head:
        def __init__(self):
            self.w = torch.randn(11, 6, dtype=torch.float64)

        def compute_logits(self, h):
            return h @ self.w.T

    head = Head()
    runner = ModelRunner(head, block_size=16, device="cpu")
    hidden = torch.randn(8, 6, dtype=torch.float64)
    full = head.compute_logits(hidden)
    for have in (0, 3, 8):
        for rows in ([0, 2, 5, 7], [1, 2], [3, 4, 6], list(range(8)), [0, 1, 2], [5]):
            got = runner._sample_logits(hidden, full[:have] if have else None, torch.tensor(rows))
            torch.testing.assert_close(got, full[rows])
