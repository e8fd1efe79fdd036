"""Zero-shot tasks scored as lm-evaluation-harness does: ARC-Easy, HellaSwag, LAMBADA (OpenAI).

Every choice is one log-likelihood request: tokens(context) + tokens(continuation), split as
lm-eval's `_encode_pair` does (trailing spaces of the context move to the continuation; the
continuation's ids are those of tokenize(context + continuation) past tokenize(context)).
- ARC-Easy: "Question: {stem}\\nAnswer:" + " " + choice text.
- HellaSwag: lm-eval's `preprocess` of "{activity_label}: {ctx}" and of each ending, " " + ending.
- multiple choice: acc = argmax of the summed log-likelihood; acc_norm = argmax of it divided by
  the choice's length in characters (lm-eval's `len(choice)`, the choice without the leading space;
  bytes and characters agree on ASCII text).
- LAMBADA (lambada_openai): context = all but the last space-separated word, continuation =
  " " + last word; acc = every continuation token is the argmax (greedy match); perplexity =
  exp(-mean per-passage log-likelihood).
"""

from __future__ import annotations

import json
import math
import re
import time

from eightbit.eval.configs import check_finite, data_file

TASK_FILES = {
    "arc_easy": "arc-easy/ARC-Easy-Test.jsonl",
    "hellaswag": "hellaswag/hellaswag_val_full.txt",
    "lambada": "lambada/lambada_test.jsonl",
}
TASKS = tuple(TASK_FILES)


class Item:
    """One question: a context and its continuations (each with the leading delimiter), the gold index.

    `lengths` are what acc_norm divides by (the choice strings without the delimiter)."""

    __slots__ = ("task", "id", "context", "continuations", "lengths", "gold")

    def __init__(self, task, id, context, continuations, gold, lengths=None):
        self.task, self.id, self.context, self.continuations, self.gold = task, id, context, continuations, gold
        self.lengths = lengths if lengths is not None else [len(c) for c in continuations]

    def __repr__(self):
        return f"Item({self.task}:{self.id}, gold={self.gold}, {len(self.continuations)} choices)"


# --- loading --------------------------------------------------------------------------------


def load_arc_easy(path, limit=None) -> list[Item]:
    items = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(items) >= limit:
                break
            doc = json.loads(line)
            q = doc["question"]
            labels = [c["label"] for c in q["choices"]]
            texts = [c["text"] for c in q["choices"]]
            items.append(Item("arc_easy", doc["id"], f"Question: {q['stem']}\nAnswer:", [" " + t for t in texts],
                              labels.index(doc["answerKey"]), [len(t) for t in texts]))
    return items


def hellaswag_preprocess(text: str) -> str:
    """lm-eval's HellaSwag clean-up (brackets are WikiHow artifacts)."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _capitalize_last_fragment(context: str) -> str:
    """lm-eval builds ctx_a + " " + ctx_b.capitalize(); this file holds only ctx, so upper-case the
    first letter of the fragment after the last sentence end when it is lower case (ActivityNet's
    ctx_b: "he", "the lady"...). Exact unless ctx_b held capitals past its first letter."""
    m = re.search(r"(?:[.!?] )([a-z])[^.!?]*$", context)
    if m is None:
        return context
    i = m.start(1)
    return context[:i] + context[i].upper() + context[i + 1 :]


def load_hellaswag(path, limit=None) -> list[Item]:
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    if lines[-1] == "":
        lines.pop()  # the file's last newline
    if len(lines) % 6:
        raise ValueError(f"{len(lines)} lines are not whole items of 6 (context, gold index, 4 endings): "
                         "the file is cut short or shifted")
    items = []
    for k in range(0, len(lines), 6):
        if limit is not None and len(items) >= limit:
            break
        context, gold, *endings = lines[k : k + 6]
        context = hellaswag_preprocess(_capitalize_last_fragment(context))
        endings = [hellaswag_preprocess(e) for e in endings]
        items.append(Item("hellaswag", str(k // 6), context, [" " + e for e in endings], int(gold),
                          [len(e) for e in endings]))
    return items


def load_lambada(path, limit=None) -> list[Item]:
    items = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if limit is not None and len(items) >= limit:
                break
            words = json.loads(line)["text"].split(" ")
            if len(words) < 2:
                raise ValueError(f"line {i + 1}: a passage of one word leaves no context to predict it from")
            items.append(Item("lambada", str(i), " ".join(words[:-1]), [" " + words[-1]], 0))
    return items


LOADERS = {"arc_easy": load_arc_easy, "hellaswag": load_hellaswag, "lambada": load_lambada}


def load_task(task, data_dir, limit=None) -> list[Item]:
    if task not in LOADERS:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    path = data_file(data_dir, TASK_FILES[task])
    try:
        items = LOADERS[task](path, limit)
    except (KeyError, IndexError, TypeError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{path} is not {task} data as eightbit reads it: {type(e).__name__}: {e}") from None
    if not items:
        raise ValueError(f"{path} holds no {task} items")
    for item in items:
        _check_item(item, path)
    return items


def _check_item(item, path):
    """Before any model runs: an empty choice would divide acc_norm by 0 after every configuration had scored it,
    and a gold index out of range would silently count every answer wrong."""
    if not 0 <= item.gold < len(item.continuations):
        raise ValueError(f"{path}: item {item.id} has gold index {item.gold} for {len(item.continuations)} choices")
    empty = [k for k, n in enumerate(item.lengths) if n == 0]
    if empty:
        raise ValueError(f"{path}: item {item.id} has an empty choice (index {empty[0]})")


# --- requests ---------------------------------------------------------------------------------


def encode_pair(tokenizer, context: str, continuation: str):
    """lm-eval's split of context/continuation into token ids. Both are encoded with the tokenizer's own special
    tokens: a BOS in front for tokenizers that add one (Llama 3, Mistral), nothing for SmolLM2's. That is what
    lm-eval's HF backend does since it leaves the BOS to the tokenizer (lm-eval PR #3347); its earlier 0.4 releases
    encoded without special tokens unless add_bos_token=True, so for Llama 3 or Mistral they scored without a BOS."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    if not context:
        raise ValueError("empty context: lm-eval would prepend an end-of-text token; not supported here")
    whole = tokenizer(context + continuation).input_ids
    ctx = tokenizer(context).input_ids
    cont = whole[len(ctx) :]
    if not cont:
        raise ValueError(f"continuation {continuation!r} tokenized to nothing")
    return ctx, cont


