"""The engine's API on the embedded SmolLM2 (float32, CPU): seeds, n > 1, streaming, stops, errors, aborts."""

import itertools

import pytest
import torch

from eightbit import SamplingParams
from eightbit.cli import main as cli_main

PROMPTS = ["Tell me about the ocean.", "My favourite food is", "Write a short poem about", "1, 2, 3,"]


def texts(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_sample_is_the_same_alone_or_in_a_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12)
    alone = llm.generate([PROMPTS[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.9, max_tokens=12)
    batch = llm.generate(PROMPTS, [seeded, others, others, others], use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone
    again = llm.generate([PROMPTS[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone


def test_parallel_samples_share_the_prompt_and_equal_independent_runs(llm):
    """n = 3 forks after one prefill (copy-on-write of the shared last block); sample j is seeded
    with seed + j, so it must equal an independent n = 1 request with that seed."""
    prompt = PROMPTS[2] + " the sea"  # not a multiple of the block size: the last block is shared
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    singles = [llm.generate([prompt], SamplingParams(temperature=1.0, seed=7 + j, max_tokens=10),
                            use_tqdm=False)[0].outputs[0].token_ids for j in range(3)]
    assert [c.token_ids for c in out.outputs] == singles
    assert len({tuple(s) for s in singles}) > 1
    assert llm.engine.block_manager.num_used_blocks == 0  # every fork freed its blocks


def test_stream_deltas_join_to_the_final_text_and_stop_strings_are_cut(llm):
    params = SamplingParams(temperature=0, max_tokens=40)
    final = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    deltas = [out.outputs[0].delta for _, out in llm.stream(PROMPTS[0], params)]
    assert "".join(deltas) == final.text
    assert final.delta == final.text  # generate's requests are final-only: one output, all of its text new
    assert final.text == llm.get_tokenizer().decode(final.token_ids, skip_special_tokens=True)
    words = final.text.split()
    stop = words[len(words) // 2]
    stopped = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=40, stop=[stop]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == final.text[: final.text.index(stop)]
    kept = SamplingParams(temperature=0, max_tokens=40, stop=[stop], include_stop_str_in_output=True)
    outs = [out for _, out in llm.stream(PROMPTS[0], kept)]
    assert "".join(o.outputs[0].delta for o in outs) == outs[-1].outputs[0].text == \
        final.text[: final.text.index(stop) + len(stop)]


def test_generation_stops_at_the_first_complete_stop_string(llm):
    """A second, longer stop string that starts earlier does not keep generation going past a complete one."""
    params = SamplingParams(temperature=0, max_tokens=40)
    final = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    words = final.text.split()
    short, long = words[1], " ".join(words[:4])  # 'short' completes before 'long' does; 'long' starts first
    assert final.text.index(long) < final.text.index(short) < final.text.index(short) + len(short) < \
        final.text.index(long) + len(long)
    # the first token whose text completes `short`: generation must end with it
    n = next(i for i in range(1, len(final.token_ids) + 1) if short in tok.decode(final.token_ids[:i]))
    for stop in ([short, long], [long, short]):
        out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=40, stop=stop),
                           use_tqdm=False)[0].outputs[0]
        assert out.stop_reason == short and out.text == final.text[: final.text.index(short)]
        assert out.token_ids == final.token_ids[:n]


def test_overlapping_calls_each_get_all_their_outputs(llm):
    """Two streams consumed in turn, and a generate inside a stream's loop: each call steps the engine for all,
    and each gets every output of its own requests (deltas were lost, and a stream whose request finished during
    the other call's steps waited forever)."""
    params = SamplingParams(temperature=0, max_tokens=12)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)]
    joined = ["", ""]
    for pair in itertools.zip_longest(llm.stream(PROMPTS[0], params), llm.stream(PROMPTS[1], params)):
        for i, item in enumerate(pair):
            if item is not None:
                joined[i] += item[1].outputs[0].delta
    assert joined == want[:2]
    joined, inner = "", None
    for _, out in llm.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30)):
        joined += out.outputs[0].delta
        if inner is None:  # the whole generate runs (and ends) inside the stream's first output
            inner = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0].text
    assert inner == want[2]
    assert joined == llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=30),
                                  use_tqdm=False)[0].outputs[0].text
    _assert_idle(llm.engine)


def test_a_request_aborted_outside_its_call_ends_with_finish_reason_abort(llm):
    """A consumer that aborts one prompt of a stream gets its last output (finish_reason "abort") and the others'
    to their end; the stream used to fail with a RuntimeError once the others finished."""
    stream = llm.stream(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=10))
    last = {}
    for i, out in stream:
        if i == 0 and 0 not in last:
            llm.engine.abort(out.request_id)  # at its first output
        last[i] = out
    assert last[0].finished and last[0].outputs[0].finish_reason == "abort"
    assert 0 < len(last[0].outputs[0].token_ids) < 10  # what it had when it was aborted
    assert [last[i].outputs[0].finish_reason for i in (1, 2)] == ["length", "length"]
    outs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    assert [o.outputs[0].text for o in outs[1:]] == [last[i].outputs[0].text for i in (1, 2)]
    _assert_idle(llm.engine)


def test_a_request_that_ends_unreported_ends_the_call(llm):
    stream = llm.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30))
    next(stream)
    llm.engine.abort(next(iter(llm.engine.requests)), report=False)
    with pytest.raises(RuntimeError, match="ended outside this call, unreported"):
        next(stream)
    _assert_idle(llm.engine)


def test_generate_builds_only_final_outputs(llm):
    """generate() needs each request's last output only: the engine reports its requests when they finish, rather
    than copying every sample's tokens and log-probs into an output at every step."""
    engine = llm.engine
    engine.add_request("final", PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, n=2), final_only=True)
    engine.add_request("every", PROMPTS[1], SamplingParams(temperature=0, max_tokens=5))
    seen = []
    while engine.has_unfinished_requests():
        seen += [(o.request_id, o.finished) for o in engine.step()]
    assert seen.count(("final", True)) == 1 and ("final", False) not in seen
    assert seen.count(("every", False)) == 4 and seen.count(("every", True)) == 1  # one output a token
    # a server's non-streamed request: also reported at its first token (its queue count and TTFT)
    engine.add_request("ends", PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, n=2), final_only=True,
                       first_token_output=True)
    seen = []
    while engine.has_unfinished_requests():
        seen += [(o.finished, [len(c.token_ids) for c in o.outputs]) for o in engine.step()]
    assert seen == [(False, [1, 1]), (True, [5, 5])]
    with pytest.raises(ValueError, match="goes with final_only"):
        engine.add_request("every step anyway", PROMPTS[0], SamplingParams(max_tokens=2), first_token_output=True)


