import math

import pytest
import torch

from eightbit.engine.sampler import (SamplingTensors, adjust_logits, filtered_logits, gather_logprobs,
                                     logprobs_to_dicts, make_generator, sample)
from eightbit.engine.sampling_params import SamplingParams

NEG_INF = float("-inf")
P4 = [0.5, 0.3, 0.15, 0.05]


def ref_probs(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    """Independent pure-Python reference: the distribution a sampled row draws from."""
    x = [v / temperature for v in logits]

    def softmax(vals):
        m = max(vals)
        e = [math.exp(v - m) if v != NEG_INF else 0.0 for v in vals]
        return [v / sum(e) for v in e]

    order = sorted(range(len(x)), key=lambda i: -x[i])
    if top_k > 0:  # every token tied with the k-th stays (vLLM, HF)
        kth = x[order[min(top_k, len(x)) - 1]]
        x = [v if v >= kth else NEG_INF for v in x]
    if top_p < 1:
        p, mass = softmax(x), 0.0
        for i in order:
            if mass >= top_p:
                x[i] = NEG_INF
            mass += p[i]
    if min_p > 0:
        p = softmax(x)
        x = [NEG_INF if p[i] < min_p * max(p) else x[i] for i in range(len(x))]
    return softmax(x)


def kept(logits_row, **kw):
    t = SamplingTensors.from_params([SamplingParams(**kw)])
    out = filtered_logits(torch.tensor([logits_row]), t)[0]
    return sorted(i for i in range(len(logits_row)) if out[i] > NEG_INF)


LOGP4 = [math.log(p) for p in P4]
PERM = [2, 0, 3, 1]  # same distribution with the tokens shuffled: masks must follow the ids
LOGP4_PERM = [LOGP4[PERM.index(i)] for i in range(4)]  # token i has prob P4[PERM.index(i)]


@pytest.mark.parametrize("kw, expected", [
    (dict(), [0, 1, 2, 3]),
    (dict(top_k=2), [0, 1]),
    (dict(top_k=1), [0]),
    (dict(top_k=0), [0, 1, 2, 3]),
    (dict(top_k=100), [0, 1, 2, 3]),
    (dict(top_p=0.45), [0]),           # the top token always stays
    (dict(top_p=1e-300), [0]),         # also where top_p is 0 in float32
    (dict(top_p=0.75), [0, 1]),
    (dict(top_p=0.81), [0, 1, 2]),
    (dict(top_p=0.96), [0, 1, 2, 3]),
    (dict(min_p=0.2), [0, 1, 2]),      # floor 0.1
    (dict(min_p=0.5), [0, 1]),         # floor 0.25
    (dict(min_p=1.0), [0]),
    (dict(top_k=2, top_p=0.6), [0]),   # top-p sees the top-k renormalized mass 0.625
    (dict(top_p=0.9), [0, 1, 2]),
    (dict(top_p=0.9, temperature=0.5), [0, 1]),  # temperature first: probs .685 .247 .062 ...
])
def test_filter_masks_hand_computed(kw, expected):
    assert kept(LOGP4, **kw) == expected
    assert kept(LOGP4_PERM, **kw) == sorted(PERM[i] for i in expected)
    ref = ref_probs(LOGP4, **{"top_k": -1, **kw})
    assert [i for i, p in enumerate(ref) if p > 0] == expected


def test_top_p_keeps_no_token_past_a_mass_exactly_equal_to_it():
    """Four equal tokens (0.25 each, exact in binary): top_p = 0.5 is reached by two of them."""
    assert kept([0.0, 0.0, 0.0, 0.0], top_p=0.5) == [0, 1]
    assert kept([0.0, 0.0, 0.0, 0.0], top_p=0.75) == [0, 1, 2]


@pytest.mark.parametrize("k, expected", [(1, [0]), (2, [0, 1, 2, 3]), (4, [0, 1, 2, 3]), (5, [0, 1, 2, 3, 4])])
def test_top_k_keeps_every_token_tied_with_the_kth(k, expected):
    assert kept([2.0, 1.0, 1.0, 1.0, 0.0], top_k=k) == expected
    assert [i for i, p in enumerate(ref_probs([2.0, 1.0, 1.0, 1.0, 0.0], top_k=k)) if p > 0] == expected


def test_filters_match_reference_on_random_rows():
    torch.manual_seed(1)
    logits = torch.randn(6, 50) * 3
    params = [SamplingParams(temperature=0.7, top_k=10), SamplingParams(top_p=0.8),
              SamplingParams(min_p=0.1, temperature=1.3), SamplingParams(),
              SamplingParams(top_k=20, top_p=0.9, min_p=0.05, temperature=0.9),
              SamplingParams(temperature=0.0)]
    probs = filtered_logits(logits, SamplingTensors.from_params(params)).softmax(-1)
    for row, p in enumerate(params[:-1]):
        ref = ref_probs(logits[row].double().tolist(), p.temperature, p.top_k, p.top_p, p.min_p)
        torch.testing.assert_close(probs[row].double(), torch.tensor(ref, dtype=torch.float64),
                                   atol=1e-5, rtol=1e-4)


def test_greedy_is_argmax_and_logits_untouched():
    torch.manual_seed(2)
    logits = torch.randn(5, 300)
    before = logits.clone()
    t = SamplingTensors.from_params([SamplingParams(temperature=0)] * 5)
    assert t.all_greedy
    assert torch.equal(sample(logits, t), logits.argmax(-1))
    # Greedy rows among sampled rows (flat logits so the sampled rows would rarely hit argmax).
    params = [SamplingParams(temperature=0), SamplingParams(temperature=5.0),
              SamplingParams(temperature=0, top_k=3, seed=4), SamplingParams(top_p=0.5),
              SamplingParams(temperature=0)]
    t = SamplingTensors.from_params(params)
    gens = [None, None, make_generator(4, "cpu"), make_generator(5, "cpu"), None]
    for _ in range(10):
        out = sample(logits, t, gens)
        assert out.dtype == torch.int64 and out.shape == (5,)
        assert torch.equal(out[[0, 2, 4]], logits.argmax(-1)[[0, 2, 4]])
    assert torch.equal(logits, before)


def chi_square(counts, probs, n):
    stat = 0.0
    for c, p in zip(counts, probs):
        if p == 0:
            assert c == 0, "sampled a filtered-out token"
        else:
            stat += (c - n * p) ** 2 / (n * p)
    return stat


def test_sampled_frequencies_match_filtered_softmax():
    torch.manual_seed(0)
    logits = torch.tensor([math.log(p) for p in
                           [0.06, 0.22, 0.01, 0.15, 0.1, 0.18, 0.03, 0.12, 0.05, 0.08]])
    steps = [dict(temperature=1.1), dict(top_k=8), dict(top_p=0.9), dict(min_p=0.35)]
    kw, supports = {}, []
    for step in steps:
        kw.update(step)
        supports.append(sum(p > 0 for p in ref_probs(logits.tolist(), **kw)))
    assert supports == [10, 8, 7, 6]  # every filter cuts something here
    expected = ref_probs(logits.double().tolist(), **kw)
    limit = 30.0  # chi-square with 5 dof: p < 1e-4; the seed is fixed so this cannot flake

    # Unseeded rows: one batched draw from the default generator.
    n = 20000
    t = SamplingTensors.from_params([SamplingParams(**kw)] * n)
    counts = torch.bincount(sample(logits.expand(n, -1), t), minlength=10).tolist()
    assert chi_square(counts, expected, n) < limit

    # Seeded rows: each row's race drawn from its own generator.
    n = 3000
    t = SamplingTensors.from_params([SamplingParams(seed=s, **kw) for s in range(n)])
    gens = [make_generator(s, "cpu") for s in range(n)]
    counts = torch.bincount(sample(logits.expand(n, -1), t, gens), minlength=10).tolist()
    assert chi_square(counts, expected, n) < limit


def run_seeded(logits_steps, params, gens, row):
    t = SamplingTensors.from_params(params, logits_steps[0].device)
    return [sample(logits, t, gens)[row].item() for logits in logits_steps]


def test_same_seed_same_tokens_whatever_the_batch():
    torch.manual_seed(3)
    steps = [torch.randn(1, 1000) for _ in range(8)]
    mine = SamplingParams(seed=1234, temperature=1.5, top_p=0.95)
    alone = run_seeded(steps, [mine], [make_generator(1234, "cpu")], 0)

    torch.manual_seed(99)  # the default generator's state must not matter either
    others = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(seed=7, top_k=5),
              SamplingParams(min_p=0.2)]
    batch = [others[0], others[1], mine, others[2], others[3]]
    big_steps = [torch.cat([torch.randn(2, 1000), s, torch.randn(2, 1000)]) for s in steps]
    gens = [None, None, make_generator(1234, "cpu"), make_generator(7, "cpu"), None]
    assert run_seeded(big_steps, batch, gens, 2) == alone

    # A different seed gives a different sequence (8 draws over a flat-ish 1000-token vocab).
    assert run_seeded(steps, [mine], [make_generator(1235, "cpu")], 0) != alone


