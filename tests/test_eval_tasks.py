"""Task scoring: loaders on the real files, lm-eval's pair encoding, acc/acc_norm vs a direct HF computation
on hand-made items, the LAMBADA greedy-match logic, and the paired standard error."""

import json
import math

import pytest
import torch

from eightbit.eval.configs import CONFIGS, EngineScorer, Score, resolve_data_dir, score_from_prompt_logprobs
from eightbit.eval.perplexity import evaluate_perplexity
from eightbit.eval.peers import score_logits
from eightbit.eval.tasks import (TASK_FILES, Item, argmax, build_requests, encode_pair, evaluate_task,
                                 hellaswag_preprocess, load_task, mean_stderr, multiple_choice_outcomes,
                                 paired_difference)


def test_loaders_read_the_shared_files():
    data = resolve_data_dir()
    arc = load_task("arc_easy", data, limit=3)
    assert arc[0].id == "Mercury_417466" and arc[0].context.startswith("Question: ")
    with open(data / TASK_FILES["arc_easy"]) as f:  # acc_norm divides by lm-eval's len(choice): the raw text's
        raw = [c["text"] for c in json.loads(f.readline())["question"]["choices"]]
    assert arc[0].lengths == [len(t) for t in raw] and arc[0].continuations == [" " + t for t in raw]
    assert arc[0].context.endswith("\nAnswer:") and all(c.startswith(" ") for c in arc[0].continuations)
    full = load_task("arc_easy", data)
    assert len(full) == 2376
    numeric = next(i for i in full if i.id == "NYSEDREGENTS_2015_8_28")  # labels "1".."4", answer key "2"
    assert numeric.gold == 1 and numeric.continuations == [" air", " elements", " water", " soil"]
    assert all(0 <= i.gold < len(i.continuations) == len(i.lengths) for i in full)
    hs = load_task("hellaswag", data, limit=2)
    assert hs[0].context == "Roof shingle removal: A man is sitting on a roof. He"  # lm-eval's ctx_b.capitalize()
    assert hs[0].gold == 3 and hs[0].continuations[3] == " starts pulling up roofing on a roof."
    assert hs[0].lengths[3] == len("starts pulling up roofing on a roof.")
    lam = load_task("lambada", data, limit=2)
    assert len(lam[0].continuations) == 1 and lam[0].continuations[0].startswith(" ")
    assert " " not in lam[0].continuations[0][1:] or "\n" in lam[0].continuations[0]
    assert not lam[0].context.endswith(" ")


@pytest.mark.parametrize("task,path,text", [
    ("lambada", "lambada/lambada_test.jsonl", '{"txt": "a b c"}\n'),  # a KeyError traceback before
    ("arc_easy", "arc-easy/ARC-Easy-Test.jsonl", '{"id": "x", "question": {"stem": "q", "choices": '
     '[{"label": "A", "text": "a"}]}, "answerKey": "E"}\n'),  # "'E' is not in list", no file named
    ("arc_easy", "arc-easy/ARC-Easy-Test.jsonl", "{not json\n"),
    ("hellaswag", "hellaswag/hellaswag_val_full.txt", "ctx\nthree\na\nb\nc\nd\n"),  # a gold label not a number
    # an item cut short was dropped without a word
    ("hellaswag", "hellaswag/hellaswag_val_full.txt", "ctx\n0\na\nb\nc\nd\nctx\n1\na\n"),
    # an empty context, refused only after each model had loaded, naming no item
    ("lambada", "lambada/lambada_test.jsonl", '{"text": "a b"}\n{"text": "word"}\n'),
])
def test_a_malformed_data_file_is_named_in_the_error(tmp_path, task, path, text):
    with pytest.raises(ValueError, match=f"{write_task_file(tmp_path, path, text)} is not {task} data as eightbit "
                                         "reads it"):
        load_task(task, tmp_path)


@pytest.mark.parametrize("task", TASK_FILES)
def test_a_task_file_without_items_is_an_error(tmp_path, task):
    """Every configuration loaded its model, then stopped with a ZeroDivisionError."""
    with pytest.raises(ValueError, match=f"{write_task_file(tmp_path, TASK_FILES[task], '')} holds no {task} items"):
        load_task(task, tmp_path)