def test_delta_outputs_join_to_the_cumulative_ones(llm):
    """delta=True (what the server streams from): each output holds only the tokens and log-probs new since the
    request's previous one, so a step costs O(new tokens) however long the output; joined, they are the
    cumulative request's, sample by sample (n = 2, seeded, with log-probs)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=7, logprobs=2)
    engine.add_request("whole", PROMPTS[2], params)
    engine.add_request("parts", PROMPTS[2], params, delta=True)
    last, parts = {}, {0: ([], []), 1: ([], [])}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                if out.request_id == "whole":
                    last[c.index] = c
                else:
                    parts[c.index][0].extend(c.token_ids)
                    parts[c.index][1].extend(c.logprobs)
                    assert len(c.token_ids) <= 1  # one step, at most one new token per sample
    for i, c in last.items():  # the two requests share steps: their log-probs agree to float32 rounding
        ids, logprobs = parts[i]
        assert c.token_ids == ids and len(ids) == 7
        assert [d.keys() for d in c.logprobs] == [d.keys() for d in logprobs]
        assert [v for d in c.logprobs for v in d.values()] == pytest.approx([v for d in logprobs for v in d.values()],
                                                                            abs=1e-4)
    with pytest.raises(ValueError, match="exclude each other"):
        engine.add_request("both", PROMPTS[0], params, final_only=True, delta=True)
    assert "both" not in engine.requests


def test_stop_token_ids_and_length(llm):
    free = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    target = free.token_ids[3]
    out = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[target]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == target
    assert out.token_ids == free.token_ids[: free.token_ids.index(target) + 1]
    tok = llm.get_tokenizer()
    assert out.text == tok.decode(out.token_ids[:-1])  # the stop token's text is left out...
    kept = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[target],
                                                     include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.token_ids == out.token_ids and kept.text == tok.decode(kept.token_ids)  # ... unless asked for
    assert kept.text != out.text


@pytest.mark.parametrize("bad, message", [
    ("x" * 50000, "leaves no room"),
    ("", "empty"),
    ([], "no prompts"),
    ([[]], "empty"),
    ([[1, 2, 10**6]], "in the vocabulary"),
    ([[1, -3]], "in the vocabulary"),
    ([1.0, 2.0], r"integers in the vocabulary.*\[1\.0, 2\.0\]"),  # one prompt of float ids, named as such
])
def test_bad_prompts_raise_and_the_engine_keeps_serving(llm, bad, message):
    engine = llm.engine
    engine.add_request("keep-going", PROMPTS[1], SamplingParams(temperature=0, max_tokens=3))
    with pytest.raises(ValueError, match=message):
        llm.generate(bad, use_tqdm=False)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["keep-going"]
    assert len(finished[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("field, value", [("temperature", -1), ("top_p", 0), ("top_k", -5), ("max_tokens", 0),
                                          ("n", 0), ("min_p", 2)])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field, value, message", [
    ("block_size", 12, "power of two"), ("block_size", 0, "positive"), ("max_num_seqs", 0, "positive"),
    ("max_num_batched_tokens", 2.5, "positive"), ("dtype", "int8", "one of"), ("kv_cache_dtype", "fp8", "one of"),
    ("quantization", "w4a16", "one of"), ("load_format", "pt", "one of"), ("max_model_len", 0, "positive"),
    ("num_kv_blocks", -1, "positive"), ("kv_group_size", 0, "positive"), ("gpu_memory_utilization", 1.5, r"\(0, 1\]"),
    ("kv_cache_memory_gb", 0, "positive"), ("device", "tpu", "'cpu', 'cuda' or 'cuda:N'"),
    ("kv_group_size", 16, "int8 KV cache only"), ("seed", None, r"int in \[0, 2\*\*63\)"),
    ("seed", -1, "int in"), ("seed", 1.5, "int in"), ("max_model_len", True, "positive integer"),
    ("block_size", True, "positive integer"), ("kv_cache_memory_gb", float("nan"), "positive number"),
    ("kv_cache_memory_gb", "1", "positive number"), ("gpu_memory_utilization", None, r"\(0, 1\]"),
    ("enable_prefix_caching", "false", "True or False"), ("async_scheduling", "off", "True or False"),
    ("enforce_eager", 0, "True or False"),
])
def test_invalid_engine_config_names_the_field(field, value, message):
    """Checked on construction, before any model is loaded."""
    from eightbit.engine.config import EngineConfig

    with pytest.raises(ValueError, match=f"{field}.*{message}"):
        EngineConfig(**{field: value})


def test_engine_config_takes_dtype_aliases_and_torch_dtypes():
    """As vLLM does: "half", "float", torch.bfloat16 ..."""
    from eightbit.engine.config import EngineConfig

    for given, name in (("half", "float16"), ("float", "float32"), ("bf16", "bfloat16"), (torch.bfloat16, "bfloat16"),
                        (torch.float16, "float16"), (torch.float32, "float32")):
        assert EngineConfig(dtype=given).dtype == name
    with pytest.raises(ValueError, match=r"dtype must be one of .* got 'torch.int8'|got torch.int8|got 'int8'"):
        EngineConfig(dtype=torch.int8)


def test_min_tokens_over_max_tokens_says_what_max_tokens_is():
    with pytest.raises(ValueError, match=r"min_tokens must be an int in \[0, max_tokens=5\], got 10"):
        SamplingParams(min_tokens=10, max_tokens=5)


def test_engine_config_takes_numpy_numbers_as_python_ones():
    import numpy as np

    from eightbit.engine.config import EngineConfig

    c = EngineConfig(device="cpu", max_num_seqs=np.int64(4), kv_cache_memory_gb=np.float32(0.5),
                     enforce_eager=np.bool_(True), seed=np.int32(3))
    assert (c.max_num_seqs, c.kv_cache_memory_gb, c.enforce_eager, c.seed) == (4, 0.5, True, 3)
    assert [type(v) for v in (c.max_num_seqs, c.kv_cache_memory_gb, c.enforce_eager, c.seed)] == \
        [int, float, bool, int]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without a GPU gives")
def test_cuda_device_without_a_gpu_is_a_clear_error():
    from eightbit.engine.config import EngineConfig

    with pytest.raises(ValueError, match="no CUDA GPU"):
        EngineConfig(device="cuda")


@pytest.mark.parametrize("options, message", [
    (dict(max_model_len=10**6), "max_model_len=1000000 exceeds the model's max_position_embeddings=8192"),
    (dict(kv_cache_dtype="int8", kv_group_size=128), "group size 128 does not fit head_dim 64"),
])
def test_options_that_do_not_fit_the_model_are_refused_before_its_weights_load(make_llm, monkeypatch, options,
                                                                                message):
    from eightbit.engine import loader

    monkeypatch.setattr(loader, "load_weights", lambda *args: pytest.fail("the weights started loading"))
    with pytest.raises(ValueError, match=message):
        make_llm(**options)


def test_a_gpu_other_than_the_current_one_is_refused(monkeypatch):
    """cuda:1 was accepted, but the kernels, graphs, events and memory queries ran on the current device (cuda:0)
    with pointers into GPU 1's memory. (Simulated: a machine of two GPUs whose current one is cuda:0.)"""
    from eightbit.engine.config import checked_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("CUDA initialized by a config check"))
    assert checked_device("cuda:0") == torch.device("cuda:0") and checked_device("cuda") == torch.device("cuda")
    with pytest.raises(ValueError, match=r"'cuda:1' is not the current CUDA device \(cuda:0\).*CUDA_VISIBLE_DEVICES=1"):
        checked_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # and once CUDA is up, its current device
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert checked_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ValueError, match=r"'cuda:0' is not the current CUDA device \(cuda:1\)"):
        checked_device("cuda:0")


