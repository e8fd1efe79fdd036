"""Turns a scheduled step into flat varlen tensors, runs the model and returns logits.

One step = one packed batch with no padding: the new tokens of every scheduled
sequence back to back, their positions, the cache slot of each, the block tables
and the per-sequence offsets. Logits are computed only where they are needed: the
last token of every sequence that samples this step, and, for requests that asked
for prompt log-probs, every prompt position (in chunks, so a long prompt never
materializes its full float32 logits at once).
"""

from dataclasses import dataclass, field

import numpy as np
import torch

from eightbit.engine.context import Context, reset_context, set_context
from eightbit.engine.sampler import SamplingTensors, adjust_logits, gather_logprobs, logprobs_to_dicts, sample
from eightbit.engine.sampling_params import SamplingParams
from eightbit.engine.transfer import host_tensor_to_device, to_device
from eightbit.kernels.checks import v_cache_shape

LOGITS_CHUNK = 256  # prompt positions per lm_head call when scoring
PREFILL_GRAPH_SEQS = 8  # sequences a prefill graph takes
# A step no one graph takes splits into one replay per part (ModelRunner._run_split_graphs); past these it runs
# eagerly: each replay reads the weights again, and a step of many tokens is bound by the GPU, not the host
MAX_PREFILL_REPLAYS = 4
MAX_SPLIT_TOKENS = 2048


@dataclass
class StepResult:
    sample_seqs: list  # sequences that sample a token this step, in row order of `logits`
    logits: torch.Tensor | None  # [len(sample_seqs), vocab] float32
    prompt_logprobs: dict = field(default_factory=dict)  # seq -> [(prompt index, {token: logprob})]


class KVCache:
    """All layers' paged K/V (and int8 group scales), one tensor per kind."""

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, group_size, device):
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        alloc = torch.zeros if torch.device(device).type != "cpu" else torch.empty  # untouched CPU pages cost nothing
        self.k = alloc(shape, dtype=dtype, device=device)
        # an int8 V cache is stored key-minor (kernels/reference.py)
        self.v = alloc((num_layers,) + v_cache_shape(*shape[1:], dtype), dtype=dtype, device=device)
        self.k_scale = self.v_scale = None
        if dtype == torch.int8:
            scale_shape = shape[:-1] + (head_dim // group_size,)
            self.k_scale = alloc(scale_shape, dtype=torch.float16, device=device)
            self.v_scale = alloc(scale_shape, dtype=torch.float16, device=device)

    def tensors(self):
        """K, V and (int8) their scales: every tensor the cache holds."""
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def layer(self, i):
        scales = (None, None) if self.k_scale is None else (self.k_scale[i], self.v_scale[i])
        return self.k[i], self.v[i], *scales

    @torch.inference_mode()  # the cache may be an inference tensor (an engine built under inference_mode)
    def copy_blocks(self, copies):
        """Copy-on-write: duplicate whole blocks (all layers) before a shared block is written."""
        src = to_device([s for s, _ in copies], torch.int64, self.k.device)
        dst = to_device([d for _, d in copies], torch.int64, self.k.device)
        for t in self.tensors():
            t[:, dst] = t[:, src]


def kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype, group_size=None) -> float:
    """K and V of one token in every layer, int8 group scales (float16) included."""
    per_value = 1 + 2 / group_size if dtype == torch.int8 else torch.finfo(dtype).bits / 8
    return 2 * num_layers * num_kv_heads * head_dim * per_value


