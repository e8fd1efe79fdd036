"""Async scheduling (the next decode step launched before this one's tokens reach the host) must
not change what a request gets: the same engine with it off is the reference (SmolLM2, CPU)."""

import pytest

from eightbit import SamplingParams

PROMPTS = ["Tell me about the ocean.", "My favourite food is", "Write a short poem about", "1, 2, 3,"]


def _outputs(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def engines(make_llm):
    return make_llm(), make_llm(async_scheduling=False)


def test_async_scheduling_changes_no_output(engines):
    on, off = engines
    greedy = off.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    g0 = greedy[0].outputs[0]
    # stops that end sequences at unpredictable steps (the launched-ahead row is dropped), max_tokens that
    # end them at predictable ones (no row launched), n > 1 forks, seeds, log-probs
    params = [
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[g0.token_ids[5]], logprobs=2),
        SamplingParams(temperature=0, max_tokens=3),
        SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=9),
        SamplingParams(temperature=0, max_tokens=30, stop=[greedy[3].outputs[0].text.split()[2]]),
    ]
    want = off.generate(PROMPTS, params, use_tqdm=False)
    got = on.generate(PROMPTS, params, use_tqdm=False)
    assert _outputs(got) == _outputs(want)
    assert got[0].outputs[0].finish_reason == "stop" and got[3].outputs[0].finish_reason == "stop"
    assert on.engine.block_manager.num_used_blocks == 0  # rows launched for stopped sequences freed nothing twice
    # and the engine keeps serving: a second batch after one that left a step in flight
    assert _outputs(on.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)) \
        == _outputs(greedy[:2])


def test_abort_with_a_step_in_flight(engines):
    on, _ = engines
    engine = on.engine
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=50))
    engine.add_request("b", PROMPTS[1], SamplingParams(temperature=0, max_tokens=50))
    engine.step()  # the prefill, and the first decode step launched ahead
    engine.step()
    assert engine._in_flight is not None
    engine.abort("a")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert {o.request_id for o in outs} == {"a", "b"}
    assert outs[0].request_id == "a" and outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 50
    assert engine.block_manager.num_used_blocks == 0


def test_a_sequence_left_out_by_the_budget_is_not_starved(make_llm):
    """A step whose token budget ran out before every running sequence must not be continued ahead:
    the one left out would wait for the whole chain. Here B decodes while A's prompt is prefilled in
    chunks of the 8-token budget; A's last chunk takes all 8, B sits that step out."""
    def production_steps(async_on):
        engine = make_llm(max_num_batched_tokens=8, async_scheduling=async_on).engine
        engine.add_request("B", [1, 200], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        engine.step()
        engine.step()
        engine.add_request("A", list(range(300, 315)), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                           priority=-1)
        steps, step = [], 0
        while engine.has_unfinished_requests():
            step += 1
            steps += [step for o in engine.step() if o.request_id == "B"]
        return steps, step

    (on, total_on), (off, total_off) = production_steps(True), production_steps(False)
    assert total_on == total_off
    assert max(b - a for a, b in zip(on, on[1:])) <= max(b - a for a, b in zip(off, off[1:])) == 2


def test_async_scheduling_is_off_by_default_on_the_cpu(make_llm):
    """On the CPU the launched-ahead step runs its whole forward before this step's tokens are handed back: nothing
    overlaps, each output comes a forward late and a sequence that stops costs one forward more. So the default
    there is off (on CUDA, on)."""
    from eightbit import EngineConfig

    assert EngineConfig(device="cpu").async_scheduling is False
    assert EngineConfig(device="cpu", async_scheduling=True).async_scheduling is True
    for async_on, extra in ((None, 0), (True, 1)):
        llm = make_llm(async_scheduling=async_on, max_num_seqs=1, enable_prefix_caching=False)
        first = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
        stop = first.outputs[0].token_ids[0]
        before = llm.engine.num_computed_tokens
        out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop]),
                           use_tqdm=False)[0]
        assert out.outputs[0].token_ids == [stop] and out.outputs[0].finish_reason == "stop"
        computed = llm.engine.num_computed_tokens - before
        assert computed == len(out.prompt_token_ids) + extra, (async_on, computed)
