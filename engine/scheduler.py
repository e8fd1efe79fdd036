"""Iteration-level continuous batching under a token budget (vLLM v1's rule).

There is no prefill phase and decode phase: every sequence has tokens whose KV is
not computed yet (a whole prompt, the rest of a prompt, or the one token sampled
last step), and each step spends `max_num_batched_tokens` on them, running
sequences first, then waiting ones in priority order. A prompt longer than what
is left of the budget is prefilled in chunks across steps. When the KV cache runs
out of blocks, the lowest-priority (then latest) running sequence is preempted:
its blocks are freed and it restarts from scratch later (recompute).
"""

import bisect
from dataclasses import dataclass, field

from eightbit.engine.sequence import SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list = field(default_factory=list)  # [(Sequence, num_new_tokens)]; the runner orders the batch
    preempted: list = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config, block_manager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting = []  # sorted by Sequence.sort_key
        self.running = []  # sorted by Sequence.sort_key
        self.num_preemptions = 0

    def add(self, seq):
        seq.status = SequenceStatus.WAITING
        self._insert(self.waiting, seq)

    def add_running(self, seq):
        """A sequence forked from a running one (parallel sampling) joins the running set."""
        seq.status = SequenceStatus.RUNNING
        self._insert(self.running, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq):
        """Remove a finished or aborted sequence and free its blocks at once."""
        seq.status = SequenceStatus.FINISHED
        for queue in (self.waiting, self.running):
            if seq in queue:
                queue.remove(seq)
        self.block_manager.free(seq.seq_id)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if not self._reserve(seq, n, out):  # seq itself was preempted: nothing after it can run either
                break
            out.scheduled.append((seq, n))
            budget -= n
            i += 1
        if out.preempted:  # memory is short: let the running ones finish before admitting more
            return out
        seats = self._seats_taken()  # counted once, then kept up to date as sequences are admitted
        while self.waiting and budget > 0 and seats + self._seats(self.waiting[0]) <= self.max_num_seqs:
            seq = self.waiting[0]
            use_cache = seq.request.prompt_logprobs is None  # scoring needs every prompt position's logits
            cached = self.block_manager.allocate(seq.seq_id, seq.token_ids, use_prefix_cache=use_cache)
            if cached is None:
                break
            self.waiting.pop(0)
            seq.num_computed_tokens = cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)  # in this step's batch after every running one; sorted into place below
            seats += self._seats(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            out.scheduled.append((seq, n))
            budget -= n
        self.running.sort(key=lambda s: s.sort_key())
        return out

    def schedule_continuation(self, seqs, stepped) -> SchedulerOutput | None:
        """The next decode step of `seqs` (running sequences whose token is still being sampled on
        the device by the step of `stepped`), to launch before that token reaches the host. None,
        changing nothing that matters, when the regular schedule must decide instead: a running
        sequence sat out that step (the token budget ran out: it must not wait for the whole chain),
        someone is waiting to be admitted (and there is room for them), or one more token each might
        not fit without a preemption. Reserving a block early is harmless: the sequence needs it
        next step anyway."""
        in_step = {id(s) for s in stepped}
        if any(id(s) not in in_step for s in self.running):
            return None
        if self.waiting and self._seats_taken() + self._seats(self.waiting[0]) <= self.max_num_seqs:
            return None
        # one token takes at most one block per sequence (a new one, or a copy of a shared one), so
        # with this many free every reservation below succeeds: all or nothing
        if len(seqs) > self.max_num_batched_tokens or self.block_manager.num_free_blocks < len(seqs):
            return None
        out = SchedulerOutput()
        for seq in seqs:
            if self.block_manager.append_slots(seq.seq_id, seq.num_computed_tokens + 1) is None:
                raise RuntimeError(f"no block for sequence {seq.seq_id}'s next token, though {len(seqs)} were free")
            out.scheduled.append((seq, 1))
        return out

    @staticmethod
    def _seats(seq) -> int:
        """Running sequences `seq` stands for: a request's first sequence stands for all n of its samples until
        they fork (when its prompt is done), so that a request's samples always run together."""
        request = seq.request
        return request.params.n if len(request.seqs) < request.params.n else 1

    def _seats_taken(self) -> int:
        return sum(map(self._seats, self.running))

    @staticmethod
    def _insert(queue, seq):
        bisect.insort(queue, seq, key=lambda s: s.sort_key())

    def _reserve(self, seq, n, out) -> bool:
        """Blocks for seq's next n tokens, preempting from the back of the running list as needed; False if seq
        itself was preempted."""
        while self.block_manager.append_slots(seq.seq_id, seq.num_computed_tokens + n) is None:
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq, out):
        self.running.remove(seq)
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        self.num_preemptions += 1
        out.preempted.append(seq)
        self.add(seq)