@pytest.mark.parametrize("task,path,text,error", [
    ("arc_easy", "arc-easy/ARC-Easy-Test.jsonl", '{"id": "q7", "question": {"stem": "q", "choices": '
     '[{"label": "A", "text": ""}, {"label": "B", "text": "b"}]}, "answerKey": "B"}\n',
     "item q7 has an empty choice"),  # a ZeroDivisionError in acc_norm after every configuration had scored it
    ("hellaswag", "hellaswag/hellaswag_val_full.txt", "ctx. a\n1\na\n[title]\nc\nd\n", "item 0 has an empty choice"),
    ("hellaswag", "hellaswag/hellaswag_val_full.txt", "ctx. a\n4\na\nb\nc\nd\n",
     "item 0 has gold index 4 for 4 choices"),  # counted wrong for every configuration, without a word
    ("hellaswag", "hellaswag/hellaswag_val_full.txt", "ctx. a\n-1\na\nb\nc\nd\n", "item 0 has gold index -1"),
])
def test_an_empty_choice_or_a_gold_index_out_of_range_is_refused_before_any_scoring(tmp_path, task, path, text, error):
    with pytest.raises(ValueError, match=f"{write_task_file(tmp_path, path, text)}: {error}"):
        load_task(task, tmp_path)


def write_task_file(data_dir, path, text):
    (data_dir / path).parent.mkdir(parents=True)
    (data_dir / path).write_text(text)
    return data_dir / path


def test_hellaswag_preprocess_as_lm_eval():
    assert hellaswag_preprocess(" Do it [title] Then [step] go.  Now") == "Do it. Then go. Now"
    # lm-eval strips before removing brackets, so a leading "[header] " leaves its space: kept as lm-eval does
    assert hellaswag_preprocess("[header] How to x [title] Step") == " How to x. Step"


def test_encode_pair_moves_trailing_space(tokenizer):
    ctx, cont = encode_pair(tokenizer, "The capital of France is ", "Paris")
    assert ctx == tokenizer("The capital of France is", add_special_tokens=False).input_ids
    assert ctx + cont == tokenizer("The capital of France is Paris", add_special_tokens=False).input_ids
    with pytest.raises(ValueError, match="empty context"):
        encode_pair(tokenizer, "  ", "Paris")


def test_encode_pair_keeps_the_bos_of_a_tokenizer_that_adds_one(tokenizer):
    """lm-eval 0.4 encodes with the tokenizer's defaults, so a Llama-3-like tokenizer's contexts start with BOS."""
    from eightbit.quant.testing import bos_chat_tokenizer

    bos_tok = bos_chat_tokenizer(tokenizer)
    ctx, cont = encode_pair(bos_tok, "The capital of France is ", "Paris")
    plain_ctx, plain_cont = encode_pair(tokenizer, "The capital of France is ", "Paris")
    assert ctx == [1] + plain_ctx and cont == plain_cont


def test_stderr_and_paired_difference_by_hand():
    mean, se = mean_stderr([1, 0, 1, 1])
    assert mean == 0.75 and se == pytest.approx(math.sqrt((3 * 0.0625 + 0.5625) / 3 / 4))
    d = paired_difference([1, 1, 0, 1], [1, 0, 0, 0])  # differences 0, 1, 0, 1
    assert d["diff"] == 0.5 and d["stderr"] == pytest.approx(math.sqrt(1 / 3 / 4))
    with pytest.raises(ValueError, match="differ in length: 1 vs 2"):
        paired_difference([1], [1, 0])


def test_acc_norm_divides_by_choice_length():
    items = [Item("t", "0", "ctx", [" a", " bbbbbbbbbb"], gold=1, lengths=[1, 10])]
    acc, acc_norm = multiple_choice_outcomes(items, [-2.0, -5.0])  # sum prefers a; per char prefers b
    assert acc == [0] and acc_norm == [1]


def test_greedy_match_from_prompt_logprobs():
    tokens = [5, 7, 9]
    argmax_everywhere = [None, {7: -0.1}, {9: -0.5, 3: -1.5}]
    loses_once = [None, {7: -0.1}, {9: -1.5, 3: -0.5}]
    tie = [None, {7: -0.1}, {9: -0.7, 3: -0.7}]
    assert score_from_prompt_logprobs(tokens, 1, argmax_everywhere, True).greedy
    assert not score_from_prompt_logprobs(tokens, 1, loses_once, True).greedy
    assert score_from_prompt_logprobs(tokens, 1, tie, True).greedy
    s = score_from_prompt_logprobs(tokens, 2, loses_once, True)  # only the last token is the continuation
    assert s.logprob == -1.5 and s.num_tokens == 1 and not s.greedy
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 4.0], [1.0, 1.0, 1.0]])
    assert score_logits(logits, [0, 1, 2], 1, True).greedy
    assert not score_logits(logits, [0, 1, 0], 1, True).greedy