def _assert_idle(engine):
    assert not engine.requests and not engine.has_unfinished_requests()
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("params, message", [
    (SamplingParams(logprobs=10**6, max_tokens=1), "logprobs=1000000 exceeds the vocabulary size"),
    (SamplingParams(prompt_logprobs=10**6, max_tokens=1), "prompt_logprobs=1000000 exceeds"),
    (SamplingParams(top_k=2**63, max_tokens=1), "top_k=9223372036854775808 exceeds the vocabulary size"),
    (SamplingParams(n=257, max_tokens=1), "n=257 exceeds max_num_seqs=256"),  # forks that would not fit a step
])
def test_limits_past_the_model_raise_before_running_and_the_llm_stays_usable(llm, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["Hi"], params, use_tqdm=False)
    _assert_idle(llm.engine)
    assert len(llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize("bad, error, message", [
    ([0], ValueError, "got 1 priorities for 3 prompts"),
    ("high", TypeError, "priorities: expected one value"),
    ([0, 1.5, 0], TypeError, r"priorities\[1\] must be int, got float"),
])
def test_bad_priorities_raise_before_running(llm, bad, error, message):
    with pytest.raises(error, match=message):
        llm.generate(PROMPTS[:3], SamplingParams(max_tokens=2), use_tqdm=False, priority=bad)
    _assert_idle(llm.engine)


def test_a_sampling_params_changed_after_construction_is_checked_again(llm):
    """The engine validates each request's SamplingParams again: max_tokens set to 0 afterwards ran to the end of
    the context (0 read as None), a stop_token_ids of None failed inside a step that other requests share."""
    zero = SamplingParams(temperature=0)
    zero.max_tokens = 0
    with pytest.raises(ValueError, match=r"max_tokens must be an int >= 1 \(or unset: up to max_model_len\), got 0"):
        llm.generate(["Hi"], zero, use_tqdm=False)
    none_ids = SamplingParams(temperature=0, max_tokens=2)
    none_ids.stop_token_ids = None  # normalized again, as on construction
    assert len(llm.generate(["Hi"], none_ids, use_tqdm=False)[0].outputs[0].token_ids) == 2
    bad_ids = SamplingParams(temperature=0, max_tokens=2)
    bad_ids.stop_token_ids = 5
    with pytest.raises(ValueError, match="stop_token_ids"):
        next(llm.stream("Hi", bad_ids))
    _assert_idle(llm.engine)


def test_requests_added_straight_to_the_engine_do_not_clash_with_generate(llm):
    """LLM numbers its requests "0", "1", ...; an id a user gave a request of their own is skipped, not an
    error for a valid generate."""
    engine = llm.engine
    taken = str(next(llm._ids) + 1)  # the id generate's first prompt would get
    engine.add_request(taken, "Hello", SamplingParams(temperature=0, max_tokens=3))
    outs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert taken not in [o.request_id for o in outs] and all(len(o.outputs[0].token_ids) == 2 for o in outs)
    assert taken in engine.requests  # the user's request is theirs to drive
    while engine.has_unfinished_requests():
        engine.step()
    _assert_idle(engine)


def test_stream_checks_its_input_when_called_and_adds_nothing_until_consumed(llm):
    with pytest.raises(ValueError, match="leaves no room to generate"):
        llm.stream([[1, 2]] + [[1] * 10**5], SamplingParams(max_tokens=2))
    with pytest.raises(TypeError, match=r"priorities\[1\] must be int"):
        llm.stream(PROMPTS[:2], SamplingParams(max_tokens=2), priority=[0, "x"])
    unused = llm.stream(PROMPTS[0], SamplingParams(max_tokens=2))
    _assert_idle(llm.engine)  # a stream never consumed leaves nothing behind
    del unused
    outs = list(llm.stream(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=2), priority=[1, 0]))
    assert sorted({i for i, _ in outs}) == [0, 1]
    _assert_idle(llm.engine)


def test_numpy_priorities_are_ints(llm):
    import numpy as np

    outs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False,
                        priority=np.int64(2))
    assert all(len(o.outputs[0].token_ids) == 1 for o in outs)
    with pytest.raises(TypeError, match="priorities: expected one value"):
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=1), use_tqdm=False, priority=True)
    _assert_idle(llm.engine)


def test_one_priority_applies_to_every_prompt(llm, monkeypatch):
    """The priority each request reaches the engine with: one for all, or one per prompt."""
    engine, seen = llm.engine, []
    real = engine.add_request

    def add_request(request_id, *args, **kwargs):
        real(request_id, *args, **kwargs)
        seen.append(engine.requests[request_id].priority)

    monkeypatch.setattr(engine, "add_request", add_request)
    outs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False, priority=3)
    assert seen == [3, 3, 3] and all(len(o.outputs[0].token_ids) == 2 for o in outs)
    seen.clear()
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False, priority=[-1, 2])
    assert seen == [-1, 2]