def profile_prompts(num_tokens, max_model_len, block_size):
    """(prompt lengths, KV blocks) of the profiled step: num_tokens split into prompts of at most max_model_len,
    each with as many blocks as the longest needs."""
    lens = [max_model_len] * (num_tokens // max_model_len) + [num_tokens % max_model_len] * bool(
        num_tokens % max_model_len)
    return lens, -(-max(lens) // block_size) * len(lens)


def prefill_inputs(lens, blocks_per_seq, block_size):
    """(input ids, positions, Context) of whole prompts of these lengths, each in its own blocks_per_seq blocks."""
    positions = torch.cat([torch.arange(length) for length in lens])
    first_slot = torch.arange(len(lens)) * blocks_per_seq * block_size
    context = Context(
        slot_mapping=first_slot.repeat_interleave(torch.tensor(lens)) + positions,
        block_tables=torch.arange(len(lens) * blocks_per_seq, dtype=torch.int32).view(len(lens), blocks_per_seq),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0] + lens).cumsum(0).to(torch.int32))
    return torch.zeros(len(positions), dtype=torch.int64), positions, context


def pack_sequences(cu, max_seqs, max_tokens):
    """Sequences with token offsets cu, in order, as the fewest runs (greedy) of at most max_seqs sequences and
    max_tokens tokens each: [(first, end)] (sequences first..end-1); None if one alone has more than max_tokens."""
    runs, first = [], 0
    for end in range(1, len(cu)):
        if cu[end] - cu[end - 1] > max_tokens:
            return None
        if end - first > max_seqs or cu[end] - cu[first] > max_tokens:
            runs.append((first, end - 1))
            first = end - 1
    return runs + [(first, len(cu) - 1)]