def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(4)
    logits = torch.randn(4, 200) * 4
    tokens = torch.tensor([3, 199, 0, 57])
    ref = torch.log_softmax(logits.double(), dim=-1)
    chosen, top_ids, top_lps = gather_logprobs(logits, tokens, 5)
    assert top_ids.shape == top_lps.shape == (4, 5) and top_ids.dtype == torch.int64
    torch.testing.assert_close(chosen.double(), ref[torch.arange(4), tokens], atol=1e-5, rtol=0)
    ref_top, ref_ids = ref.topk(5, dim=-1)
    assert torch.equal(top_ids, ref_ids)
    torch.testing.assert_close(top_lps.double(), ref_top, atol=1e-5, rtol=0)

    chosen0, ids0, lps0 = gather_logprobs(logits, tokens, 0)
    assert ids0.shape == lps0.shape == (4, 0)
    assert torch.equal(chosen0, chosen)

    ks = [2, 0, 5, 1]
    dicts = logprobs_to_dicts(tokens, chosen, top_ids, top_lps, ks)
    for row, (d, k) in enumerate(zip(dicts, ks)):
        want = {tokens[row].item()} | set(ref_ids[row, :k].tolist())
        assert set(d) == want and len(d) in (k, k + 1)
        assert next(iter(d)) == tokens[row].item()  # the chosen token comes first
        for tid, lp in d.items():
            assert lp == pytest.approx(ref[row, tid].item(), abs=1e-5)

    # The chosen token among the top-k is not repeated.
    best = ref.argmax(-1)
    d = logprobs_to_dicts(best, *gather_logprobs(logits, best, 3), [3] * 4)
    assert all(len(x) == 3 for x in d)


