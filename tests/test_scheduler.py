"""The scheduler's arithmetic, without a model: budgets, chunking, decode-first order, preemption, priorities."""

import pytest

from eightbit import SamplingParams
from eightbit.engine.block_manager import BlockManager
from eightbit.engine.config import EngineConfig
from eightbit.engine.scheduler import Scheduler
from eightbit.engine.sequence import Request, SequenceStatus


def make(num_blocks=64, budget=32, max_seqs=8):
    config = EngineConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, device="cpu")
    bm = BlockManager(num_blocks, block_size=4)
    return Scheduler(config, bm), bm


def add(sched, n_tokens, priority=0, start=0):
    request = Request(str(n_tokens) + str(start), None, list(range(start, start + n_tokens)),
                      SamplingParams(max_tokens=100), priority)
    sched.add(request.seqs[0])
    return request.seqs[0]


def finish_step(out):
    """What the engine does after a step: mark computed, and sample a token for complete sequences."""
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)


def test_a_long_prompt_is_prefilled_in_chunks_within_the_budget():
    sched, _ = make(budget=32)
    seq = add(sched, 100)
    chunks = []
    while seq.num_computed_tokens < 100:
        out = sched.schedule()
        assert out.num_tokens <= 32
        chunks.append(out.scheduled[0][1])
        finish_step(out)
    assert chunks == [32, 32, 32, 4]
    assert seq.num_tokens == 101  # sampled once, after the last chunk


def test_running_decodes_go_first_then_waiting_prefills_take_the_rest():
    sched, _ = make(budget=16)
    a = add(sched, 8)
    finish_step(sched.schedule())  # a prefilled, now decoding
    b = add(sched, 40, start=100)
    out = sched.schedule()
    assert [(s, n) for s, n in out.scheduled] == [(a, 1), (b, 15)]


def test_max_num_seqs_limits_admission():
    sched, _ = make(max_seqs=2, budget=100)
    seqs = [add(sched, 4, start=10 * i) for i in range(3)]
    out = sched.schedule()
    assert [s for s, _ in out.scheduled] == seqs[:2]
    assert seqs[2].status is SequenceStatus.WAITING


def test_a_request_with_n_samples_takes_n_seats_before_it_forks():
    """Its samples join the running set when the prompt is done (the engine forks them without asking the
    scheduler), so admission counts all n of them: max_num_seqs holds once they have forked."""
    sched, bm = make(max_seqs=4, budget=100)
    request = Request("n3", None, [1, 2, 3, 4], SamplingParams(n=3, max_tokens=5))
    sched.add(request.seqs[0])
    single = add(sched, 4, start=10)
    late = add(sched, 4, start=20)
    out = sched.schedule()
    assert [s for s, _ in out.scheduled] == [request.seqs[0], single]  # 3 + 1 seats: full
    assert late.status is SequenceStatus.WAITING
    finish_step(out)
    for index in (1, 2):  # what the engine's fork does when the prompt is done
        child = request.seqs[0].fork(index)
        bm.fork(request.seqs[0].seq_id, child.seq_id)
        request.seqs.append(child)
        sched.add_running(child)
    assert len(sched.running) == 4 and late not in [s for s, _ in sched.schedule().scheduled]


def test_out_of_blocks_preempts_the_latest_and_it_restarts_from_scratch():
    sched, bm = make(num_blocks=4, budget=100)  # 16 slots
    a, b = add(sched, 8), add(sched, 8, start=50)  # both fit exactly: 2 blocks each
    finish_step(sched.schedule())
    out = sched.schedule()  # a needs a 3rd block for its 9th token: b (latest) is preempted
    assert out.preempted == [b] and [s for s, _ in out.scheduled] == [a]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.token_ids[-1] == 7  # keeps its sampled token; recompute covers prompt + output
    assert bm.num_used_blocks == 3
    assert sched.num_preemptions == 1


def test_forked_samples_keep_their_requests_place_in_line():
    """Out of blocks, the later request is preempted, not a sample of an earlier one. A sample forked when its
    request's prompt is done once took a fresh arrival number, so a request that arrived while the prompt was
    prefilled counted as earlier and kept its blocks at the sample's expense."""
    sched, bm = make(num_blocks=6, budget=100)  # 24 slots of 4
    request = Request("n2", None, list(range(7)), SamplingParams(n=2, max_tokens=50))
    first = request.seqs[0]
    sched.add(first)
    later = add(sched, 7, start=50)
    finish_step(sched.schedule())  # both prompts done (2 blocks each); fork as the engine does
    child = first.fork(1)
    bm.fork(first.seq_id, child.seq_id)
    request.seqs.append(child)
    sched.add_running(child)
    assert (child.num_prompt_tokens, child.num_computed_tokens, child.token_ids) == (7, 7, first.token_ids)
    finish_step(sched.schedule())  # one copy-on-write for the shared second block: 1 block left free
    assert bm.num_free_blocks == 1
    out = sched.schedule()  # each of the three needs a third block
    assert out.preempted == [later]
    assert sched.running == [first, child]


def test_a_step_that_preempts_admits_no_waiting_request():
    """Memory is short: the running sequences finish before anyone new is admitted (the scheduler's rule)."""
    sched, bm = make(num_blocks=5, budget=100)
    a, b = add(sched, 8), add(sched, 8, start=50)
    finish_step(sched.schedule())
    bm.allocate("hog", list(range(900, 904)))  # the last free block
    late = add(sched, 3, priority=-1, start=500)  # would go first if anyone were admitted
    out = sched.schedule()
    assert out.preempted == [b] and [s for s, _ in out.scheduled] == [a]
    assert late.status is SequenceStatus.WAITING


def test_priority_orders_admission_and_preemption():
    sched, _ = make(max_seqs=1, budget=100)
    low = add(sched, 4, priority=3)
    high = add(sched, 4, priority=-1, start=20)
    out = sched.schedule()
    assert [s for s, _ in out.scheduled] == [high]
    assert sched.waiting == [low]


def test_finish_frees_blocks():
    sched, bm = make()
    seq = add(sched, 10)
    finish_step(sched.schedule())
    assert bm.num_used_blocks == 3
    sched.finish(seq)
    assert bm.num_used_blocks == 0 and not sched.has_unfinished()


@pytest.mark.parametrize("num_blocks, scheduled", [(3, False), (4, True)])
def test_a_continuation_needs_a_free_block_for_each_sequence(num_blocks, scheduled):
    sched, bm = make(num_blocks=num_blocks)
    a, b = add(sched, 4), add(sched, 4, start=50)
    out = sched.schedule()
    for seq, n in out.scheduled:  # launched: the token of each is being sampled, the next goes into a new block
        seq.num_computed_tokens += n
    free = bm.num_free_blocks
    cont = sched.schedule_continuation([a, b], [a, b])
    if scheduled:
        assert [(s, n) for s, n in cont.scheduled] == [(a, 1), (b, 1)] and bm.num_free_blocks == free - 2
    else:
        assert cont is None and bm.num_free_blocks == free