def test_an_interrupted_generate_aborts_its_requests(llm, monkeypatch):
    """Ctrl-C (or any error) in the middle of a call: its requests go, the next call runs alone."""
    engine = llm.engine
    step, calls = engine.step, []

    def step_then_interrupt():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(engine, "step", step_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=50), use_tqdm=False)
    monkeypatch.undo()
    _assert_idle(engine)
    streamed = [i for i, _ in llm.stream(PROMPTS[3], SamplingParams(temperature=0, max_tokens=3))]
    assert streamed == [0, 0, 0]


def test_a_ctrl_c_while_a_prompt_is_added_leaves_none_of_the_call_s_requests(llm, monkeypatch):
    """The engine adds a request whole (to its requests and the scheduler's queue) and raises a Ctrl-C that came
    meanwhile after that; generate then aborts that request too, though add_request never returned its id."""
    import signal

    engine = llm.engine
    add, calls = engine.scheduler.add, []

    def add_then_interrupt(seq):
        calls.append(seq)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGINT)
        return add(seq)

    monkeypatch.setattr(engine.scheduler, "add", add_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[:3], SamplingParams(max_tokens=5), use_tqdm=False)
    monkeypatch.undo()
    assert len(calls) == 2
    _assert_idle(engine)
    # straight to the engine: the request is all there (and runs to its end), not in its requests alone
    calls.clear()
    monkeypatch.setattr(engine.scheduler, "add", add_then_interrupt)
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=2))
    with pytest.raises(KeyboardInterrupt):
        engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=2))
    monkeypatch.undo()
    finished = [out.request_id for _ in range(20) for out in engine.step() if out.finished]
    assert sorted(finished) == ["a", "b"]
    _assert_idle(engine)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_ctrl_c_inside_one_call_leaves_the_other_calls_requests_running(llm, monkeypatch, async_scheduling):
    """A Ctrl-C that lands while a step's tokens come to the host (where the host waits on a GPU) lost the token
    sampled for every other live request: the stream around the interrupted generate then failed at its next step
    (a TypeError in the sampler, or "num_computed_tokens exceeds" with async scheduling), and so did every later
    call until that stream was closed. Now the lost token is sampled again."""
    engine = llm.engine
    monkeypatch.setattr(engine.config, "async_scheduling", async_scheduling)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = llm.generate([PROMPTS[0], PROMPTS[2]], params, use_tqdm=False)
    real = engine._tokens_to_host

    def interrupt_once(launched):
        monkeypatch.setattr(engine, "_tokens_to_host", real)
        raise KeyboardInterrupt

    ids = []
    for _, out in llm.stream(PROMPTS[0], params):
        if not ids:
            monkeypatch.setattr(engine, "_tokens_to_host", interrupt_once)
            with pytest.raises(KeyboardInterrupt):
                llm.generate([PROMPTS[1]], params, use_tqdm=False)
        ids = out.outputs[0].token_ids
    assert ids == want[0].outputs[0].token_ids
    assert texts(llm.generate([PROMPTS[2]], params, use_tqdm=False)) == texts(want[1:])
    _assert_idle(engine)


def test_a_request_that_finished_in_a_step_that_failed_still_ends_its_stream(llm, monkeypatch):
    """The step marked it finished, then failed before building its output: it stayed in engine.requests and its
    stream called step() forever."""
    engine, outer = llm.engine, {}
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    want = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    real = engine._process_token

    def interrupt_when_it_finishes(seq, token):
        delta = real(seq, token)
        if seq.request.request_id == outer.get("id") and seq.is_finished:
            outer.pop("id")
            raise KeyboardInterrupt
        return delta

    monkeypatch.setattr(engine, "_process_token", interrupt_when_it_finishes)
    step, steps = engine.step, []

    def bounded_step():  # a stream that never ends fails here instead of hanging
        steps.append(1)
        if len(steps) > 50:
            pytest.fail("the stream did not end")
        return step()

    monkeypatch.setattr(engine, "step", bounded_step)
    for i, (_, out) in enumerate(llm.stream(PROMPTS[0], params)):
        if i == 0:
            outer["id"] = out.request_id
            with pytest.raises(KeyboardInterrupt):
                llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert out.finished and out.outputs[0].token_ids == want.token_ids and out.outputs[0].text == want.text
    _assert_idle(engine)


def test_an_abort_is_still_reported_after_a_step_that_failed(llm, monkeypatch):
    engine = llm.engine
    engine.add_request("gone", "Hi", SamplingParams(max_tokens=2))
    engine.abort("gone")
    monkeypatch.setattr(engine.scheduler, "schedule", lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        engine.step()
    monkeypatch.undo()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in engine.step()] == [("gone", "abort")]
    _assert_idle(engine)