class ModelRunner:
    def __init__(self, model, block_size, device):
        self.model = model
        self.block_manager = None  # set by the engine once the cache size is known
        self.block_size = block_size
        self.device = torch.device(device)
        self.kv_cache = None
        self.decode_graphs = self.prefill_graphs = None  # CUDA graphs once captured (CUDA only)

    def capture_graphs(self, max_batch, max_model_len, max_prefill_tokens):
        """Decode graphs for batches up to max_batch; prefill graphs for up to PREFILL_GRAPH_SEQS sequences of up
        to max_prefill_tokens new tokens in all (none if that is below the smallest bucket)."""
        from eightbit.engine.cuda_graphs import DecodeGraphs, PrefillGraphs, token_buckets

        shape = (-(-max_model_len // self.block_size), self.model.config.hidden_size,
                 self.model.model.embed_tokens.weight.dtype, self.device)
        self.decode_graphs = DecodeGraphs(self.model, max_batch, *shape)
        pool = self.decode_graphs.capture()
        if token_buckets(max_prefill_tokens):
            self.prefill_graphs = PrefillGraphs(self.model, max_prefill_tokens, PREFILL_GRAPH_SEQS, *shape)
            self.prefill_graphs.capture(pool)

    @torch.inference_mode()
    def compile_gemms(self, max_tokens):
        """Launch every int8 linear's GEMM once per kernel variant it can meet up to max_tokens rows, on zeros.

        Triton compiles a variant (a config, and its specializations of M), or loads it from its disk cache, the
        first time a step needs it. Decode and prefill graphs meet theirs at capture; eager steps of
        other sizes did not, and a served Llama-3.2-1B compiled 14 variants at its first such steps, 0.4-1 s each
        (docs/benchmarks.md, thirtieth session). Run before the KV cache is allocated: the largest output is as
        big as that of the profiled step."""
        from eightbit.engine.layers.linear import Linear
        from eightbit.kernels import ops

        ops.require_gpu_triton()  # before int8_gemm's import, which an older Triton fails
        from eightbit.kernels.int8_gemm import variant_sizes

        layers = {(m.out_features, m.in_features, m.bias is None, m.out_dtype): m for m in self.model.modules()
                  if isinstance(m, Linear) and m.quantized}
        for layer in layers.values():
            for m in variant_sizes(layer.out_features, layer.in_features, max_tokens, self.device):
                x = torch.zeros(m, layer.in_features, dtype=torch.int8, device=self.device)
                ops.int8_gemm(x, torch.ones(m, 1, device=self.device), layer.weight, layer.weight_scale, layer.bias,
                              layer.out_dtype)
        torch.cuda.synchronize()

    def allocate_kv_cache(self, num_blocks, dtype, group_size=None):
        attn = self.model.attention_layers()
        a = attn[0]
        self.kv_cache = KVCache(len(attn), num_blocks, self.block_size, a.num_kv_heads, a.head_dim, dtype,
                                group_size, self.device)
        for i, layer in enumerate(attn):
            layer.k_cache, layer.v_cache, layer.k_scale, layer.v_scale = self.kv_cache.layer(i)

    @torch.inference_mode()
    def run(self, scheduled, input_tokens=None) -> StepResult:
        """Run one step (the engine has done its copy-on-write copies). input_tokens: a continuation step's input
        ids, still on the device (each sequence's token sampled by the step before, not yet appended to its
        token_ids)."""
        scheduled = sorted(scheduled, key=lambda item: item[1] != 1)  # one-token sequences first (stable)
        input_ids, positions, context, sample_rows, sample_seqs = self._prepare(scheduled, input_tokens)
        # logits: those of the first len(logits) rows where a decode graph made them, else None
        hidden, logits = (self._run_graph(input_ids, positions, context)
                          or self._run_split_graphs(input_ids, positions, context)
                          or (self._run_eager(input_ids, positions, context), None))
        logits = self._sample_logits(hidden, logits, sample_rows) if sample_seqs else None
        # a continuation (input_tokens given) runs past every prompt: no prompt position to score
        prompt_logprobs = {} if input_tokens is not None else self._prompt_logprobs(scheduled, hidden)
        return StepResult(sample_seqs, logits, prompt_logprobs)

    def _run_graph(self, input_ids, positions, context):
        """Replay a captured graph if one fits the step: (hidden states, logits of every row or None); None if the
        step must run eagerly."""
        graphs = self.decode_graphs if context.is_decode else self.prefill_graphs
        if graphs is None or not graphs.fits(len(input_ids), context):
            return None
        return graphs.run(input_ids, positions, context)

    def _run_split_graphs(self, input_ids, positions, context):
        """A step no one graph takes (one-token sequences beside prefill sequences, or more prefill sequences or
        tokens than one prefill graph holds) as one replay of the decode graph for the one-token sequences and one of
        the prefill graph per run of prefill sequences it holds: (hidden states of every row, logits of the
        one-token rows or None), or None if a sequence fits no graph or the step needs more than
        MAX_PREFILL_REPLAYS prefill replays or has more than MAX_SPLIT_TOKENS prefill tokens.

        Run eagerly, such a step costs about 1 ms of host time a layer; each replay reads the weights once more,
        a fraction of that for short prompts (~3.5 ms for Llama-3-8B on an H200). There (docs/benchmarks/engine.md,
        runs 81-82) steps within the limits ran 1.8-25x faster than eagerly; one prompt a replay, 8 replays of short
        prompts broke even on Llama-3-8B, and 4-8 replays of 4,096 tokens in all ran up to 1.35x slower. Each graph
        writes its own static buffers, so a part's hidden states are copied out before the next replay."""
        nd, n = context.num_decodes, len(input_ids)
        if (self.prefill_graphs is None or nd == len(context.seq_lens) or n - nd > MAX_SPLIT_TOKENS
                or (nd and self.decode_graphs is None)):
            return None
        cu = context.cu_seqlens_q.tolist()
        runs = pack_sequences(cu, self.prefill_graphs.max_seqs, self.prefill_graphs.buckets[-1])
        if runs is None or len(runs) > MAX_PREFILL_REPLAYS:
            return None
        (tables_d, lens_d), (tables_p, lens_p) = context.decode_part, context.prefill_part
        parts = []  # (graphs, rows, context) of each replay
        if nd:
            parts.append((self.decode_graphs, slice(0, nd), Context(
                slot_mapping=context.slot_mapping[:nd], block_tables=tables_d, seq_lens=lens_d,
                cu_seqlens_q=torch.zeros(1, dtype=torch.int32), num_decodes=nd, prefill_width=0)))
        for a, b in runs:  # prefill sequences a..b-1
            rows = slice(nd + cu[a], nd + cu[b])
            parts.append((self.prefill_graphs, rows, Context(
                slot_mapping=context.slot_mapping[rows], block_tables=tables_p[a:b], seq_lens=lens_p[a:b],
                cu_seqlens_q=torch.tensor(cu[a : b + 1], dtype=torch.int32) - cu[a], num_decodes=0,
                prefill_width=tables_p.shape[1])))
        if not all(graphs.fits(rows.stop - rows.start, part) for graphs, rows, part in parts):
            return None
        hidden = logits = None
        for graphs, rows, part in parts:
            h, part_logits = graphs.run(input_ids[rows], positions[rows], part)
            if hidden is None:  # the first part: the decode graph's logits, if the step has one-token sequences
                hidden, logits = h.new_empty(n, h.shape[1]), part_logits
            hidden[rows] = h
        return hidden, logits

    def _sample_logits(self, hidden, logits, sample_rows):
        """float32 logits of the rows that sample (sample_rows, ascending); logits: those a graph made for the first
        len(logits) rows, or None. Only rows without them go through the lm_head."""
        n, have = len(hidden), 0 if logits is None else len(logits)
        if len(sample_rows) == n == have:  # every row samples and the graph has them all (decode): no copy
            return logits
        if len(sample_rows) == n and have == 0:
            return self.model.compute_logits(hidden)
        rows = host_tensor_to_device(sample_rows, self.device)
        k = int(np.searchsorted(sample_rows.numpy(), have))  # sampled rows the graph's logits cover
        if k == len(sample_rows):
            return logits[rows]
        rest = self.model.compute_logits(hidden[rows[k:]])
        if k == 0:
            return rest
        return torch.cat([logits if k == have else logits[rows[:k]], rest])

    def _run_eager(self, input_ids, positions, context):
        dev = self.device
        context = Context(*(host_tensor_to_device(t, dev) for t in (
            context.slot_mapping, context.block_tables, context.seq_lens, context.cu_seqlens_q)),
            num_decodes=context.num_decodes, prefill_width=context.prefill_width)
        set_context(context)
        try:
            return self.model(host_tensor_to_device(input_ids, dev), host_tensor_to_device(positions, dev))
        finally:
            reset_context()

    @torch.inference_mode()
    def profile_peak_memory(self, num_tokens, num_logit_rows, max_model_len, kv_dtype, kv_group_size) -> int:
        """Peak CUDA memory of the biggest step (a full token budget of prefill, plus logits adjusted by penalties and
        sampled with every filter on and log-probs: top-p's sort takes several times the logits' bytes), in bytes.

        The budget is split into prompts of at most max_model_len tokens: a step can batch several, so a
        max_model_len below the budget does not make the step smaller. Runs with a temporary KV cache of the
        engine's kind, just large enough; the cache's own bytes are not counted. Being a long prefill, it also
        compiles the long-prompt attention kernels here rather than at the first long prompt.
        """
        lens, blocks = profile_prompts(num_tokens, max_model_len, self.block_size)
        self.allocate_kv_cache(blocks, kv_dtype, kv_group_size)
        cache_bytes = self.kv_cache.nbytes()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        hidden = self._run_eager(*prefill_inputs(lens, blocks // len(lens), self.block_size))
        rows = min(num_logit_rows, num_tokens)
        logits = self.model.compute_logits(hidden[:rows])
        worst = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, logprobs=20, presence_penalty=0.5,
                               frequency_penalty=0.5, repetition_penalty=1.1, logit_bias={0: 1.0})
        adjusted = adjust_logits(logits, [worst] * rows, [[0, 1]] * rows, [1] * rows, [()] * rows)
        tokens = sample(adjusted, SamplingTensors.from_params([worst] * rows, logits.device))
        gather_logprobs(logits, tokens, worst.logprobs)
        del logits, adjusted, tokens
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - cache_bytes
        del hidden
        self.kv_cache = None
        for layer in self.model.attention_layers():
            layer.k_cache = layer.v_cache = layer.k_scale = layer.v_scale = None
        torch.cuda.empty_cache()
        return peak

    def _prepare(self, scheduled, input_tokens=None):
        """The step's inputs as host tensors (numpy arithmetic over the batch: a decode step of B sequences builds
        them in tens of microseconds; per-sequence Python lists of ints cost ~10x that at B = 256).

        scheduled: (sequence, new tokens) with the one-token sequences first, as run() sorts them (the context's
        decode part is its first num_decodes rows)."""
        bs = self.block_size
        seqs = [seq for seq, _ in scheduled]
        tables, table_lens = self.block_manager.block_tables([seq.seq_id for seq in seqs])
        counts = np.fromiter((n for _, n in scheduled), np.int64, len(seqs))
        starts = np.fromiter((seq.num_computed_tokens for seq in seqs), np.int64, len(seqs))
        ends = starts + counts
        cu = np.zeros(len(seqs) + 1, np.int64)
        np.cumsum(counts, out=cu[1:])
        row = np.repeat(np.arange(len(seqs)), counts)  # each new token's sequence
        positions = np.arange(cu[-1]) - cu[row] + starts[row]
        slots = tables[row, positions // bs].astype(np.int64) * bs + positions % bs
        if input_tokens is None:
            input_ids = [t for seq, n in scheduled
                         for t in seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + n]]
            samples = ends == np.fromiter((seq.num_tokens for seq in seqs), np.int64, len(seqs))
        else:  # a continuation: every sequence samples
            samples = np.ones(len(seqs), bool)
        nd = int(np.count_nonzero(counts == 1))
        if not (counts[:nd] == 1).all():
            raise ValueError("_prepare needs the one-token sequences first (run() sorts them)")
        # Built on the host; moved to the device by _run_eager or copied into the graphs' buffers.
        context = Context(
            slot_mapping=torch.from_numpy(slots),
            block_tables=torch.from_numpy(tables),
            seq_lens=torch.from_numpy(ends.astype(np.int32)),
            cu_seqlens_q=torch.from_numpy((cu[nd:] - cu[nd]).astype(np.int32)),
            num_decodes=nd,
            prefill_width=max(table_lens[nd:], default=0),
        )
        ids = torch.tensor(input_ids, dtype=torch.int64) if input_tokens is None else input_tokens
        sample_rows = torch.from_numpy(cu[1:][samples] - 1)
        return ids, torch.from_numpy(positions), context, sample_rows, [s for s, k in zip(seqs, samples) if k]

    def _prompt_logprobs(self, scheduled, hidden):
        """Log-probs of each prompt token given the ones before it, for the requests that asked."""
        result = {}
        offset = 0
        for seq, n in scheduled:
            k = seq.request.params.prompt_logprobs
            start = seq.num_computed_tokens
            # hidden row p predicts token p + 1; only prompt tokens 1.. are scored
            last = min(start + n, seq.num_prompt_tokens - 1)
            if k is not None and seq.index == 0 and start < last:
                entries = []
                for c in range(start, last, LOGITS_CHUNK):
                    ce = min(c + LOGITS_CHUNK, last)
                    logits = self.model.compute_logits(hidden[offset + c - start : offset + ce - start])
                    targets = to_device(seq.token_ids[c + 1 : ce + 1], torch.int64, logits.device)
                    chosen, top_ids, top_lps = gather_logprobs(logits, targets, k)
                    dicts = logprobs_to_dicts(targets, chosen, top_ids, top_lps, [k] * len(targets))
                    entries += [(c + 1 + i, d) for i, d in enumerate(dicts)]
                result[seq] = entries
            offset += n
        return result
