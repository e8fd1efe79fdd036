"""Engine rules that the SmolLM2 prompts never reach, on the llama-tiny dummy model (CPU, seconds): an EOS under
ignore_eos, a sequence running into max_model_len, the samples of an n > 1 request ending at different steps,
log-probs of a sampled token that is not the argmax, and prompt log-probs of a prompt already in the prefix cache."""

import pytest

from eightbit import LLM, SamplingParams

PROMPT = [(7 * j) % 1000 + 1 for j in range(40)]


def tiny(**options):
    return LLM("llama-tiny", **{"load_format": "dummy", "device": "cpu", "dtype": "float32",
                                "kv_cache_memory_gb": 0.01, "max_model_len": 256, **options})


@pytest.fixture(scope="module")
def llm():
    return tiny()


def generate(llm, prompt, params):
    return llm.generate([prompt], params, use_tqdm=False)[0]


def test_ignore_eos_generates_through_an_eos(llm):
    free = generate(llm, PROMPT, SamplingParams(temperature=0, max_tokens=8)).outputs[0].token_ids
    engine = llm.engine
    saved, engine.eos_token_ids = engine.eos_token_ids, {free[1]}  # the dummy model has no EOS of its own
    try:
        stopped = generate(llm, PROMPT, SamplingParams(temperature=0, max_tokens=8)).outputs[0]
        ignored = generate(llm, PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)).outputs[0]
    finally:
        engine.eos_token_ids = saved
    assert stopped.token_ids == free[: free.index(free[1]) + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", None)
    assert ignored.token_ids == free and ignored.finish_reason == "length"


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_prompt_and_output_stop_at_max_model_len(async_scheduling):
    llm = tiny(max_model_len=64, async_scheduling=async_scheduling)
    out = generate(llm, PROMPT[:30] * 2, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)).outputs[0]
    assert len(out.token_ids) == 64 - 60 and out.finish_reason == "length"
    # the prompt and every output token but the last ran through the model; async scheduling launches the next
    # step before this one's tokens are seen, but not one past a length limit it knows in advance
    assert llm.engine.num_computed_tokens == 60 + 3


def test_the_samples_of_a_request_may_end_at_different_steps(llm):
    """The request is finished when its last sample is, not its first. References: n = 1 runs with the seeds the
    samples get (seed + index, as test_parallel_samples_share_the_prompt_and_equal_independent_runs holds)."""
    for seed in range(50):  # a seed whose sample 0 emits early a token that sample 1 never emits
        singles = [generate(llm, PROMPT, SamplingParams(temperature=1.0, seed=seed + j, max_tokens=12))
                   .outputs[0].token_ids for j in range(2)]
        early = [i for i, t in enumerate(singles[0][:6]) if t not in singles[1] and t not in singles[0][:i]]
        if early:
            break
    i = early[0]
    params = SamplingParams(n=2, temperature=1.0, seed=seed, max_tokens=12, stop_token_ids=[singles[0][i]])
    finished = [out for _, out in llm.stream(PROMPT, params) if out.finished]
    assert len(finished) == 1
    first, second = finished[0].outputs
    assert (first.token_ids, first.finish_reason) == (singles[0][: i + 1], "stop")
    assert (second.token_ids, second.finish_reason) == (singles[1], "length")


def test_log_probs_are_those_of_the_sampled_token(llm):
    """At temperature 2 most tokens are not the argmax: their log-probs (raw log-softmax, as in vLLM) and the
    cumulative sum must be the sampled token's, as a prefill scoring the same tokens gives them."""
    out = generate(llm, PROMPT, SamplingParams(temperature=2.0, seed=3, max_tokens=12, logprobs=1)).outputs[0]
    tokens = out.token_ids
    assert [next(iter(d)) for d in out.logprobs] == tokens
    assert any(d[t] < max(d.values()) for d, t in zip(out.logprobs, tokens))  # not all argmax: the test can fail
    rescored = generate(tiny(), PROMPT + tokens, SamplingParams(max_tokens=1, prompt_logprobs=0)).prompt_logprobs
    expected = [rescored[len(PROMPT) + j][t] for j, t in enumerate(tokens)]
    assert [d[t] for d, t in zip(out.logprobs, tokens)] == pytest.approx(expected, abs=1e-4)
    assert out.cumulative_logprob == pytest.approx(sum(expected), abs=1e-3)


def test_prompt_log_probs_of_a_prompt_already_in_the_prefix_cache():
    """A request that asks for prompt log-probs takes no prefix-cache hit: cached positions have no logits."""
    llm = tiny()
    generate(llm, PROMPT, SamplingParams(temperature=0, max_tokens=1))  # its full blocks are now cached
    got = generate(llm, PROMPT, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)).prompt_logprobs
    want = generate(tiny(), PROMPT, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)).prompt_logprobs
    assert got[0] is None and all(entry is not None for entry in got[1:])
    for g, w in zip(got[1:], want[1:]):
        assert g.keys() == w.keys() and list(g.values()) == pytest.approx(list(w.values()), abs=1e-5)