def test_a_sampling_params_changed_while_its_request_runs_does_not_change_it(llm):
    """The engine keeps a copy, as vLLM does: max_tokens lowered for the next call cut a running stream short, and
    n raised after the request started as n = 1 gave three empty outputs."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    stream = llm.stream(PROMPTS[1], params)
    next(stream)
    params.max_tokens, params.n = 3, 4
    *_, (_, out) = stream
    assert len(out.outputs) == 1 and len(out.outputs[0].token_ids) == 10
    params.n, params.stop_token_ids = 1, (5,)
    llm.engine.check_request("Hi", params)  # "changes nothing": it normalized the caller's tuple to a list
    llm.engine.check_request(prompt="Hi", sampling_params=params, priority=0)  # add_request's names
    assert params.stop_token_ids == (5,)
    _assert_idle(llm.engine)


def test_numpy_and_torch_token_ids_are_prompts_like_ints(llm):
    import numpy as np

    params = SamplingParams(temperature=0, max_tokens=4)
    ids = llm.get_tokenizer()(PROMPTS[1]).input_ids
    want = llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
    for other in (np.array(ids), torch.tensor(ids)):
        assert llm.generate([list(other)], params, use_tqdm=False)[0].outputs[0].token_ids == want
        assert llm.generate(list(other), params, use_tqdm=False)[0].outputs[0].token_ids == want  # one prompt
        assert llm.generate(other, params, use_tqdm=False)[0].outputs[0].token_ids == want  # a bare 1-D array too
        rows = llm.generate(np.stack([np.asarray(other)] * 2), params, use_tqdm=False)  # 2-D: a prompt per row
        assert [o.outputs[0].token_ids for o in rows] == [want, want]
    with pytest.raises(ValueError, match=r"integers in the vocabulary.*\[1.5\]"):
        llm.generate([[1, 1.5]], use_tqdm=False)


def test_an_array_of_prompt_strings_is_a_prompt_each(llm):
    """A column of prompts (np.array of str, df["prompt"].values, a list of numpy strings) is a list of prompts, as
    its list is; it was read as one prompt of token ids and refused in words about the vocabulary."""
    import numpy as np

    params = SamplingParams(temperature=0, max_tokens=3)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)]
    for column in (np.array(PROMPTS[:2]), np.array(PROMPTS[:2], dtype=object), list(np.array(PROMPTS[:2]))):
        assert [o.outputs[0].text for o in llm.generate(column, params, use_tqdm=False)] == want
        finals = {i: o.outputs[0].text for i, o in llm.stream(column, params) if o.finished}
        assert [finals[0], finals[1]] == want


def test_vllm_dict_prompts_and_one_element_tensors(llm):
    """vLLM's TextPrompt / TokensPrompt dicts are prompts; a list whose elements are one-element tensors is a list
    of prompts (a batch of one-token prompts), not one prompt made of their values."""
    params = SamplingParams(temperature=0, max_tokens=3)
    ids = llm.get_tokenizer()(PROMPTS[1]).input_ids
    want = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0].token_ids
    for prompts in ({"prompt": PROMPTS[1]}, [{"prompt": PROMPTS[1]}], [{"prompt_token_ids": ids}],
                    {"prompt_token_ids": torch.tensor(ids)}):
        [out] = llm.generate(prompts, params, use_tqdm=False)
        assert out.outputs[0].token_ids == want and out.prompt_token_ids == ids
    outs = llm.generate([torch.tensor([ids[0]]), torch.tensor([ids[1]])], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [[ids[0]], [ids[1]]]


@pytest.mark.parametrize("prompts, error, message", [
    ([b"hello"], TypeError, "a prompt must be a str, a list of token ids or a dict .* got bytes"),
    ([{"text": "Hi"}], ValueError, r"exactly one key, 'prompt' .* got keys \['text'\]"),
    ([{"prompt": "Hi", "multi_modal_data": {}}], ValueError, "exactly one key"),
    ([{"prompt_token_ids": "Hi"}], TypeError, "prompt_token_ids must be a list of token ids, got str"),
    ([{"prompt": 5}], TypeError, "a prompt must be a str.* got int"),
])
def test_malformed_prompts_are_refused_not_misread(llm, prompts, error, message):
    with pytest.raises(error, match=message):
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    _assert_idle(llm.engine)


@pytest.mark.parametrize("prompts, error, message", [
    (["ok", "fine", ""], ValueError, r"^prompts\[2\]: prompt is empty"),
    (["ok", "x" * 50000], ValueError, r"^prompts\[1\]: prompt of \d+ tokens leaves no room"),
    (["ok", 5], TypeError, r"^prompts\[1\]: a prompt must be a str.* got int"),
])
@pytest.mark.parametrize("door", ["generate", "stream"])
def test_the_bad_prompt_of_a_list_is_named_by_its_index(llm, prompts, error, message, door):
    """Among thousands of prompts the user must find the bad one (stream raises from the call itself)."""
    with pytest.raises(error, match=message):
        if door == "generate":
            llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
        else:
            llm.stream(prompts, SamplingParams(max_tokens=2))
    _assert_idle(llm.engine)


@pytest.mark.parametrize("bad, error, message", [
    ({"prompt": "Hi"}, TypeError, "expected one value or a list"),  # sampling params as a dict
    ([SamplingParams(), None], TypeError, r"sampling params\[1\] must be SamplingParams, got NoneType"),
])
def test_sampling_params_of_the_wrong_type_are_named(llm, bad, error, message):
    with pytest.raises(error, match=message):
        llm.generate(["Hi", "Ho"] if isinstance(bad, list) else ["Hi"], bad, use_tqdm=False)
    _assert_idle(llm.engine)


@pytest.mark.parametrize("prompts, message", [
    ((p for p in PROMPTS), "got generator"),
    (42, "got int"),
])
def test_prompts_of_the_wrong_type_are_named(llm, prompts, message):
    with pytest.raises(TypeError, match=message):
        llm.generate(prompts, use_tqdm=False)


@pytest.mark.parametrize("messages", [[{"content": "Hi"}], [{"role": "user"}], [[]], ["Hi"], [], None])
def test_chat_messages_without_role_or_content_are_a_clear_error(llm, messages):
    with pytest.raises(ValueError, match="role|conversation"):
        llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False)
    _assert_idle(llm.engine)


def test_abort_frees_blocks_at_once(llm):
    engine = llm.engine
    engine.add_request("long", PROMPTS[0] * 20, SamplingParams(max_tokens=100))
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    engine.abort("long")
    assert engine.block_manager.num_used_blocks == 0 and engine.has_unfinished_requests()  # its final output
    [out] = engine.step()
    assert out.request_id == "long" and out.finished and out.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()


def test_a_request_of_n_samples_aborted_during_its_prompt_reports_n_outputs(make_llm):
    """Its samples fork only once the prompt is done; aborted before, it still reports all n (as vLLM), each empty,
    rather than one output for n requested choices."""
    engine = make_llm(max_num_batched_tokens=16).engine
    ids = list(range(1, 60))  # 4 chunks of 16
    engine.add_request("a", ids, SamplingParams(n=3, max_tokens=5, logprobs=1))
    engine.step()  # its first chunk
    engine.abort("a")
    [out] = engine.step()
    assert out.finished and [(c.index, c.finish_reason, c.token_ids, c.logprobs) for c in out.outputs] == [
        (i, "abort", [], []) for i in range(3)]
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_max_num_seqs_holds_for_requests_with_several_samples(make_llm):
    """A request's n samples fork when its prompt is done; admission saves them their seats."""
    llm = make_llm(max_num_seqs=4)
    engine, peak = llm.engine, []
    step = engine.step
    monkey = lambda: (peak.append(len(engine.scheduler.running)), step())[1]  # noqa: E731
    engine.step = monkey
    outs = llm.generate(PROMPTS[:4], SamplingParams(n=4, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [4] * 4 and max(peak) == 4
    _assert_idle(engine)


def test_priority_runs_first_when_only_one_fits(make_llm):
    llm = make_llm(max_num_seqs=1)
    engine = llm.engine
    engine.add_request("low", PROMPTS[0], SamplingParams(temperature=0, max_tokens=2), priority=5)
    engine.add_request("high", PROMPTS[1], SamplingParams(temperature=0, max_tokens=2), priority=-1)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "low"]


def test_kv_cache_too_small_for_max_model_len_is_a_clear_error(make_llm):
    with pytest.raises(ValueError, match="fewer than one max_model_len"):
        make_llm(max_model_len=2048, num_kv_blocks=10)


def test_int8_paths_stay_close_to_float(make_llm, llm):
    """W8A8 (round-to-nearest on load) and the int8 KV cache: prompt log-probs near the float32 ones."""
    ids = llm.get_tokenizer()(" ".join(PROMPTS) * 4).input_ids
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    ref = torch.tensor([e[t] for e, t in zip(llm.generate([ids], params, use_tqdm=False)[0].prompt_logprobs[1:],
                                              ids[1:])])
    # bounds ~2x the measured mean |difference| (0.013 and 0.116 nats): a KV quantizer that truncates instead
    # of rounding gives 0.029 with the int8 cache alone
    for options, bound in ((dict(kv_cache_dtype="int8"), 0.025), (dict(quantization="w8a8", kv_cache_dtype="int8"), 0.15)):
        int8 = make_llm(**options)
        lps = int8.generate([ids], params, use_tqdm=False)[0].prompt_logprobs[1:]
        got = torch.tensor([e[t] for e, t in zip(lps, ids[1:])])
        assert (got - ref).abs().mean() < bound, options
        assert not torch.equal(got, ref), "the int8 path must actually run"


def test_chat_applies_the_template(llm):
    out = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=5),
                   use_tqdm=False)[0]
    assert out.prompt.startswith("<|im_start|>") and out.prompt.rstrip().endswith("assistant")
    assert "<|im_start|>user\nSay hi.<|im_end|>" in out.prompt  # the message itself, in the template's frame
    assert out.prompt_token_ids == llm.get_tokenizer()(out.prompt, add_special_tokens=False).input_ids