def test_nan_log_likelihoods_are_an_error_not_a_score():
    """NaN compares false: LAMBADA counted every token of a NaN model as greedy (acc 100 %), and the argmax of
    NaN choices was always choice 0, with exit status 0."""
    nan = float("nan")
    assert not score_from_prompt_logprobs([5, 7], 1, [None, {7: nan, 3: -1.0}], True).greedy
    assert not score_from_prompt_logprobs([5, 7], 1, [None, {7: -1.0, 3: nan}], True).greedy

    class NaNScorer:
        config = CONFIGS["bf16"]

        def loglikelihood(self, requests, need_greedy=False, progress=None):
            return [Score(nan if i == 1 else -1.0, need_greedy, 1) for i in range(len(requests))]

    items = [Item("lambada", str(i), "the cat sat on the", [" mat"], 0) for i in range(3)]
    requests = [([1, 2, 3], 2)] * 3
    with pytest.raises(ValueError, match="bf16 lambada: 1 of 3 requests scored a log-likelihood that is NaN"):
        evaluate_task(NaNScorer(), "lambada", items, requests, progress=False)
    with pytest.raises(ValueError, match="bf16: 1 of 2 requests scored a log-likelihood that is NaN"):
        evaluate_perplexity(NaNScorer(), [[1, 2, 3], [4, 5, 6]], progress=False)


HAND_MADE = [  # (context, choices, gold): the model should clearly prefer the gold one
    ("The capital of France is", [" Paris", " a banana sandwich with extra cheese", " purple"], 0),
    ("One, two, three, four,", [" blue", " five", " elephant and tiger"], 1),
    ("Monday, Tuesday, Wednesday,", [" Thursday", " Saturday", " carrots"], 0),
]


def hf_choice_loglikelihoods(hf_model, tokenizer, context, choices):
    out = []
    for c in choices:
        ctx, cont = encode_pair(tokenizer, context, c)
        with torch.no_grad():
            logits = hf_model(torch.tensor([ctx + cont])).logits[0].double()
        lp = torch.log_softmax(logits, -1)
        out.append(sum(lp[len(ctx) - 1 + j, t].item() for j, t in enumerate(cont)))
    return out


@pytest.fixture(scope="module")
def fp32_engine(llm):
    return EngineScorer(CONFIGS["fp32"], llm=llm)  # the suite's shared float32 engine (conftest)


def test_multiple_choice_matches_direct_hf(fp32_engine, hf_model, tokenizer):
    items = [Item("hand", str(i), ctx, ch, gold, [len(c) - 1 for c in ch]) for i, (ctx, ch, gold) in enumerate(HAND_MADE)]
    ours = [s.logprob for s in fp32_engine.loglikelihood(build_requests(items, tokenizer))]
    assert len(ours) == 9
    expected_acc, expected_norm, k = [], [], 0
    for item in items:
        lls = hf_choice_loglikelihoods(hf_model, tokenizer, item.context, item.continuations)
        assert ours[k : k + 3] == pytest.approx(lls, abs=2e-3)
        k += 3
        expected_acc.append(int(max(range(len(lls)), key=lls.__getitem__) == item.gold))
        normed = [ll / n for ll, n in zip(lls, item.lengths)]
        expected_norm.append(int(max(range(len(normed)), key=normed.__getitem__) == item.gold))
    acc, acc_norm = multiple_choice_outcomes(items, ours)
    assert acc == expected_acc and acc_norm == expected_norm
    assert acc == [1, 1, 1]  # the known answer ordering