@pytest.mark.gpu
def test_cuda_matches_contract():
    dev = "cuda"
    torch.manual_seed(5)
    steps = [torch.randn(1, 5000, device=dev) for _ in range(5)]
    mine = SamplingParams(seed=42, top_k=50, top_p=0.9, min_p=0.01)
    alone = run_seeded(steps, [mine], [make_generator(42, dev)], 0)
    batch = [SamplingParams(temperature=0), mine, SamplingParams(top_p=0.5)]
    big = [torch.cat([torch.randn(1, 5000, device=dev), s, torch.randn(1, 5000, device=dev)])
           for s in steps]
    assert run_seeded(big, batch, [None, make_generator(42, dev), None], 1) == alone
    out = sample(big[0], SamplingTensors.from_params(batch, dev), [None, None, None])
    assert out.device.type == "cuda" and out[0] == big[0][0].argmax()
    chosen, ids, lps = gather_logprobs(big[0], out, 3)
    ref = torch.log_softmax(big[0].double(), -1)
    torch.testing.assert_close(chosen.double(), ref.gather(1, out[:, None])[:, 0], atol=1e-5,
                               rtol=0)
    penalized = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5), SamplingParams(),
                 SamplingParams(presence_penalty=-1.0)]
    history = [[1, 7, 7, 4999], [3], [0, 0, 12]]
    penalized[1] = SamplingParams(logit_bias={4: 2.5, 0: -1.0}, min_tokens=2)
    in_flight = torch.tensor([9, 8, 7], device=dev)  # (a copy from pageable memory: before the check)
    torch.cuda.set_sync_debug_mode("error")  # the host must not wait for the GPU here (async scheduling)
    try:
        on_gpu = adjust_logits(big[0], penalized, history, [1, 1, 2], [[], [7, 3], []], in_flight)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert on_gpu.device.type == "cuda"
    assert torch.equal(on_gpu.cpu(), adjust_logits(big[0].cpu(), penalized, history, [1, 1, 2], [[], [7, 3], []],
                                                   in_flight.cpu()))