def test_cli_generate_streams_text(capsys):
    code = cli_main(["generate", "--dtype", "float32", "--device", "cpu", "--max-model-len", "512",
                     "--max-tokens", "6", "The capital of France is"])
    assert code == 0
    assert "Paris" in capsys.readouterr().out


def test_cli_reports_bad_input_without_a_traceback(capsys):
    code = cli_main(["generate", "--dtype", "float32", "--device", "cpu", "--max-model-len", "512",
                     "--model", "/nonexistent/dir", "hi"])
    assert code == 2
    assert "no such model path" in capsys.readouterr().err


def test_cli_checks_every_prompt_before_generating_any(capsys):
    code = cli_main(["generate", "--dtype", "float32", "--device", "cpu", "--max-model-len", "512",
                     "--max-tokens", "4", "Hello", ""])
    out, err = capsys.readouterr()
    assert code == 2 and "prompt is empty" in err
    assert out == ""  # the first prompt did not run either


def test_cli_rejects_a_device_this_machine_lacks_before_loading(capsys, monkeypatch):
    import eightbit.engine.llm_engine as llm_engine

    monkeypatch.setattr(llm_engine, "load_model", lambda *a, **k: pytest.fail("the model must not load"))
    assert cli_main(["generate", "--device", "tpu", "hi"]) == 2
    assert "'cpu', 'cuda' or 'cuda:N'" in capsys.readouterr().err


def test_the_engine_seed_makes_unseeded_sampling_reproducible():
    from eightbit import LLM

    def samples(seed):
        llm = LLM("llama-tiny", load_format="dummy", device="cpu", dtype="float32", seed=seed,
                  kv_cache_memory_gb=0.01, max_model_len=256)
        params = SamplingParams(temperature=1.0, max_tokens=16)  # no seed of its own
        return [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3], [4, 5]], params, use_tqdm=False)]

    first = samples(1)
    torch.rand(1000)  # the global generator's state must not matter
    assert samples(1) == first
    assert samples(2) != first


def test_chat_does_not_double_the_template_s_bos(llm, monkeypatch):
    """With a tokenizer that adds BOS to text (Llama 3, Mistral) and a template that writes bos_token itself."""
    from eightbit.quant.testing import bos_chat_tokenizer

    base = llm.get_tokenizer()
    tok = bos_chat_tokenizer(base, eos_token=base.eos_token)
    bos = tok.bos_token
    assert tok("hi").input_ids[0] == 1  # the kind of tokenizer this is about
    monkeypatch.setattr(llm.engine, "tokenizer", tok)
    out = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=2),
                   use_tqdm=False)[0]
    assert out.prompt_token_ids == [1] + tok("Say hi.", add_special_tokens=False).input_ids
    assert out.prompt == bos + "Say hi."


def test_min_tokens_holds_back_the_stop_tokens_and_strings(make_llm, llm):
    """vLLM's min_tokens: the end-of-sequence and stop_token_ids cannot be sampled, and stop strings are not looked
    for, until that many tokens are out; the same with async scheduling on and off (a continuation samples one
    token further than the host has seen)."""
    chat = [{"role": "user", "content": "Say hi."}]
    free = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    n, eos = len(free.token_ids), free.token_ids[-1]
    assert free.finish_reason == "stop" and eos in llm.engine.eos_token_ids and n < 30
    params = SamplingParams(temperature=0, max_tokens=40, min_tokens=n + 4, stop_token_ids=[free.token_ids[3]])
    outs = [engine.chat(chat, params, use_tqdm=False)[0].outputs[0] for engine in (llm, make_llm(async_scheduling=False))]
    assert outs[0].token_ids == outs[1].token_ids and outs[0].text == outs[1].text
    held = outs[0].token_ids
    assert held[:3] == free.token_ids[:3] and len(held) >= n + 4
    assert not {eos, free.token_ids[3]} & set(held[: n + 4])  # neither stop token among the first min_tokens
    for engine in (llm, make_llm(async_scheduling=False)):  # the end-of-sequence token is the n-th: allowed there
        for m, same in ((n - 1, True), (n, False)):
            out = engine.chat(chat, SamplingParams(temperature=0, max_tokens=40, min_tokens=m),
                              use_tqdm=False)[0].outputs[0]
            assert (out.token_ids == free.token_ids) is same and out.token_ids[: n - 1] == free.token_ids[: n - 1]
    tok = llm.get_tokenizer()  # a stop string that the m-th token completes: found past min_tokens only
    m = next(m for m in range(2, n) if tok.decode(free.token_ids[m - 1]).strip()
             and tok.decode(free.token_ids[m - 1]) not in tok.decode(free.token_ids[: m - 1]))
    piece = tok.decode(free.token_ids[m - 1])
    for min_tokens, stops in ((m - 1, True), (m, False)):
        out = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40, stop=[piece], min_tokens=min_tokens),
                       use_tqdm=False)[0].outputs[0]
        assert (len(out.token_ids) == m and out.stop_reason == piece) is stops, (min_tokens, piece)
        assert out.token_ids[:m] == free.token_ids[:m]
    word = free.text.split()[0]  # a stop string in the first tokens is not looked for before min_tokens
    early = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40, stop=[word]), use_tqdm=False)[0].outputs[0]
    late = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40, stop=[word], min_tokens=3),
                    use_tqdm=False)[0].outputs[0]
    assert early.text == "" and early.stop_reason == word
    assert late.text == free.text and late.finish_reason == "stop" and late.stop_reason is None


