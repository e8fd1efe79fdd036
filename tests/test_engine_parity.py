"""Greedy output and log-probs of the engine vs HF transformers on the embedded SmolLM2 (float32, CPU).

The parity rule: tokens equal one for one; at a position where HF's top-1 and top-2
log-probs are within 1e-3 (a near-tie) either is accepted and the comparison stops
there. Near-ties are counted and must be rare.
"""

import pytest
import torch

from eightbit import SamplingParams

NEAR_TIE = 1e-3
PARAGRAPH = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based inks and a wooden screw press into a system that could "
    "produce books quickly and cheaply. Within fifty years printing shops had spread to more than two "
    "hundred cities across Europe, and the number of books in circulation grew from thousands to millions. "
)
PROMPTS = [
    "Hi",
    "The capital of France is",
    "def fibonacci(n):\n    ",
    PARAGRAPH + "Summarize the paragraph above in one sentence:",
    PARAGRAPH * 3 + "The most important consequence was",
]


def hf_greedy(hf_model, prompt_ids, max_new_tokens):
    """HF's greedy continuation and the raw logits at each generated position."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf_model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                                return_dict_in_generate=True, pad_token_id=2)
    return out.sequences[0, len(prompt_ids):].tolist(), torch.stack(out.logits)[:, 0]


def assert_parity(ours, theirs, their_logits) -> int:
    """Apply the parity rule; returns 1 if it ended at a near-tie, else 0."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            top = torch.log_softmax(their_logits[i].double(), -1).topk(2)
            gap = (top.values[0] - top.values[1]).item()
            assert gap < NEAR_TIE and a in top.indices.tolist(), (
                f"diverged at output token {i}: ours {a}, HF {b} (HF top-2 gap {gap:.2e})"
            )
            return 1
    assert len(ours) == len(theirs), f"ours has {len(ours)} tokens, HF {len(theirs)}"
    return 0


@pytest.fixture(scope="module")
def references(hf_model, tokenizer):
    """HF greedy continuations of PROMPTS with per-prompt max_tokens (mixed on purpose)."""
    max_tokens = [24, 16, 24, 12, 20]
    refs = []
    for prompt, n in zip(PROMPTS, max_tokens):
        ids = tokenizer(prompt).input_ids
        refs.append((ids, n, *hf_greedy(hf_model, ids, n)))
    return refs


def run_and_compare(llm, references):
    params = [SamplingParams(temperature=0, max_tokens=n) for _, n, _, _ in references]
    outs = llm.generate([ids for ids, *_ in references], params, use_tqdm=False)
    ties = 0
    for out, (_, _, tokens, logits) in zip(outs, references):
        ties += assert_parity(out.outputs[0].token_ids, tokens, logits)
    assert ties <= 1, f"{ties} near-ties in {len(references)} prompts"
    return outs


def test_greedy_matches_hf_in_one_batch(llm, references):
    run_and_compare(llm, references)


