"""Random workloads through the whole engine on the CPU: requests arriving between steps, shared prefixes, n > 1
forks, stop tokens and min_tokens, priorities, aborts, a KV cache small enough to preempt, small token budgets,
async scheduling on and off, and the three ways of reporting a request (every step, deltas, final only).

Every request that is not aborted must get, sample for sample, the tokens and finish reasons it gets when it runs
alone on a roomy engine; an aborted one a prefix of those tokens. When the work is done, every KV block is free and
no sequence is left."""

import random
import signal

import pytest
import torch

from eightbit import LLM, EngineConfig, LLMEngine, SamplingParams

MAX_MODEL_LEN = 48
MODEL = dict(model="llama-tiny", load_format="dummy", device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
MODES = ("every_step", "delta", "final_only")
CHUNK = 8  # prompts are made of 8-token chunks (a multiple of every block size here) and a random tail, so
# equal blocks recur after different prefixes: the prefix cache must key a block on everything before it


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's steps are host-bound: one torch thread runs them several times faster than two (which
    wait on each other, more so on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def alone_engines():
    engines = {}

    def get(kv_cache_dtype):
        if kv_cache_dtype not in engines:
            engines[kv_cache_dtype] = LLMEngine(EngineConfig(**MODEL, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=64,
                                                             enable_prefix_caching=False))
        return engines[kv_cache_dtype]

    return get


def run_alone(engine, prompt, params) -> tuple[list, list]:
    """Each sample's token ids and finish reason, the request the only one in the engine."""
    engine.add_request("alone", prompt, params, final_only=True)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert final is not None and final.finished
    outputs = sorted(final.outputs, key=lambda o: o.index)
    return [o.token_ids for o in outputs], [o.finish_reason for o in outputs]


def random_prompt(rng, chunks, max_len):
    prompt = [t for _ in range(rng.randrange(4)) for t in rng.choice(chunks)][: max_len - 1]
    return prompt + [rng.randrange(1, 1024) for _ in range(rng.randrange(1, max_len - len(prompt) + 1))]


def random_params(rng, alone, prompt, ns=(1, 1, 1, 1, 2, 2, 3)):
    """Greedy or seeded sampling, n of 1-3; a length cap or none (max_model_len); sometimes a stop token the greedy
    reply has (its expected reply checked here by hand), or a min_tokens that bans it for a while."""
    n = rng.choice(ns)
    max_tokens = None if rng.random() < 0.15 else rng.randrange(1, MAX_MODEL_LEN - len(prompt) + 1)
    if rng.random() < 0.3:  # each sample's generator is its own (seed + index)
        return SamplingParams(n=n, temperature=0.8, seed=rng.randrange(1000), max_tokens=max_tokens, ignore_eos=True)
    params = SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    if rng.random() < 0.35:
        greedy = run_alone(alone, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))[0][0]
        stop = rng.choice(greedy)
        params.stop_token_ids = [stop]
        if rng.random() < 0.3:
            params.min_tokens = rng.randrange(1, len(greedy) + 1)
        else:  # the reply ends at the stop token's first appearance, and keeps it
            end = greedy.index(stop) + 1
            assert run_alone(alone, prompt, params) == ([greedy[:end]] * n, ["stop"] * n)
    return params


def random_requests(rng, alone, count, ns=(1, 1, 1, 1, 2, 2, 3)) -> list[tuple]:
    chunks = [[rng.randrange(1, 1024) for _ in range(CHUNK)] for _ in range(3)]
    requests = []
    for i in range(count):
        prompt = random_prompt(rng, chunks, rng.randrange(2, MAX_MODEL_LEN - 8))
        params = random_params(rng, alone, prompt, ns)
        requests.append((f"r{i}", prompt, params, rng.randrange(3), rng.choice(MODES)))
    return requests