def test_logit_bias_steers_and_bans_tokens(llm):
    prompt, greedy = PROMPTS[1], SamplingParams(temperature=0, max_tokens=6)
    free = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    banned = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logit_bias={free[0]: -100}),
                          use_tqdm=False)[0].outputs[0].token_ids
    forced = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logit_bias={1234: 100}),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert banned[0] != free[0] and free[0] not in banned
    assert forced == [1234] * 6
    with pytest.raises(ValueError, match=r"logit_bias has token ids outside the vocabulary \[0, 49152\): \[49152\]"):
        llm.generate([prompt], SamplingParams(logit_bias={49152: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids has token ids outside the vocabulary"):
        llm.generate([prompt], SamplingParams(stop_token_ids=[10**6]), use_tqdm=False)
    _assert_idle(llm.engine)


def test_a_step_copies_no_sequence_s_tokens(llm, monkeypatch):
    """Each step needs every running sequence's output count, not its tokens: a copy is O(length) per sequence per
    step (8 ms a step for 256 sequences of 4.6k tokens on the 2-core CPU). generate() copies them once per
    sample, into its final output."""
    from eightbit.engine.sequence import Sequence

    copies = []
    real = Sequence.output_tokens_from  # every copy of a sequence's output tokens goes through it
    monkeypatch.setattr(Sequence, "output_tokens_from", lambda s, first: copies.append(s.seq_id) or real(s, first))
    params = [SamplingParams(temperature=0, max_tokens=12, min_tokens=3, stop=["zzz"]),
              SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=9, ignore_eos=True, presence_penalty=0.5)]
    outs = llm.generate(["The sea is", "1, 2, 3,"], params, use_tqdm=False)
    assert [len(c.token_ids) for o in outs for c in o.outputs][1:] == [9, 9]
    assert len(copies) == 3 and len(set(copies)) == 3  # one copy per sample, at its end


def test_an_llm_leaves_the_callers_garbage_collection_alone(make_llm):
    """`LLM` in a user's program freezes nothing: a user's object in a reference cycle, alive when the engine is
    built, is still collected once dropped (a frozen one never is: 200 MB stayed for the life of the process)."""
    import gc
    import weakref

    class Node:
        def __init__(self):
            self.me = self  # a cycle: only the collector frees it

    node = Node()
    alive = weakref.ref(node)
    llm = make_llm()
    del node
    gc.collect()
    assert alive() is None
    del llm


def test_a_frozen_start_up_heap_skips_later_collections_and_a_dropped_llm_is_still_freed(make_llm):
    """What `eightbit serve`'s processes and the benchmarks do (llm_engine.freeze_startup_heap): what exists after
    start-up (torch, transformers, the model) is left out of later collections, so that no step stalls on a full
    collection over it; an LLM that is dropped must still be freed, or a process that builds one after another
    (the benchmarks) keeps each one's weights and KV cache."""
    import gc
    import weakref

    from eightbit.engine.llm_engine import freeze_startup_heap

    llm = make_llm()
    freeze_startup_heap()
    try:
        assert len(gc.get_objects()) < 0.01 * gc.get_freeze_count()  # what a full collection now walks
        outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
        engine = llm.engine
        held = [weakref.ref(x) for x in (llm, engine, engine.model, engine.runner, engine.runner.kv_cache)]
        del llm, engine, outs
        gc.collect()
        assert [r() for r in held] == [None] * len(held)
    finally:
        gc.unfreeze()  # the rest of this test process collects as before


# --- s62 mutation review: killing tests for the LLM API, EngineConfig and outputs ---------------------------------


def test_generate_shows_a_progress_bar_only_when_asked(llm, capsys):
    """use_tqdm=False writes nothing; use_tqdm=True counts the finished requests up to the number of prompts."""
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert capsys.readouterr().err == ""
    llm.generate(PROMPTS[:3], params, use_tqdm=True)
    err = capsys.readouterr().err
    assert "generating" in err and f"{len(PROMPTS[:3])}/{len(PROMPTS[:3])}" in err


def test_a_bool_in_a_list_of_priorities_is_refused_by_its_index(llm):
    """A bool is no int here, in a list as on its own (True would run as priority 1)."""
    with pytest.raises(TypeError, match=r"priorities\[1\] must be int, got bool"):
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=1), use_tqdm=False, priority=[0, True])
    _assert_idle(llm.engine)


def test_a_list_of_bools_is_a_list_of_bad_prompts_not_a_prompt_of_ids(llm):
    """_is_number: a bool is no token id, so [True, False] is two prompts, the first of them named as a bool."""
    with pytest.raises(TypeError, match=r"^prompts\[0\]: a prompt must be a str.* got bool"):
        llm.generate([True, False], SamplingParams(max_tokens=1), use_tqdm=False)
    _assert_idle(llm.engine)


def test_a_list_of_zero_d_arrays_is_one_prompt_of_ids(llm):
    """Iterating an array gives 0-d arrays: integers of any width (numpy, torch int and uint) are token ids, as the
    same Python ints; floats make one prompt of float ids, which the engine names, as for Python floats."""
    import numpy as np

    params = SamplingParams(temperature=0, max_tokens=3)
    ids = [17, 42, 200]  # each fits a uint8
    want = llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
    for prompt in ([np.array(i) for i in ids], list(torch.tensor(ids, dtype=torch.uint8)),
                   list(torch.tensor(ids, dtype=torch.int32))):
        [out] = llm.generate(prompt, params, use_tqdm=False)
        assert out.prompt_token_ids == ids and out.outputs[0].token_ids == want
    for floats in ([np.array(1.0), np.array(2.0)], list(torch.tensor([1.0, 2.0]))):
        with pytest.raises(ValueError, match=r"^prompt token ids must be integers in the vocabulary"):
            llm.generate(floats, params, use_tqdm=False)
    _assert_idle(llm.engine)