def test_chunked_prefill_matches_hf(make_llm, references):
    llm = make_llm(max_num_batched_tokens=24)  # the longest prompt takes ~10 steps to prefill
    chunks, real_run = {}, llm.engine.runner.run  # prompt length -> [tokens cached, then each prefill chunk]

    def run(scheduled, *args, **kwargs):
        assert sum(n for _, n in scheduled) <= 24
        for seq, n in scheduled:
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                chunks.setdefault(seq.num_prompt_tokens, [seq.num_computed_tokens]).append(n)
        return real_run(scheduled, *args, **kwargs)

    llm.engine.runner.run = run
    run_and_compare(llm, references)
    longest = max(len(ids) for ids, *_ in references)  # (its first paragraph may come from the prefix cache)
    cached, *steps = chunks[longest]
    assert cached + sum(steps) == longest and len(steps) >= -(-(longest - cached) // 24) >= 5


def test_preemption_recompute_matches_hf(make_llm, references):
    # Room for every prompt at admission and one block more: decoding must preempt.
    blocks = sum(-(-len(ids) // 16) for ids, *_ in references) + 1
    llm = make_llm(max_model_len=16 * blocks, num_kv_blocks=blocks)
    run_and_compare(llm, references)
    assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_cache_hits_skip_compute_and_match_hf(make_llm, hf_model, tokenizer):
    llm = make_llm()
    engine = llm.engine
    prefix = tokenizer(PARAGRAPH * 2).input_ids
    first = prefix + tokenizer(" In short,").input_ids
    llm.generate([first], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    prompts = [prefix + tokenizer(tail).input_ids for tail in (" The key idea", " Printing also changed")]
    computed_before, hits_before = engine.num_computed_tokens, engine.block_manager.num_prefix_hit_tokens
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    cached_per_prompt = (len(prefix) // 16) * 16
    assert engine.block_manager.num_prefix_hit_tokens - hits_before == 2 * cached_per_prompt
    computed = engine.num_computed_tokens - computed_before
    assert computed == sum(len(p) for p in prompts) - 2 * cached_per_prompt + 2 * 11
    for out, ids in zip(outs, prompts):
        tokens, logits = hf_greedy(hf_model, ids, 12)
        assert_parity(out.outputs[0].token_ids, tokens, logits)


def test_prompt_and_sample_logprobs_match_hf(llm, hf_model, tokenizer):
    ids = tokenizer(PARAGRAPH * 6).input_ids[:512]
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2),
                       use_tqdm=False)[0]
    generated = out.outputs[0].token_ids
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids + generated])).logits[0].double()
    ref = torch.log_softmax(logits, -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        entry = out.prompt_logprobs[i]
        assert abs(entry[ids[i]] - ref[i - 1, ids[i]].item()) < 2e-4
        top = ref[i - 1].topk(2)
        assert set(top.indices.tolist()) <= set(entry) and len(entry) <= 3
    for j, token in enumerate(generated):
        row = ref[len(ids) - 1 + j]
        entry = out.outputs[0].logprobs[j]
        assert token == row.argmax().item()
        assert all(abs(lp - row[t].item()) < 2e-4 for t, lp in entry.items())
        assert set(row.topk(3).indices.tolist()) <= set(entry)
    expected_cumulative = sum(out.outputs[0].logprobs[j][t] for j, t in enumerate(generated))
    assert out.outputs[0].cumulative_logprob == pytest.approx(expected_cumulative)


def test_repetition_penalty_matches_hf(make_llm, hf_model, tokenizer):
    """HF transformers' RepetitionPenaltyLogitsProcessor (the same rule, over prompt and output) in greedy generate;
    a request without penalties in the same batch is left as it was."""
    prompts = ["1, 2, 3, 4,", PROMPTS[1]]
    params = [SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=16)]
    ours = [o.outputs[0].token_ids for o in make_llm().generate(prompts, params, use_tqdm=False)]
    ids = tokenizer(prompts[0]).input_ids
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, repetition_penalty=1.3,
                                output_scores=True, return_dict_in_generate=True, pad_token_id=2)
    theirs = out.sequences[0, len(ids):].tolist()
    assert theirs != hf_greedy(hf_model, ids, 24)[0]  # the penalty changes this continuation
    assert_parity(ours[0], theirs, torch.stack(out.scores)[:, 0])  # scores: the logits after the penalty
    assert_parity(ours[1], *hf_greedy(hf_model, tokenizer(prompts[1]).input_ids, 16))


def test_frequency_and_presence_penalties_match_a_greedy_loop_over_hf_logits(make_llm, hf_model, tokenizer):
    """OpenAI's rule by hand on HF's float64 logits: a logit_bias of 8 on " jumps", then each output token's logit
    less frequency x its count and presence once; greedy, with async scheduling on: continuations count the token
    the host has not seen yet (without it, " jumps" is penalized one step late and the texts part)."""
    ids = tokenizer("The quick brown fox").input_ids
    jumps = tokenizer(" jumps").input_ids[0]
    params = SamplingParams(temperature=0, max_tokens=16, frequency_penalty=0.8, presence_penalty=0.4, ignore_eos=True,
                            logit_bias={jumps: 8.0})
    llm = make_llm()
    real, continued = llm.engine._launch_continuation, []
    llm.engine._launch_continuation = lambda launched: continued.append(real(launched)) or continued[-1]
    ours = llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
    assert sum(c is not None for c in continued) >= 10  # the penalized steps ran ahead of the host
    seq, theirs, scores = list(ids), [], []
    for _ in range(16):
        with torch.no_grad():
            logits = hf_model(torch.tensor([seq])).logits[0, -1].double()
        logits[jumps] += 8.0
        output = seq[len(ids):]
        for t in set(output):
            logits[t] -= 0.8 * output.count(t) + 0.4
        theirs.append(int(logits.argmax()))
        scores.append(logits)
        seq.append(theirs[-1])
    assert len(set(theirs)) > 8  # the penalties at work: no short loop
    assert_parity(ours, theirs, torch.stack(scores))
