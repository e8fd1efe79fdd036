"""Token sampling and log-probs for one decoding step, batched in plain torch.

Works on CPU and CUDA tensors alike: no per-element Python loops and no host syncs (the
per-row settings go up from pinned memory; the Python loops are over the rows that own a
seeded generator, and in adjust_logits over the entries of the rows that set a bias or a
minimum length).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .sampling_params import SamplingParams
from .transfer import host_tensor_to_device, to_device


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The generator a seeded request owns for its whole life (create it once, not per step)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


@dataclass
class SamplingTensors:
    """The per-row sampling settings of one step as device tensors, plus host-side flags
    that let the common cases (all greedy, no filters) skip work without a sync. An all-greedy
    step needs none of the tensors, so it gets none (each one is a host-to-device copy)."""

    temperatures: torch.Tensor | None  # [B] float32; 1.0 on greedy rows (they are never divided)
    top_k: torch.Tensor | None  # [B] int64; 0 = off
    top_p: torch.Tensor | None  # [B] float32; 1.0 = off
    min_p: torch.Tensor | None  # [B] float32; 0.0 = off
    greedy: torch.Tensor | None  # [B] bool
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu"):
        greedy = [p.greedy for p in params]
        if all(greedy):  # no tensors, and no per-row lists for them either (~0.1 ms a step at 256 rows)
            return cls(temperatures=None, top_k=None, top_p=None, min_p=None, greedy=None, all_greedy=True,
                       any_greedy=bool(greedy), any_top_k=False, any_top_p=False, any_min_p=False)
        # Filters on greedy rows are irrelevant; leaving them off keeps the flags honest.
        top_k = [0 if g or p.top_k < 1 else p.top_k for p, g in zip(params, greedy)]
        top_p = [1.0 if g else float(p.top_p) for p, g in zip(params, greedy)]
        min_p = [0.0 if g else float(p.min_p) for p, g in zip(params, greedy)]
        temps = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        return cls(
            temperatures=to_device(temps, torch.float32, device),
            top_k=to_device(top_k, torch.int64, device),
            top_p=to_device(top_p, torch.float32, device),
            min_p=to_device(min_p, torch.float32, device),
            greedy=to_device(greedy, torch.bool, device),
            all_greedy=False,
            any_greedy=any(greedy),
            any_top_k=any(k > 0 for k in top_k),
            any_top_p=any(p < 1.0 for p in top_p),
            any_min_p=any(p > 0.0 for p in min_p),
        )


def adjust_logits(logits: torch.Tensor, params: Sequence[SamplingParams], token_ids: Sequence[Sequence[int]],
                  num_prompt_tokens: Sequence[int], banned: Sequence[Sequence[int]],
                  in_flight: torch.Tensor | None = None) -> torch.Tensor:
    """The logits [B, V] as each row's SamplingParams change them before sampling, in vLLM's order: its logit_bias
    added, its `banned` tokens (the stop tokens, until min_tokens are out) set to -inf, then its presence,
    frequency and repetition penalties. A new float32 tensor; ``logits`` is left untouched (the log-probs report
    the raw values). token_ids[i] is row i's prompt followed by its output so far (the first num_prompt_tokens[i]
    are the prompt); in_flight ([B] on the device, or None) holds each row's last output token where the host
    has not seen it yet (an async continuation); each row of token_ids may be a list or an int64 CPU tensor (the
    engine passes Sequence.token_tensor(), converted once per token). The penalties' token counts are built from
    those ids each step (O(tokens) tensor work on the host, a [rows, V] tensor on the device), for the rows that
    ask for them only. Nothing here makes the host wait for the GPU: every index and value goes up through
    pinned memory (transfer.py), and constants are written from device tensors (a Python scalar written at
    indices is a pageable copy, which waits)."""
    out, device = logits.float().clone(), logits.device
    rows, ids, values = [], [], []
    for i, p in enumerate(params):
        for t, b in (p.logit_bias or {}).items():
            rows.append(i)
            ids.append(t)
            values.append(b)
    if rows:
        out.index_put_((to_device(rows, torch.int64, device), to_device(ids, torch.int64, device)),
                       to_device(values, torch.float32, device), accumulate=True)
    rows = [i for i, b in enumerate(banned) for _ in b]
    if rows:
        out.index_put_((to_device(rows, torch.int64, device), to_device([t for b in banned for t in b], torch.int64,
                                                                          device)), out.new_full((), float("-inf")))
    if any(p.penalized for p in params):
        _apply_penalties(out, params, token_ids, num_prompt_tokens, in_flight)
    return out


def _apply_penalties(out: torch.Tensor, params, token_ids, num_prompt_tokens, in_flight) -> None:
    """In place on the float32 logits `out`: presence, frequency and repetition penalties (SamplingParams)."""
    rows = [i for i, p in enumerate(params) if p.penalized]
    device, vocab = out.device, out.shape[1]
    histories = [torch.as_tensor(token_ids[i], dtype=torch.int64) for i in rows]  # int64 tensors are not copied
    lengths = torch.tensor([len(h) for h in histories])
    prompts = torch.tensor([num_prompt_tokens[i] for i in rows])
    seen_id = torch.cat(histories)
    seen_row = torch.arange(len(rows)).repeat_interleave(lengths)
    position = torch.arange(len(seen_id)) - (lengths.cumsum(0) - lengths).repeat_interleave(lengths)  # in its row
    is_output = position >= prompts.repeat_interleave(lengths)
    where = (host_tensor_to_device(seen_row, device), host_tensor_to_device(seen_id, device))
    seen = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
    seen.index_put_(where, seen.new_ones(()))
    counts = torch.zeros(len(rows), vocab, dtype=torch.float32, device=device)
    counts.index_put_(where, host_tensor_to_device(is_output.float(), device), accumulate=True)
    index = to_device(rows, torch.int64, device)
    if in_flight is not None:  # one more output token per row, known on the device only
        last = (torch.arange(len(rows), device=device), in_flight.to(device=device, dtype=torch.int64)[index])
        seen.index_put_(last, seen.new_ones(()))
        counts.index_put_(last, counts.new_ones(()), accumulate=True)

    def column(name):
        return to_device([float(getattr(params[i], name)) for i in rows], torch.float32, device).unsqueeze(1)

    x, rep = out[index], column("repetition_penalty")
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - column("frequency_penalty") * counts - column("presence_penalty") * (counts > 0)
    out[index] = x


def filtered_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Temperature-scaled logits with top-k, top-p and min-p applied (dropped tokens = -inf).
    Returns a new tensor; ``logits`` is left untouched (the log-probs need the raw values)."""
    x = logits.float() / t.temperatures.unsqueeze(1)
    if t.any_top_k or t.any_top_p:
        vocab = x.shape[-1]
        sorted_x, order = x.sort(dim=-1, descending=True)
        if t.any_top_k:
            k = torch.where(t.top_k > 0, t.top_k.clamp(max=vocab), vocab)
            # every token tied with the k-th stays, as in vLLM and HF (ties are common in bf16 logits)
            kth = sorted_x.gather(1, (k - 1).unsqueeze(1))
            sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
        if t.any_top_p:
            probs = sorted_x.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
            # Drop a token once the tokens before it already reach top_p; rows with top_p == 1 drop nothing
            # even if float rounding pushes the cumulative sum past 1. The top token always stays, also
            # where a top_p below float32's range (1e-50) reached this tensor as 0.
            drop = (mass_before >= t.top_p.unsqueeze(1)) & (t.top_p < 1.0).unsqueeze(1)
            drop[:, 0] = False
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(1, order, sorted_x)
    if t.any_min_p:
        probs = x.softmax(dim=-1)
        floor = t.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        x = x.masked_fill(probs < floor, float("-inf"))
    return x


