"""Mixed steps: one-token sequences go first and through decode attention, the rest through prefill.

The split must not change what any sequence computes: checked on the CPU (reference ops) at the
attention layer against running every sequence through prefill attention, and at the engine
against each request run alone.
"""

import pytest
import torch

from eightbit import LLM, SamplingParams
from eightbit.engine import model_runner
from eightbit.engine.context import Context, reset_context, set_context
from eightbit.engine.layers.attention import Attention
from eightbit.kernels import reference as R


def _layer_with_cache(hq, hkv, d, nblocks, page, dtype):
    layer = Attention(hq, hkv, d)
    layer.k_cache = torch.zeros(nblocks, page, hkv, d, dtype=dtype)
    layer.v_cache = torch.zeros(R.v_cache_shape(nblocks, page, hkv, d, dtype), dtype=dtype)
    if dtype == torch.int8:
        layer.k_scale = torch.zeros(nblocks, page, hkv, d // 16, dtype=torch.float16)
        layer.v_scale = torch.zeros_like(layer.k_scale)
    f = torch.outer(torch.arange(512, dtype=torch.float32), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    layer.cos_sin_cache = torch.cat([f.cos(), f.sin()], -1)
    return layer


def test_mixed_step_matches_all_prefill():
    torch.manual_seed(0)
    hq, hkv, d, page = 8, 2, 32, 4
    # (context already cached, new tokens): two decodes first, then a chunk and a whole prompt
    seqs = [(9, 1), (3, 1), (5, 6), (0, 7)]
    for dtype in (torch.float32, torch.int8):
        layer = _layer_with_cache(hq, hkv, d, 40, page, dtype)
        tables, slots, positions, lens = [], [], [], []
        nxt = 0
        for ctx_len, n in seqs:
            blocks = list(range(nxt, nxt + -(-(ctx_len + n) // page)))
            nxt += len(blocks)
            tables.append(blocks + [0] * (5 - len(blocks)))
            positions += range(ctx_len, ctx_len + n)
            slots += [blocks[p // page] * page + p % page for p in range(ctx_len, ctx_len + n)]
            lens.append(ctx_len + n)
            if ctx_len:  # the cached context, written as an earlier step would have
                k, v = torch.randn(ctx_len, hkv, d), torch.randn(ctx_len, hkv, d)
                ctx_slots = torch.tensor([blocks[p // page] * page + p % page for p in range(ctx_len)])
                R.kv_write(k, v, layer.k_cache, layer.v_cache, layer.k_scale, layer.v_scale, ctx_slots)
        t = len(positions)
        q, k, v = torch.randn(t, hq * d), torch.randn(t, hkv * d), torch.randn(t, hkv * d)
        common = dict(slot_mapping=torch.tensor(slots), block_tables=torch.tensor(tables, dtype=torch.int32),
                      seq_lens=torch.tensor(lens, dtype=torch.int32))
        ns = [n for _, n in seqs]
        cu_all = torch.tensor([0] + list(torch.cumsum(torch.tensor(ns), 0)), dtype=torch.int32)
        outs = []
        for ctx in (Context(cu_seqlens_q=cu_all, num_decodes=0, **common),
                    Context(cu_seqlens_q=cu_all[2:] - 2, num_decodes=2, **common)):
            set_context(ctx)
            try:  # the same tokens rewrite the same slots, so both runs see one cache
                outs.append(layer(torch.tensor(positions), q, k, v))
            finally:
                reset_context()
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_engine_mixed_steps_match_requests_run_alone():
    # a small token budget: prompts are chunked while other requests decode, so most steps are mixed
    options = dict(load_format="dummy", device="cpu", dtype="float32", kv_cache_memory_gb=0.05)
    prompts = [[(5 * i + 3 * j) % 900 + 1 for j in range(n)] for i, n in enumerate((3, 17, 9, 30))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    alone = LLM("llama-tiny", **options)
    want = [alone.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
    llm = LLM("llama-tiny", max_num_batched_tokens=8, **options)
    mixed = []
    real_run = llm.engine.runner.run

    def run(scheduled, *args, **kwargs):
        ns = [n for _, n in scheduled]
        mixed.append(1 in ns and any(n > 1 for n in ns))
        return real_run(scheduled, *args, **kwargs)

    llm.engine.runner.run = run
    got = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert sum(mixed) >= 3, "the schedule should contain mixed steps"
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        chosen = [[d[t] for d, t in zip(o.logprobs, o.token_ids)] for o in (g, w)]
        torch.testing.assert_close(torch.tensor(chosen[0]), torch.tensor(chosen[1]), rtol=0, atol=1e-4)


def test_every_layer_of_a_mixed_step_passes_the_kernels_the_same_metadata(monkeypatch):
    """The kernels build per-step work once (the decode's work order, the prefill's tile map) and reuse it while
    they are given the same tensors: every layer of a step must pass the same views, not new slices of its own."""
    import eightbit.engine.layers.attention as attention

    seen = []
    for name in ("decode_attention", "prefill_attention"):
        real = getattr(attention.ops, name)

        def record(*args, _real=real, _name=name):
            seen.append((_name, id(args[5]), id(args[-2])))  # block tables, seq_lens
            return _real(*args)

        monkeypatch.setattr(attention.ops, name, record)
    llm = LLM(load_format="dummy", model="llama-tiny", dtype="float32", device="cpu", max_model_len=128,
              kv_cache_memory_gb=0.05, max_num_batched_tokens=24, enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request("a", list(range(1, 6)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # a's prompt: a decode from now on
    engine.add_request("b", list(range(7, 47)), SamplingParams(max_tokens=2, ignore_eos=True))
    mixed = None
    for _ in range(4):  # with async scheduling a step may only collect the one launched ahead
        seen.clear()
        engine.step()
        if {c[0] for c in seen} == {"decode_attention", "prefill_attention"}:  # a's token and a chunk of b's
            mixed = list(seen)
            break
    assert mixed is not None, "no mixed step"
    layers = engine.hf_config.num_hidden_layers
    for name in ("decode_attention", "prefill_attention"):
        calls = [c for c in mixed if c[0] == name]
        assert len(calls) == layers and len(set(calls)) == 1, name


class _EagerGraphs:
    """Stands in for a runner's captured CUDA graphs on the CPU: takes every step of its kind (decode: one token a
    sequence; prefill: up to max_seqs sequences of up to max_tokens tokens in all) and runs it eagerly, returning
    what the graphs return."""

    def __init__(self, runner, decode, max_seqs=8, max_tokens=1024):
        self.runner, self.decode, self.steps = runner, decode, []
        self.max_seqs, self.buckets = max_seqs, [max_tokens]

    def fits(self, n, context):
        if self.decode:
            return context.is_decode
        return context.num_decodes == 0 and len(context.seq_lens) <= self.max_seqs and n <= self.buckets[-1]

    def run(self, input_ids, positions, context):
        self.steps.append(len(input_ids))
        hidden = self.runner._run_eager(input_ids, positions, context)
        return hidden, self.runner.model.compute_logits(hidden) if self.decode else None


@pytest.mark.parametrize("graph_seqs, limits", [(1, None), (8, None), (2, None), (1, (3, 7)), (1, (2, 8))])
def test_steps_split_into_graph_replays_match_requests_run_alone(graph_seqs, limits, monkeypatch):
    """A step no one graph takes (decodes beside prefill sequences, or more prefill sequences than a prefill graph
    holds) runs as the decode graph's replay and one prefill-graph replay per run of prefill sequences
    (ModelRunner._run_split_graphs): every request's tokens and log-probs as when it runs alone, prompt log-probs
    included, with the logits of the decode rows taken from the decode graph and the prefill rows' computed.
    graph_seqs: sequences a prefill graph takes; limits: (prefill replays, prefill tokens) past which a step runs
    eagerly, lowered so that this schedule meets them (None: the engine's)."""
    if limits:
        monkeypatch.setattr(model_runner, "MAX_PREFILL_REPLAYS", limits[0])
        monkeypatch.setattr(model_runner, "MAX_SPLIT_TOKENS", limits[1])
    max_replays, max_tokens = limits or (model_runner.MAX_PREFILL_REPLAYS, model_runner.MAX_SPLIT_TOKENS)
    options = dict(load_format="dummy", device="cpu", dtype="float32", kv_cache_memory_gb=0.05)
    prompts = [[(7 * i + 5 * j) % 900 + 1 for j in range(n)] for i, n in enumerate((4, 21, 2, 13, 3))]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    alone = LLM("llama-tiny", **options)
    want = [alone.generate([p], params, use_tqdm=False)[0] for p in prompts]
    llm = LLM("llama-tiny", max_num_batched_tokens=8, **options)
    runner = llm.engine.runner
    runner.decode_graphs = _EagerGraphs(runner, True)
    runner.prefill_graphs = _EagerGraphs(runner, False, max_seqs=graph_seqs)
    steps = []  # (one-token sequences, prefill sequences, prefill tokens, run as replays) of each step no graph took
    real_split = runner._run_split_graphs

    def run_split(input_ids, positions, context):
        out = real_split(input_ids, positions, context)
        nd = context.num_decodes
        steps.append((nd, len(context.seq_lens) - nd, len(input_ids) - nd, out is not None))
        return out

    runner._run_split_graphs = run_split
    got = llm.generate(prompts, params, use_tqdm=False)
    split = [s for s in steps if s[3]]
    replays = lambda p: -(-p // graph_seqs)  # this schedule's steps have at most 8 tokens: runs by count alone
    assert any(d and p == 1 for d, p, _, _ in split), steps
    if graph_seqs < 3:  # else every step of prefill sequences alone fits one graph
        assert any(p > graph_seqs for d, p, _, _ in split), steps
    elif not limits:  # decodes beside several prompt chunks: one prefill replay
        assert any(d and p > 1 for d, p, _, _ in split), steps
    assert all((replays(p) <= max_replays and t <= max_tokens) == replayed for d, p, t, replayed in steps), steps
    assert len(split) < len(steps) if limits else len(split) == len(steps), steps
    assert runner.decode_graphs.steps and runner.prefill_graphs.steps
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert a.keys() == b.keys()
            torch.testing.assert_close(torch.tensor(list(a.values())), torch.tensor(list(b.values())), rtol=0,
                                       atol=1e-4)
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            torch.testing.assert_close(torch.tensor(list(a.values())), torch.tensor(list(b.values())), rtol=0,
                                       atol=1e-4)


def test_a_one_token_prefill_after_a_longer_one_in_the_same_step():
    """A prompt found in the prefix cache recomputes only its last token: admitted after a new prompt in the same
    step, it is a one-token sequence behind a longer one, which ModelRunner.run must sort first (the decode part of
    the context is its first rows). Reference: each prompt alone on a fresh engine."""
    options = dict(load_format="dummy", device="cpu", dtype="float32", kv_cache_memory_gb=0.05)
    cached = [(5 * j) % 900 + 3 for j in range(33)]  # two full blocks of 16 cached, the 33rd token recomputed
    new = [(7 * j) % 900 + 11 for j in range(20)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    want = [LLM("llama-tiny", **options).generate([p], params, use_tqdm=False)[0].outputs[0] for p in (new, cached)]
    llm = LLM("llama-tiny", **options)
    llm.generate([cached], SamplingParams(max_tokens=1), use_tqdm=False)
    orders, real_run = [], llm.engine.runner.run

    def run(scheduled, *args, **kwargs):
        orders.append([n for _, n in scheduled])
        return real_run(scheduled, *args, **kwargs)

    llm.engine.runner.run = run
    got = [o.outputs[0] for o in llm.generate([new, cached], params, use_tqdm=False)]
    assert [20, 1] in orders  # the case under test happened
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        for a, b in zip(g.logprobs, w.logprobs):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