def test_penalties_hand_computed():
    """Row 0: prompt [1, 2], output [2, 3, 3]; repetition 2 divides the positive logits of 1, 2, 3 and multiplies
    the negative ones; frequency 0.5 takes 0.5 per output occurrence (2 once, 3 twice), presence 1 takes 1 from
    each of them. Row 1 asks for nothing and is left as it was; the input logits are not touched."""
    logits = torch.tensor([[1.0, 4.0, -2.0, 3.0, -1.0], [1.0, 4.0, -2.0, 3.0, -1.0]])
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=1.0), SamplingParams()]
    got = adjust_logits(logits, params, [[1, 2, 2, 3, 3], [1, 2, 2, 3, 3]], [2, 2], [[], []])
    want_row0 = [1.0, 4.0 / 2, -2.0 * 2 - 0.5 - 1, 3.0 / 2 - 0.5 * 2 - 1, -1.0]
    assert got.tolist() == [want_row0, before[1].tolist()]
    assert torch.equal(logits, before) and got.dtype == torch.float32


def test_penalties_match_a_float64_loop_on_random_rows():
    torch.manual_seed(0)
    vocab, rows = 50, 6
    logits = torch.randn(rows, vocab)
    params, histories, prompts = [], [], []
    for r in range(rows):
        n = int(torch.randint(1, 10, ()))
        ids = torch.randint(0, vocab, (n + int(torch.randint(0, 12, ())),)).tolist()
        params.append(SamplingParams(repetition_penalty=[1.0, 1.3, 0.8][r % 3], frequency_penalty=[0, 0.7, -0.4][r % 3],
                                     presence_penalty=[0.3, 0, -1.1][(r + 1) % 3]))
        histories.append(ids)
        prompts.append(n)
    got = adjust_logits(logits, params, histories, prompts, [[]] * rows)
    for r, (p, ids, n) in enumerate(zip(params, histories, prompts)):
        for t in range(vocab):
            x = logits[r, t].double().item()
            if t in ids:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            count = ids[n:].count(t)
            x -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
            assert got[r, t].item() == pytest.approx(x, abs=1e-5), (r, t)


def test_logit_bias_then_banned_tokens_then_penalties():
    """vLLM's order: the bias is added first, the banned tokens (stop tokens before min_tokens) become -inf whatever
    their bias, then the penalties; a row without settings is unchanged."""
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5], [1.0, 2.0, -1.0, 0.5]])
    params = [SamplingParams(logit_bias={0: 3.0, 2: 100.0, 3: -0.5}, repetition_penalty=2.0), SamplingParams()]
    got = adjust_logits(logits, params, [[0, 1], [0, 1]], [2, 2], [[2], []])
    assert got.tolist() == [[(1.0 + 3.0) / 2, 2.0 / 2, float("-inf"), 0.0], logits[1].tolist()]


def test_a_token_in_flight_counts_like_one_the_host_has():
    """An async continuation samples before the host has the previous token: passed on the device as in_flight,
    it must count exactly as if it were the last entry of the row's history."""
    torch.manual_seed(1)
    logits = torch.randn(3, 40)
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.2), SamplingParams(),
              SamplingParams(frequency_penalty=-1.0, min_tokens=3)]
    history = [[5, 6, 7, 7], [1, 2], [9, 9, 3]]
    in_flight = torch.tensor([7, 11, 30])
    got = adjust_logits(logits, params, history, [2, 1, 1], [[], [], [4]], in_flight)
    want = adjust_logits(logits, params, [h + [int(t)] for h, t in zip(history, in_flight)], [2, 1, 1], [[], [], [4]])
    assert torch.equal(got, want)


def test_a_sequence_s_token_tensor_converts_each_token_once(monkeypatch):
    """The penalties read every penalized sequence's whole history at every step: Sequence.token_tensor() keeps
    an int64 copy and converts only what was appended since (O(1) Python work per token, not O(length) per
    step). Equal to the list at every length, across its buffer's growth and in a fork."""
    import eightbit.engine.sequence as sequence_module
    from eightbit.engine.sequence import Request

    converted = []
    real_tensor = torch.tensor
    monkeypatch.setattr(sequence_module.torch, "tensor",
                        lambda data, **kw: converted.append(len(data)) or real_tensor(data, **kw))
    seq = Request("r", None, list(range(40)), SamplingParams()).seqs[0]
    for step in range(300):
        seq.token_ids.append(step * 7 % 1000)
        if step % 3 == 0:  # not every step reads it
            assert torch.equal(seq.token_tensor(), real_tensor(seq.token_ids))
    assert torch.equal(seq.token_tensor(), real_tensor(seq.token_ids))
    assert sum(converted) == len(seq.token_ids)  # each token converted once
    child = seq.fork(1)
    child.token_ids.append(5)
    assert torch.equal(child.token_tensor(), real_tensor(seq.token_ids + [5]))
    assert torch.equal(seq.token_tensor(), real_tensor(seq.token_ids))  # the parent's copy is its own
