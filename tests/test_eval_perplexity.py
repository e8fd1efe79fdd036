"""Perplexity: the window/row logic by hand, and the engine's ppl vs HF transformers' own loss (float32)."""

import hashlib
import math
from pathlib import Path

import pytest
import torch

from eightbit.eval.configs import (CONFIGS, EngineScorer, Score, Scorer, data_record, resolve_data_dir,
                                   unpublished_note)
from eightbit.eval.peers import HFScorer, score_logits
from eightbit.eval.perplexity import (WIKITEXT_TEST, evaluate_perplexity, make_windows, perplexity_from_nlls,
                                      wikitext_rows, wikitext_text)
from eightbit.eval.tasks import TASK_FILES


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
    crlf = tmp_path / "crlf" / "wikitext-2" / "wiki.test.raw"  # public copies with Windows line ends exist
    crlf.parent.mkdir(parents=True)
    crlf.write_bytes((data / "wikitext-2" / "wiki.test.raw").read_bytes().replace(b"\n", b"\r\n"))
    assert wikitext_text(tmp_path / "crlf") == text  # 2,891 stray "\r" were scored before


def test_results_name_the_data_and_flag_a_copy_that_is_not_the_published_one(tmp_path):
    data = resolve_data_dir()
    records = {t: data_record(data, f) for t, f in [("wikitext", WIKITEXT_TEST), *TASK_FILES.items()]}
    for name, r in records.items():  # the shared files are the published ones (their READMEs give these sums)
        assert r["published"] and Path(r["file"]).is_file() and r["bytes"] == Path(r["file"]).stat().st_size
        assert r["sha256"] == hashlib.sha256(Path(r["file"]).read_bytes()).hexdigest()
    assert unpublished_note(records) == ""
    copy = tmp_path / WIKITEXT_TEST
    copy.parent.mkdir(parents=True)
    copy.write_bytes((data / WIKITEXT_TEST).read_bytes().replace(b"\n", b"\r\n"))
    other = {"wikitext": data_record(tmp_path, WIKITEXT_TEST)}
    assert not other["wikitext"]["published"]
    assert unpublished_note(other).startswith("not the published data: wikitext (wiki.test.raw, sha256 ")


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


def test_hf_peer_scores_come_back_in_request_order(hf_model, tokenizer):
    """The peer scores length-sorted, padded batches: each score must go back to its own request."""
    texts = ["The cat sat on the mat.", "One two", "A much longer sentence about the weather in the mountains today.",
             "Hello there, friend."]
    requests = [(tokenizer(t).input_ids, 1) for t in texts]
    assert len({len(ids) for ids, _ in requests}) == 4
    peer = HFScorer(CONFIGS["hf-fp32"], device="cpu", hf_model=hf_model)
    batched = peer.loglikelihood(requests)
    with torch.no_grad():
        alone = [score_logits(hf_model(torch.tensor([ids])).logits[0], ids, start).logprob for ids, start in requests]
    assert [s.logprob for s in batched] == pytest.approx(alone, abs=1e-3)
    assert [s.num_tokens for s in batched] == [len(ids) - 1 for ids, _ in requests]


def test_hf_peer_scorer_equals_hf_loss_ppl(hf_model, two_windows):
    peer = HFScorer(CONFIGS["hf-fp32"], device="cpu", hf_model=hf_model)  # batched, padded path of the peers
    ours = evaluate_perplexity(peer, two_windows, progress=False)
    assert peer.weight_bytes > 0 and peer.kv_bytes_per_token > 0
    assert ours["ppl"] == pytest.approx(hf_loss_ppl(hf_model, two_windows), rel=1e-5)


def test_make_windows_refuses_a_limit_of_zero():
    with pytest.raises(ValueError, match="--windows must be >= 1, got 0"):
        make_windows(list(range(10)), 4, limit=0)


def test_nll_per_token_is_the_token_weighted_mean():
    # windows of 2 and 1 scored tokens with probabilities (0.5, 0.25) and (0.125): NLL 6 ln 2 over 3 tokens
    class Fixed(Scorer):
        def loglikelihood(self, requests, need_greedy=False, progress=None):
            return [Score(math.log(0.5) + math.log(0.25), False, 2), Score(math.log(0.125), False, 1)]

    res = evaluate_perplexity(Fixed(CONFIGS["bf16"]), [[1, 2, 3], [4, 5]], progress=False)
    assert res["nll_per_token"] == pytest.approx(2 * math.log(2))  # ln 4 = ln ppl, not 6 ln 2 over 2 windows
    assert math.exp(res["nll_per_token"]) == pytest.approx(res["ppl"])


@pytest.mark.parametrize("name,value_bytes", [("hf-fp32", 4), ("hf-bf16", 2)])
def test_hf_peer_kv_bytes_per_token_follow_its_dtype(name, value_bytes):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    scorer = HFScorer(CONFIGS[name], device="cpu", hf_model=LlamaForCausalLM(cfg).eval())
    assert scorer.kv_bytes_per_token == 2 * 3 * 2 * 8 * value_bytes  # K and V, 3 layers, 2 KV heads of 32 / 4 dims