def test_chat_takes_a_list_of_conversations(llm):
    """One output per conversation, in order, each as that conversation alone gives it; the prompt is the
    tokenizer's own chat template applied to it."""
    convs = [[{"role": "user", "content": "Say hi."}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to three."}]]
    params = SamplingParams(temperature=0, max_tokens=4)
    batch = llm.chat(convs, params, use_tqdm=False)
    alone = [llm.chat(c, params, use_tqdm=False)[0] for c in convs]
    assert len(batch) == len(convs)
    assert [(o.prompt, o.outputs[0].token_ids) for o in batch] == [(o.prompt, o.outputs[0].token_ids) for o in alone]
    tok = llm.get_tokenizer()
    assert [o.prompt for o in batch] == [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                                         for c in convs]


def test_chat_on_a_model_without_a_tokenizer_is_a_clear_error():
    from eightbit import LLM

    llm = LLM("llama-tiny", load_format="dummy", device="cpu", dtype="float32", kv_cache_memory_gb=0.01,
              max_model_len=256)
    assert llm.get_tokenizer() is None
    with pytest.raises(ValueError, match="chat needs a tokenizer"):
        llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2), use_tqdm=False)
    _assert_idle(llm.engine)


def test_generate_skips_every_request_id_already_taken(llm):
    """Several ids in a row may be taken by requests added straight to the engine: generate skips them all."""
    engine = llm.engine
    first = next(llm._ids) + 1  # the id generate's first prompt would get
    taken = [str(first), str(first + 1)]
    for request_id in taken:
        engine.add_request(request_id, "Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    outs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert not set(taken) & {o.request_id for o in outs} and all(len(o.outputs[0].token_ids) == 2 for o in outs)
    assert set(taken) <= set(engine.requests)
    while engine.has_unfinished_requests():
        engine.step()
    _assert_idle(engine)


@pytest.mark.parametrize("prompt, error, message", [
    ("", ValueError, "prompt is empty"),
    ("x" * 50000, ValueError, r"prompt of \d+ tokens leaves no room"),
    ([b"hello"], TypeError, "a prompt must be a str"),  # a list of one non-number: a list of one prompt
])
def test_the_error_of_a_single_prompt_names_no_index(llm, prompt, error, message):
    """prompts[i] is said only where there are several prompts to tell apart."""
    with pytest.raises(error, match=f"^{message}"):
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    _assert_idle(llm.engine)


def test_finished_calls_leave_no_output_queues_behind(llm):
    """Each request's route to its call's queue goes when the call ends (finished, or a stream closed early):
    a process that runs many calls must not keep one entry per request it ever ran."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert llm._inboxes == {}
    list(llm.stream(PROMPTS[:2], params))
    assert llm._inboxes == {}
    stream = llm.stream(PROMPTS[:2], params)
    next(stream)
    stream.close()  # dropped early: its requests are aborted, and their routes go too
    assert llm._inboxes == {}
    _assert_idle(llm.engine)


def test_engine_config_bounds_are_inclusive_where_documented():
    """seed in [0, 2**63) and gpu_memory_utilization in (0, 1]: each end on both sides of its bound."""
    from eightbit.engine.config import EngineConfig

    assert EngineConfig(device="cpu", seed=2**63 - 1).seed == 2**63 - 1
    assert EngineConfig(device="cpu", seed=0).seed == 0
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*63\)"):
        EngineConfig(device="cpu", seed=2**63)
    assert EngineConfig(device="cpu", gpu_memory_utilization=1).gpu_memory_utilization == 1
    assert EngineConfig(device="cpu", gpu_memory_utilization=1e-3).gpu_memory_utilization == 1e-3
    for bad in (0, 0.0, -0.5, 1 + 1e-9):
        with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
            EngineConfig(device="cpu", gpu_memory_utilization=bad)


def test_engine_config_takes_every_dtype_alias():
    from eightbit.engine.config import DTYPE_ALIASES, DTYPES, EngineConfig

    for alias, name in (("fp16", "float16"), ("fp32", "float32"), ("bf16", "bfloat16"), ("half", "float16"),
                        ("float", "float32")):
        config = EngineConfig(device="cpu", dtype=alias)
        assert config.dtype == name and config.torch_dtype == getattr(torch, name)
    assert set(DTYPE_ALIASES.values()) <= set(DTYPES)


@pytest.mark.parametrize("device", ["meta", "mps", 1.5, "cuda:x"])
def test_a_device_that_is_not_cpu_or_cuda_is_named_as_such(device):
    """Not "no CUDA GPU" (a torch device of another type) nor torch's own TypeError (not a device name at all)."""
    from eightbit.engine.config import EngineConfig

    with pytest.raises(ValueError, match=r"device must be 'cpu', 'cuda' or 'cuda:N'"):
        EngineConfig(device=device)


def test_a_gpu_index_past_the_machine_s_gpus_is_named_as_such(monkeypatch):
    """cuda:2 on a machine of two GPUs: "has 2 GPU(s)", not advice to select a GPU it does not have. (Simulated.)"""
    from eightbit.engine.config import checked_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    for index in (2, 3):
        with pytest.raises(ValueError, match=rf"'cuda:{index}' asked for, but this machine has 2 GPU\(s\)"):
            checked_device(f"cuda:{index}")


def test_the_outputs_of_samples_that_never_forked_are_like_the_one_that_did(make_llm):
    """A request of n samples aborted during its prompt reports n outputs; the n - 1 that were never forked carry
    what the aborted first one carries (no text, no delta, no stop reason), only their index differs."""
    import dataclasses

    engine = make_llm(max_num_batched_tokens=16).engine
    engine.add_request("a", list(range(1, 60)), SamplingParams(n=3, max_tokens=5))
    engine.step()
    engine.abort("a")
    [out] = engine.step()
    first = out.outputs[0]
    assert first.finish_reason == "abort" and first.stop_reason is None and first.delta == "" == first.text
    assert [dataclasses.replace(c, index=0) for c in out.outputs[1:]] == [first, first]
    assert [c.index for c in out.outputs] == [0, 1, 2]