def build_requests(items, tokenizer, progress=False) -> list[tuple[list[int], int]]:
    """One (ids, start) request per (item, choice), in item order."""
    from tqdm.auto import tqdm

    requests = []
    task = items[0].task if items else ""
    for item in tqdm(items, desc=f"tokenizing {task}", unit="item", disable=not progress):
        for cont in item.continuations:
            ctx_ids, cont_ids = encode_pair(tokenizer, item.context, cont)
            requests.append((ctx_ids + cont_ids, len(ctx_ids)))
    return requests


# --- metrics ----------------------------------------------------------------------------------


def argmax(values) -> int:
    """First index of the maximum (numpy's tie rule, as lm-eval's np.argmax)."""
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def multiple_choice_outcomes(items, logprobs) -> tuple[list[int], list[int]]:
    """Per-item (acc, acc_norm) 0/1 outcomes from the flat per-choice log-likelihoods."""
    acc, acc_norm, k = [], [], 0
    for item in items:
        n = len(item.continuations)
        lls = logprobs[k : k + n]
        k += n
        acc.append(int(argmax(lls) == item.gold))
        acc_norm.append(int(argmax([ll / length for ll, length in zip(lls, item.lengths)]) == item.gold))
    return acc, acc_norm


def mean_stderr(values) -> tuple[float, float]:
    """Mean and its standard error (sample std / sqrt(n), as lm-eval's mean_stderr)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def paired_difference(a, b) -> dict:
    """mean(a - b) over the same items and its paired standard error."""
    if len(a) != len(b):
        raise ValueError(f"paired outcomes differ in length: {len(a)} vs {len(b)}")
    mean, se = mean_stderr([x - y for x, y in zip(a, b)])
    return {"diff": mean, "stderr": se}


def evaluate_task(scorer, task, items, requests, progress=True) -> dict:
    """Run one task's items (as `build_requests` made them) through `scorer`; metrics plus the per-item outcomes
    (for paired errors)."""
    from tqdm.auto import tqdm

    started = time.perf_counter()
    greedy = task == "lambada"
    with tqdm(total=len(requests), desc=f"{task} {scorer.config.name}", unit="req", disable=not progress) as bar:
        scores = scorer.loglikelihood(requests, need_greedy=greedy, progress=bar)
    check_finite(scores, f"{scorer.config.name} {task}")
    result = {"task": task, "items": len(items), "requests": len(requests),
              "tokens": sum(len(t) for t, _ in requests)}
    if task == "lambada":
        outcomes = [int(s.greedy) for s in scores]
        result["acc"], result["acc_stderr"] = mean_stderr(outcomes)
        result["ppl"] = math.exp(-sum(s.logprob for s in scores) / len(scores))
        result["outcomes"] = {"acc": outcomes}
    else:
        acc, acc_norm = multiple_choice_outcomes(items, [s.logprob for s in scores])
        result["acc"], result["acc_stderr"] = mean_stderr(acc)
        result["acc_norm"], result["acc_norm_stderr"] = mean_stderr(acc_norm)
        result["outcomes"] = {"acc": acc, "acc_norm": acc_norm}
    result["seconds"] = time.perf_counter() - started
    return result