def sample(
    logits: torch.Tensor,
    t: SamplingTensors,
    generators: Sequence[torch.Generator | None] | None = None,
    default_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token per row of ``logits`` [B, V]; returns int64 [B] on the logits' device.

    Random rows use the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks token i
    with probability p_i. A row with a generator draws its own E from it, so its token depends
    only on its logits and its generator's state, never on the other rows of the batch. The
    other rows draw from ``default_generator`` (the engine's, seeded by ``EngineConfig.seed``).
    """
    greedy_tokens = logits.argmax(dim=-1)
    if t.all_greedy:
        return greedy_tokens
    probs = filtered_logits(logits, t).softmax(dim=-1)
    generators = list(generators or ())
    race = torch.empty_like(probs)
    if len(generators) < len(race) or any(g is None for g in generators):
        race.exponential_(generator=default_generator)  # one batched draw for the unseeded rows
    for row, g in enumerate(generators):
        if g is not None:
            race[row].exponential_(generator=g)
    # Exp(1) draws of exactly 0 would turn a zero-probability token into 0/0.
    race.clamp_(min=torch.finfo(race.dtype).tiny)
    tokens = probs.div_(race).argmax(dim=-1)
    if t.any_greedy:
        tokens = torch.where(t.greedy, greedy_tokens, tokens)
    return tokens


def gather_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw log-softmax (no temperature or filters, as vLLM reports) of the chosen tokens.

    Returns (chosen [B] float32, top_ids [B, k] int64, top_logprobs [B, k] float32) with the
    top-k in descending order. For prompt log-probs pass the logits of positions 0..T-2 and
    the prompt's tokens 1..T-1 (the first prompt token has none).
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.long().unsqueeze(1)).squeeze(1)
    top_logprobs, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (
        logprobs.new_empty((logits.shape[0], 0)),
        token_ids.new_empty((logits.shape[0], 0), dtype=torch.int64),
    )
    return chosen, top_ids, top_logprobs


def logprobs_to_dicts(
    token_ids: torch.Tensor,
    chosen: torch.Tensor,
    top_ids: torch.Tensor,
    top_logprobs: torch.Tensor,
    ks: Sequence[int],
) -> list[dict[int, float]]:
    """vLLM's per-position dict ``{token_id: logprob}`` for each row: the chosen token first,
    then that row's ``ks[row]`` most likely tokens (so it holds k or k + 1 entries).
    One device-to-host copy per tensor."""
    tokens, chosen, ids, lps = (x.tolist() for x in (token_ids, chosen, top_ids, top_logprobs))
    out = []
    for row, k in enumerate(ks):
        d = {tokens[row]: chosen[row]}
        for tid, lp in zip(ids[row][:k], lps[row][:k]):
            d.setdefault(tid, lp)
        out.append(d)
    return out
