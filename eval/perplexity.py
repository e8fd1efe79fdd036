"""WikiText-2 perplexity: HF's text join, non-overlapping windows, scored through `prompt_logprobs`.

The text is the `datasets` view of wikitext-2-raw-v1 test ("\\n\\n".join of its `text` rows,
the input of HF's perplexity guide). It is tokenized once (no BOS), cut into consecutive
non-overlapping windows of `window` tokens (the last one shorter), and each window is scored
on its own: every token but the window's first, given the tokens before it in that window.
Perplexity = exp(total NLL / total scored tokens), the token-weighted mean over windows
(what HF's guide computes with stride == max_length; the guide's tokenizer(text) puts a BOS before the
first window where the tokenizer adds one, as Llama 3's does; SmolLM2's adds none).
"""

from __future__ import annotations

import math
import time

from eightbit.eval.configs import check_finite, data_file

WIKITEXT_TEST = "wikitext-2/wiki.test.raw"
DEFAULT_WINDOW = 2048


def wikitext_rows(path) -> list[str]:
    """The rows of HF `datasets` wikitext-2-raw-v1: one per line, "line\\n" or "" for a blank line."""
    with open(path, encoding="utf-8", newline="") as f:
        lines = f.read().replace("\r\n", "\n").split("\n")  # a copy with Windows line ends: the same rows
    if lines and lines[-1] == "":
        lines = lines[:-1]  # the file ends with a newline: no row after it
    return [line + "\n" if line.strip() else "" for line in lines]


def wikitext_text(data_dir) -> str:
    return "\n\n".join(wikitext_rows(data_file(data_dir, WIKITEXT_TEST)))


def make_windows(token_ids, window: int = DEFAULT_WINDOW, limit: int | None = None) -> list[list[int]]:
    """Consecutive non-overlapping windows of `window` tokens; the tail window is kept if it scores anything."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    windows = [list(token_ids[i : i + window]) for i in range(0, len(token_ids), window)]
    windows = [w for w in windows if len(w) >= 2]
    if limit is not None:
        if limit < 1:
            raise ValueError(f"--windows must be >= 1, got {limit}")
        windows = windows[:limit]
    return windows


def perplexity_from_nlls(nll_sums, counts) -> float:
    """exp(sum of NLL / number of scored tokens)."""
    n = sum(counts)
    if n == 0:
        raise ValueError("no scored tokens")
    return math.exp(sum(nll_sums) / n)


def evaluate_perplexity(scorer, windows, progress=True) -> dict:
    """Score `windows` with `scorer`; returns ppl, the totals and the per-window NLL sums."""
    from tqdm.auto import tqdm

    started = time.perf_counter()
    requests = [(w, 1) for w in windows]
    with tqdm(total=len(requests), desc=f"ppl {scorer.config.name}", unit="win", disable=not progress) as bar:
        scores = scorer.loglikelihood(requests, progress=bar)
    check_finite(scores, scorer.config.name)
    nlls = [-s.logprob for s in scores]
    counts = [s.num_tokens for s in scores]
    return {
        "ppl": perplexity_from_nlls(nlls, counts),
        "nll_per_token": sum(nlls) / sum(counts),
        "windows": len(windows),
        "scored_tokens": sum(counts),
        "window_nll": nlls,
        "window_tokens": counts,
        "seconds": time.perf_counter() - started,
    }