def test_lambada_greedy_matches_direct_hf(fp32_engine, hf_model, tokenizer):
    items = load_task("lambada", resolve_data_dir(), limit=4)
    res = evaluate_task(fp32_engine, "lambada", items, build_requests(items, tokenizer), progress=False)
    expected, loglikelihoods = [], []
    for (ids, start) in build_requests(items, tokenizer):
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[0]
        expected.append(int(all(logits[j - 1].argmax().item() == ids[j] for j in range(start, len(ids)))))
        logprobs = torch.log_softmax(logits.double(), -1)
        loglikelihoods.append(sum(logprobs[j - 1, ids[j]].item() for j in range(start, len(ids))))
    assert res["outcomes"]["acc"] == expected
    # lm-eval's lambada perplexity: exp of minus the mean per-passage log-likelihood (not per token)
    assert res["ppl"] == pytest.approx(math.exp(-sum(loglikelihoods) / len(loglikelihoods)), rel=1e-4)


def test_hellaswag_preprocess_removes_each_bracket_tag_on_its_own():
    # lm-eval: re.sub("\\[.*?\\]", "", text), non-greedy: the text between two WikiHow tags stays
    assert hellaswag_preprocess("[header] How to stay warm [step] Wear a hat.") == " How to stay warm Wear a hat."


def test_argmax_ties_go_to_the_first_choice_as_numpy():
    assert argmax([-1.0, -1.0, -3.0]) == 0  # np.argmax (lm-eval's) returns the first maximum
    items = [Item("t", "0", "ctx", [" ab", " cd"], gold=0, lengths=[2, 2]),
             Item("t", "1", "ctx", [" ab", " cd"], gold=1, lengths=[2, 2])]
    acc, acc_norm = multiple_choice_outcomes(items, [-2.0, -2.0, -2.0, -2.0])
    assert acc == [1, 0] and acc_norm == [1, 0]


def test_acc_norm_is_loglikelihood_per_character_exactly():
    # lm-eval: acc_norm = argmax(ll / len(choice)). -2.0 / 1 = -2.0 < -3.9 / 2 = -1.95, so choice 1 wins;
    # a length off by one (ll / (len + 1): -1.0 against -1.3) would pick choice 0
    items = [Item("t", "0", "ctx", [" a", " bc"], gold=1, lengths=[1, 2])]
    acc, acc_norm = multiple_choice_outcomes(items, [-2.0, -3.9])
    assert acc == [0] and acc_norm == [1]


def test_encode_pair_takes_the_continuation_from_the_whole_texts_tokens(tokenizer):
    # lm-eval's _encode_pair: continuation = tok(context + continuation)[len(tok(context)):], not tok(continuation)
    # on its own; "apple" + "sauce" merges across the boundary in SmolLM2's BPE
    whole = tokenizer("I like applesauce", add_special_tokens=False).input_ids
    ctx, cont = encode_pair(tokenizer, "I like apple", "sauce")
    assert cont == whole[len(ctx):] and len(ctx) + len(cont) == len(whole)
    assert cont != tokenizer("sauce", add_special_tokens=False).input_ids  # the case is not vacuous


def test_a_continuation_that_merges_into_the_context_is_refused(tokenizer):
    # "The cat" + "s": SmolLM2 encodes "The cats" in as many tokens as "The cat", so nothing would be scored, and a
    # choice of log-likelihood 0 would win every argmax
    assert len(tokenizer("The cats").input_ids) == len(tokenizer("The cat").input_ids)
    with pytest.raises(ValueError, match="tokenized to nothing"):
        encode_pair(tokenizer, "The cat", "s")


def test_lambada_context_keeps_the_passage_text_as_lm_eval(tmp_path):
    # lm-eval's lambada_openai: context = " ".join(text.split(" ")[:-1]), target = " " + text.split(" ")[-1]; the
    # passage's newlines (most LAMBADA passages have them) and double spaces stay in the context
    path = tmp_path / TASK_FILES["lambada"]
    path.parent.mkdir()
    path.write_text(json.dumps({"text": 'he left.\n\n"Go  home," said Ann'}) + "\n")
    [item] = load_task("lambada", tmp_path)
    assert item.context == 'he left.\n\n"Go  home," said' and item.continuations == [" Ann"]


def test_an_infinite_log_likelihood_is_an_error_too():
    # a token whose probability underflows to 0 scores -inf: the ppl would read inf, and a choice of -inf would
    # lose every argmax without a word
    from eightbit.eval.configs import check_finite

    check_finite([Score(-3.0, False, 2)], "bf16")
    with pytest.raises(ValueError, match="bf16: 1 of 2 requests scored a log-likelihood that is NaN or infinite"):
        check_finite([Score(-3.0, False, 2), Score(-math.inf, False, 1)], "bf16")