def random_config(rng, requests, kv_cache_dtype) -> EngineConfig:
    """A KV cache with room for the largest request's samples each in blocks of its own, and a block or two more:
    running several requests at once preempts."""
    block_size = rng.choice((2, 4, 8))
    blocks = max(p.n * -(-(len(prompt) + (p.max_tokens or MAX_MODEL_LEN)) // block_size)
                 for _, prompt, p, _, _ in requests)
    blocks = max(blocks, -(-MAX_MODEL_LEN // block_size))  # the engine's minimum: one max_model_len sequence
    return EngineConfig(**MODEL, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                        num_kv_blocks=blocks + rng.randrange(3), max_num_seqs=rng.randrange(3, 9),
                        max_num_batched_tokens=rng.choice((3, 8, 16, 64)),
                        enable_prefix_caching=rng.random() < 0.7, async_scheduling=rng.random() < 0.5)


def drive(engine, rng, requests, step=None):
    """Add the requests over the steps, abort some, and return {request id: ({sample: token ids}, {sample: finish
    reason})} and the set of aborted ids. step: in place of engine.step."""
    pending = list(requests)
    tokens, reasons, aborted = {}, {}, set()
    modes = {rid: mode for rid, _, _, _, mode in requests}
    steps = 0
    while pending or engine.has_unfinished_requests():
        steps += 1
        assert steps < 3000, "the engine stopped making progress"
        while pending and (not engine.has_unfinished_requests() or rng.random() < 0.6):
            rid, prompt, params, priority, mode = pending.pop(0)
            engine.add_request(rid, prompt, params, priority, final_only=mode == "final_only", delta=mode == "delta")
            tokens[rid] = {}
        live = [rid for rid in engine.requests if rid not in aborted]
        if live and rng.random() < 0.02:
            rid = rng.choice(live)
            engine.abort(rid)
            aborted.add(rid)
        for out in (step or engine.step)():
            rid = out.request_id
            assert rid not in reasons, f"{rid} reported after its final output"
            assert modes[rid] != "final_only" or out.finished
            for o in out.outputs:
                if modes[rid] == "delta":
                    tokens[rid].setdefault(o.index, []).extend(o.token_ids)
                else:
                    tokens[rid][o.index] = list(o.token_ids)
            if out.finished:
                reasons[rid] = {o.index: o.finish_reason for o in out.outputs}
    assert set(reasons) == set(tokens), "every request ends with one final output"
    return {rid: (tokens[rid], reasons[rid]) for rid in tokens}, aborted


@pytest.mark.parametrize("seed, kv_cache_dtype", [(seed, "auto") for seed in range(8)] +
                         [(seed, "int8") for seed in range(8, 12)])
def test_random_workloads_give_every_request_what_it_gets_alone(seed, kv_cache_dtype, alone_engines):
    """(The int8 KV cache too: a token's quantized K and V do not depend on the step that wrote them.)"""
    rng = random.Random(seed)
    alone_engine = alone_engines(kv_cache_dtype)
    requests = random_requests(rng, alone_engine, rng.randrange(8, 20))
    engine = LLMEngine(random_config(rng, requests, kv_cache_dtype))
    got, aborted = drive(engine, rng, requests)

    for rid, prompt, params, _, _ in requests:
        want_ids, want_reasons = run_alone(alone_engine, prompt, params)
        ids, reasons = got[rid]
        if rid in aborted:
            for i, sample in ids.items():
                assert sample == want_ids[i][: len(sample)], f"{rid} sample {i}: not a prefix of its tokens alone"
                assert reasons[i] in ("abort", want_reasons[i])
        else:
            assert [ids[i] for i in range(params.n)] == want_ids, f"{rid} ({engine.config}) differs from alone"
            assert [reasons[i] for i in range(params.n)] == want_reasons

    bm = engine.block_manager
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_unfinished()
    assert bm.num_free_blocks == bm.num_blocks and not bm.copies_due, "KV blocks leaked"


def interrupt_sometimes(rng, fn, rate=1 / 8):
    """fn that sends this process a SIGINT (Ctrl-C) on some calls, before doing its work or after."""

    def wrapped(*args, **kwargs):
        if rng.random() < rate:
            signal.raise_signal(signal.SIGINT)
        result = fn(*args, **kwargs)
        if rng.random() < rate:
            signal.raise_signal(signal.SIGINT)
        return result

    return wrapped


@pytest.mark.parametrize("where", ["schedule", "block hand-outs", "model run", "tokens to host", "token checks"])
@pytest.mark.parametrize("seed", range(8))
def test_steps_interrupted_anywhere_lose_nothing(seed, where, alone_engines):
    """A Ctrl-C may land anywhere in a step; the engine's other requests run on (another call's generate or stream
    in the same program). After the schedule, the block tables point at copy-on-write copies not done yet; after
    the model run, sampled tokens have not reached their sequences; in the token checks, a token appended but not
    checked would run its sequence past its stop or length (and past max_model_len: every later step failed).
    Greedy requests must still get what they get alone (a seeded one may not: its generator has moved on), every
    output must arrive (delta reports too), and no block may leak."""
    rng = random.Random(100 + seed)
    alone_engine = alone_engines("auto")
    requests = random_requests(rng, alone_engine, 16, ns=(1, 2, 2, 3))  # forks: copy-on-write
    config = random_config(rng, requests, "auto")
    if where == "block hand-outs":  # inside the block manager's calls, async scheduling's continuations among them
        config.async_scheduling = True
    engine = LLMEngine(config)
    faults = random.Random(seed)
    if where == "block hand-outs":
        engine.block_manager._take_free = interrupt_sometimes(faults, engine.block_manager._take_free)
    elif where == "schedule":  # and inside it: the block manager's changes (fork: when a prompt's samples fork)
        for name in ("schedule", "schedule_continuation"):
            setattr(engine.scheduler, name, interrupt_sometimes(faults, getattr(engine.scheduler, name)))
        for name in ("allocate", "append_slots", "fork"):
            setattr(engine.block_manager, name, interrupt_sometimes(faults, getattr(engine.block_manager, name)))
    elif where == "model run":
        engine.runner.run = interrupt_sometimes(faults, engine.runner.run)
    elif where == "tokens to host":
        engine._tokens_to_host = interrupt_sometimes(faults, engine._tokens_to_host)
    else:
        engine._process_token = interrupt_sometimes(faults, engine._process_token, rate=1 / 40)
    interrupts = []

    def step():
        while True:
            try:
                return engine.step()
            except KeyboardInterrupt:
                interrupts.append(1)

    got, aborted = drive(engine, rng, requests, step)
    assert len(interrupts) >= 5
    for rid, prompt, params, _, _ in requests:
        ids, reasons = got[rid]
        if params.temperature == 0 and rid not in aborted:
            want_ids, want_reasons = run_alone(alone_engine, prompt, params)
            assert [ids[i] for i in range(params.n)] == want_ids, f"{rid}: after interrupted steps, not as alone"
            assert [reasons[i] for i in range(params.n)] == want_reasons
    bm = engine.block_manager
    assert not engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    assert not bm.copies_due


def tiny_engine(**options) -> LLMEngine:
    return LLMEngine(EngineConfig(**MODEL, block_size=4, num_kv_blocks=64, **options))


GREEDY = dict(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_an_engine_built_in_inference_mode_copies_on_write_outside_it(alone_engines):
    """Its KV cache is made of inference tensors, which only inference mode may change in place: the copy-on-write
    copy failed outside it, stayed due, and failed every later step."""
    with torch.inference_mode():
        engine = tiny_engine()
    assert engine.runner.kv_cache.k.is_inference()
    params = SamplingParams(n=2, **GREEDY)
    got = run_alone(engine, [1, 2, 3, 4, 5], params)  # 5 tokens: the samples share a half-full block
    assert got == run_alone(alone_engines("auto"), [1, 2, 3, 4, 5], params)


def test_a_copy_that_failed_with_its_step_is_dropped_when_its_request_is_aborted(alone_engines):
    """The copies fail at the launch (a transient device error), so they stay due; the caller then aborts the
    request (as generate and the server do). Its blocks go back to the pool, and its stale copy must not land on
    their next owner, beside that owner's own copy into the same block."""
    engine = tiny_engine(max_num_batched_tokens=16, async_scheduling=False)
    kv = engine.runner.kv_cache
    engine.add_request("F", [1, 2, 3, 4, 5], SamplingParams(n=2, **GREEDY))
    engine.add_request("R", [21, 22, 23, 24, 25], SamplingParams(n=4, **GREEDY))
    engine.step()  # both prefilled and forked: each request's samples share their half-full second block
    engine.scheduler.max_num_batched_tokens = 3  # the next step: F's two samples and R's first, each a copy
    real_copy, calls, failures = kv.copy_blocks, [], [RuntimeError("a transient device error")]

    def copy_blocks(copies):
        calls.append(list(copies))
        if failures:
            raise failures.pop()
        return real_copy(copies)

    kv.copy_blocks = copy_blocks
    with pytest.raises(RuntimeError, match="transient"):
        engine.step()
    bm = engine.block_manager
    due = list(bm.copies_due)
    f_blocks = {b for seq in engine.requests["F"].seqs for b in bm.block_table(seq.seq_id)}
    assert len(due) == 2 and sum(dst in f_blocks for _, dst in due) == 1  # F's first sample's copy, and R's
    engine.abort("F")
    assert bm.copies_due == [(src, dst) for src, dst in due if dst not in f_blocks]
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((out.request_id, out) for out in engine.step())
    for copies in calls[1:]:
        dsts = [dst for _, dst in copies]
        assert len(dsts) == len(set(dsts)), f"two copies into one block: {copies}"
    want = run_alone(alone_engines("auto"), [21, 22, 23, 24, 25], SamplingParams(n=4, **GREEDY))
    assert [o.token_ids for o in sorted(outputs["R"].outputs, key=lambda o: o.index)] == want[0]
    assert not bm.copies_due


def test_a_ctrl_c_during_the_copies_on_write_comes_after_them_and_they_are_done_once():
    """A batch of copies may read a block that an earlier copy of the same batch writes: here block b1 is the
    source of a's copy, then freed (b, its last other reader, gone) and handed out again as the destination of c's
    copy. Done once, the batch reads every source before it writes; done twice (a Ctrl-C between the copies and
    their clearing left them due), a's new block would get c's data."""
    engine = tiny_engine()
    bm, kv = engine.block_manager, engine.runner.kv_cache
    bm.allocate("a", [1, 2, 3, 4, 5], use_prefix_cache=False)
    bm.fork("a", "b")  # a and b share their half-full second block
    bm.allocate("c", [9, 9, 9, 9, 9], use_prefix_cache=False)
    bm.fork("c", "d")
    bm.append_slots("a", 6)  # its sixth token: a copy of the shared block
    bm.free("b")
    bm.append_slots("c", 6)
    (a_src, a_dst), (c_src, c_dst) = bm.copies_due
    assert c_dst == a_src  # the hazard
    for block in (a_src, c_src):
        kv.k[:, block], kv.v[:, block] = block, -block
    real = kv.copy_blocks

    def interrupted(copies):
        real(copies)
        signal.raise_signal(signal.SIGINT)

    kv.copy_blocks = interrupted
    with pytest.raises(KeyboardInterrupt):
        engine._copy_due_blocks()
    kv.copy_blocks = real
    engine._copy_due_blocks()  # the next launch's
    assert (kv.k[:, a_dst] == a_src).all() and (kv.v[:, a_dst] == -a_src).all()
    assert (kv.k[:, c_dst] == c_src).all() and not bm.copies_due


def held_ctrl_c_in_the_token_checks(engine):
    """A step whose token checks get a Ctrl-C, held to their end: the step's outputs are kept for the next."""
    real = engine._process_token

    def interrupted(seq, token):
        signal.raise_signal(signal.SIGINT)
        return real(seq, token)

    engine._process_token = interrupted
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    engine._process_token = real


def test_a_request_aborted_unheard_after_a_held_ctrl_c_leaves_no_output_behind():
    """A Ctrl-C held in a step's token checks keeps the step's outputs for the next step; a caller that then aborts
    its request without a report (a stream's clean-up) must not leave that output behind: the engine would not be
    idle, and the next step would report a request that no longer exists."""
    engine = tiny_engine()
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    held_ctrl_c_in_the_token_checks(engine)
    assert engine.has_unfinished_requests()  # a's output of that step, kept
    engine.abort("a", report=False)
    assert not engine.has_unfinished_requests() and engine.step() == []


# --- interrupts in each of the step's parts, abort and LLM's clean-up (from a mutation audit) ---


def ctrl_c_at_the_first_finish(engine):
    """A Ctrl-C right after the first sequence the scheduler finishes; returns the undo."""
    real, calls = engine.scheduler.finish, []

    def finish(seq):
        real(seq)
        calls.append(seq)
        if len(calls) == 1:
            signal.raise_signal(signal.SIGINT)

    engine.scheduler.finish = finish
    return lambda: setattr(engine.scheduler, "finish", real)


def test_a_ctrl_c_inside_an_abort_finishes_every_sample_first():
    engine = tiny_engine()
    engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(n=3, max_tokens=20, ignore_eos=True))
    engine.step()
    assert len(engine.requests["a"].seqs) == 3
    undo = ctrl_c_at_the_first_finish(engine)
    with pytest.raises(KeyboardInterrupt):
        engine.abort("a", report=False)
    undo()
    assert not engine.scheduler.has_unfinished() and "a" not in engine.requests
    assert engine.block_manager.num_used_blocks == 0


def test_an_abort_reported_after_a_held_ctrl_c_keeps_the_step_s_delta():
    engine = tiny_engine(async_scheduling=False)
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), delta=True)
    seq = engine.requests["a"].seqs[0]
    got = [t for out in engine.step() for t in out.outputs[0].token_ids]
    held_ctrl_c_in_the_token_checks(engine)  # the step's output (its new token) kept for the next step
    engine.abort("a")
    outs = engine.step()
    got += [t for out in outs for t in out.outputs[0].token_ids]
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert got == seq.output_token_ids and len(got) == 2


def test_a_request_that_finished_in_a_held_step_and_is_aborted_unheard_leaves_nothing():
    engine = tiny_engine()
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    held_ctrl_c_in_the_token_checks(engine)  # a finishes in it; its final output kept for the next step
    assert "a" not in engine.requests and engine.is_unreported("a")
    engine.abort("a", report=False)  # the stream's clean-up: it still counted a as unfinished
    assert not engine.is_unreported("a") and not engine.has_unfinished_requests() and engine.step() == []


@pytest.mark.parametrize("where", ["model run", "tokens to host"])
def test_the_model_run_and_the_wait_for_its_tokens_stay_interruptible(where):
    engine = tiny_engine()
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    owner, name = (engine.runner, "run") if where == "model run" else (engine, "_tokens_to_host")
    real, reached = getattr(owner, name), []

    def interrupted(*args):
        signal.raise_signal(signal.SIGINT)
        reached.append("past the Ctrl-C")
        return real(*args)

    setattr(owner, name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    setattr(owner, name, real)
    assert reached == []
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_used_blocks == 0


@pytest.fixture(scope="module")
def tiny_llm():
    return LLM(**MODEL, block_size=4, num_kv_blocks=64)


def test_a_second_ctrl_c_in_generate_s_clean_up_leaves_none_of_its_requests(tiny_llm):
    engine = tiny_llm.engine
    real_step, steps = engine.step, []

    def step():
        steps.append(1)
        if len(steps) == 2:
            undo.append(ctrl_c_at_the_first_finish(engine))  # the second Ctrl-C comes in the first abort
            raise KeyboardInterrupt
        return real_step()

    undo = []
    engine.step = step
    with pytest.raises(KeyboardInterrupt):
        tiny_llm.generate([[1, 2, 3], [4, 5, 6], [7, 8, 9]], SamplingParams(max_tokens=20, ignore_eos=True),
                          use_tqdm=False)
    engine.step = real_step
    undo[0]()
    assert not engine.requests and not engine.scheduler.has_unfinished()
    assert engine.block_manager.num_used_blocks == 0


def test_a_ctrl_c_while_a_bad_prompt_cancels_the_call_leaves_none_of_its_requests(tiny_llm):
    engine = tiny_llm.engine
    undo = ctrl_c_at_the_first_finish(engine)
    try:
        with pytest.raises(KeyboardInterrupt):
            tiny_llm.generate([[1, 2, 3], [4, 5, 6], []], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        undo()
    assert not engine.requests and not engine.scheduler.has_unfinished()
