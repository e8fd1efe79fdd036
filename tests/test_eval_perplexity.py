"""Perplexity: the window/row logic by hand, and the engine's ppl vs HF transformers' own loss (float32)."""

import math

import pytest
import torch

from eightbit.eval.configs import CONFIGS, EngineScorer, Score, Scorer, resolve_data_dir
from eightbit.eval.peers import HFScorer
from eightbit.eval.perplexity import (evaluate_perplexity, make_windows, perplexity_from_nlls, wikitext_rows,
                                      wikitext_text)


def test_perplexity_from_known_logprobs():
    # two windows: log-probs of their scored tokens, by hand
    w1, w2 = [math.log(0.5), math.log(0.25)], [math.log(0.125)]
    expected = math.exp(-(sum(w1) + sum(w2)) / 3)  # = (0.5 * 0.25 * 0.125) ** (-1/3) = 4
    assert expected == pytest.approx(4.0)
    assert perplexity_from_nlls([-sum(w1), -sum(w2)], [2, 1]) == pytest.approx(4.0)

    class Fixed(Scorer):
        def loglikelihood(self, requests, need_greedy=False, progress=None):
            assert [start for _, start in requests] == [1, 1]
            return [Score(sum(w1), False, 2), Score(sum(w2), False, 1)]

    res = evaluate_perplexity(Fixed(CONFIGS["bf16"]), [[1, 2, 3], [4, 5]], progress=False)
    assert res["ppl"] == pytest.approx(4.0) and res["scored_tokens"] == 3 and res["windows"] == 2


def test_make_windows_non_overlapping_with_tail():
    ids = list(range(10))
    assert make_windows(ids, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert make_windows(list(range(9)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a 1-token tail scores nothing
    assert make_windows(ids, 4, limit=1) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="window must be at least 2 tokens, got 1"):
        make_windows(ids, 1)


def test_wikitext_rows_match_the_datasets_view(tmp_path):
    f = tmp_path / "wiki.test.raw"
    f.write_text(" \n = Title = \n \n Text one . \n")
    assert wikitext_rows(f) == ["", " = Title = \n", "", " Text one . \n"]
    data = resolve_data_dir()
    text = wikitext_text(data)  # the README's numbers for HF's "\n\n".join of the 4,358 rows
    assert len(text) == 1_294_336
    assert len(wikitext_rows(data / "wikitext-2" / "wiki.test.raw")) == 4358


@pytest.fixture(scope="module")
def two_windows(tokenizer):
    ids = tokenizer(wikitext_text(resolve_data_dir())[:4000], add_special_tokens=False).input_ids
    return make_windows(ids, 96, limit=2)


def hf_loss_ppl(hf_model, windows):
    """HF's own perplexity: the model's mean cross-entropy loss per window, token-weighted."""
    nll, n = 0.0, 0
    with torch.no_grad():
        for w in windows:
            ids = torch.tensor([w])
            nll += hf_model(ids, labels=ids).loss.double().item() * (len(w) - 1)
            n += len(w) - 1
    return math.exp(nll / n)


def test_engine_ppl_equals_hf_loss_ppl_fp32(llm, hf_model, two_windows):
    engine = EngineScorer(CONFIGS["fp32"], llm=llm)  # the suite's shared float32 engine (conftest)
    ours = evaluate_perplexity(engine, two_windows, progress=False)
    ref = hf_loss_ppl(hf_model, two_windows)
    assert ours["ppl"] == pytest.approx(ref, rel=1e-4)
    assert ours["scored_tokens"] == sum(len(w) - 1 for w in two_windows)


def test_on_a_cpu_the_progress_moves_every_context_of_tokens(llm, tokenizer):
    """Batches of 16k tokens moved the bar every 8 windows of 2k: 12 minutes on 2 cores without a sign of life."""
    ids = tokenizer(wikitext_text(resolve_data_dir())[:20000], add_special_tokens=False).input_ids
    windows = make_windows(ids, 700, limit=4)
    updates = []

    class Bar:
        def update(self, n):
            updates.append(n)

    engine = EngineScorer(CONFIGS["fp32"], llm=llm)
    assert llm.engine.max_model_len == 2048 and len(windows) == 4
    engine.loglikelihood([(w, 1) for w in windows], progress=Bar())
    assert updates == [2, 2]  # as many 700-token windows as one 2048-token context holds


def test_hf_peer_scorer_equals_hf_loss_ppl(hf_model, two_windows):
    peer = HFScorer(CONFIGS["hf-fp32"], device="cpu", hf_model=hf_model)  # batched, padded path of the peers
    ours = evaluate_perplexity(peer, two_windows, progress=False)
    assert peer.weight_bytes > 0 and peer.kv_bytes_per_token > 0
    assert ours["ppl"] == pytest.approx(hf_loss_ppl(hf_model, two_windows), rel=1e-5)
