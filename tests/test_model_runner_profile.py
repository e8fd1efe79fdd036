"""The step the engine profiles its peak memory with: a whole token budget, split into prompts of at most
max_model_len, each in its own KV blocks (a step can batch several prompts, so the budget is what counts)."""

import pytest
import torch

from eightbit import LLM
from eightbit.engine.model_runner import prefill_inputs, profile_prompts


@pytest.mark.parametrize("tokens, max_len, lens", [
    (8192, 2048, [2048] * 4), (5000, 2048, [2048, 2048, 904]), (100, 2048, [100]), (2048, 4096, [2048])])
def test_profile_prompts_cover_the_token_budget(tokens, max_len, lens):
    got, blocks = profile_prompts(tokens, max_len, 16)
    assert got == lens and sum(got) == tokens
    assert blocks == len(lens) * -(-max(lens) // 16)


@torch.inference_mode()
def test_batched_prompts_compute_what_each_computes_alone():
    """prefill_inputs keeps prompts apart (their slots, tables and offsets): two prompts in one eager step give
    each one's hidden states as when run alone."""
    torch.manual_seed(0)
    runner = LLM("llama-tiny", load_format="dummy", device="cpu", dtype="float32", kv_cache_memory_gb=0.01,
                 enforce_eager=True).engine.runner
    page = runner.block_size
    lens = [2 * page + 3, page - 5]
    blocks_per_seq = 3
    ids, positions, context = prefill_inputs(lens, blocks_per_seq, page)
    ids = torch.randint(0, 1024, (sum(lens),))
    both = runner._run_eager(ids, positions, context)
    first = runner._run_eager(ids[:lens[0]], *prefill_inputs(lens[:1], blocks_per_seq, page)[1:])
    torch.testing.assert_close(both[:lens[0]], first)
    # the second prompt alone, in the first prompt's blocks: the batched run must not have read those
    second = runner._run_eager(ids[lens[0]:], *prefill_inputs(lens[1:], blocks_per_seq, page)[1:])
    torch.testing.assert_close(both[lens[0]:], second)
    assert context.slot_mapping.tolist() == list(range(lens[0])) + list(range(3 * page, 3 * page + lens[1]))
