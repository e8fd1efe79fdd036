"""`eightbit eval ppl` and `eightbit eval tasks`: every named configuration in one invocation.

Wire into the top-level CLI with `add_eval_parser(subparsers)`. Results go to --out
(ppl.json / ppl.md / ppl.png, tasks.json / tasks.md / tasks.png); the JSON is rewritten after
every configuration, so an interrupted run keeps what it finished.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import shlex
import sys
import time
import traceback
from pathlib import Path

DEFAULT_OUT = "eval-results"


def add_eval_parser(subparsers):
    p = subparsers.add_parser("eval", help="perplexity and zero-shot tasks of eightbit configurations vs HF peers")
    sub = p.add_subparsers(dest="eval_command", required=True)

    def common(q):
        q.add_argument("--configs", default="default",
                       help="comma list of configurations and groups (default, engine, peers, kv-sweep, parity); "
                            "see eightbit.eval.configs.CONFIGS")
        q.add_argument("--model", default=None, help="float checkpoint (default: the embedded SmolLM2-135M-Instruct)")
        q.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
        q.add_argument("--data-dir", default=None, help="eval data (default: $EIGHTBIT_DATA, else ../shared/data beside the source tree, which only "
                            "an editable install has)")
        q.add_argument("--sq-checkpoint", default=None,
                       help="SmoothQuant W8A8 checkpoint for the w8a8-sq configs; made with `eightbit quantize` "
                            "if it does not exist (default: $EIGHTBIT_SQ_CHECKPOINT, else eval/... in eightbit's cache folder: "
                            "$EIGHTBIT_CACHE or ~/.cache/eightbit; with EIGHTBIT_CACHE=off a temporary folder)")
        q.add_argument("--kv-cache-memory-gb", type=float, default=2.0, help="engine KV-cache size (default: 2.0)")
        q.add_argument("--out", default=DEFAULT_OUT,
                       help=f"folder for the JSON, markdown table and PNG chart (default: ./{DEFAULT_OUT})")
        q.add_argument("--no-progress", action="store_true", help="no progress bars")
        q.add_argument("--overwrite", action="store_true", help="replace an earlier run's results in --out")
        q.set_defaults(interrupt_note=_interrupt_note)

    q = sub.add_parser("ppl", help="WikiText-2 (raw, test) perplexity over non-overlapping windows")
    common(q)
    q.add_argument("--windows", "--limit", dest="windows", type=int, default=None,
                   help="score only the first N windows (default: all)")
    q.add_argument("--window-size", type=int, default=2048, help="tokens per window (capped at the model's max)")
    q.set_defaults(func=run_ppl)

    q = sub.add_parser("tasks", help="ARC-Easy, HellaSwag, LAMBADA (lm-eval-style log-likelihood scoring)")
    common(q)
    q.add_argument("--tasks", default="arc_easy,hellaswag,lambada",
                   help="comma list of arc_easy, hellaswag, lambada (default: all three)")
    q.add_argument("--limit", type=int, default=None,
                   help="first N items of each task, in the file's order (HellaSwag's 3,243 ActivityNet items come "
                        "before its WikiHow ones; default: all)")
    q.add_argument("--max-model-len", type=int, default=2048, help="engine context (the longest item must fit)")
    q.set_defaults(func=run_tasks)
    return p


def _interrupt_note(args) -> str:
    """What Ctrl-C leaves: the results are rewritten after every configuration (ppl) or task (tasks)."""
    if getattr(args, "results_written", False):
        return f"what finished before it is in {args.out}"
    return f"nothing had finished: nothing was written to {args.out}"


def _meta(args, extra) -> dict:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    machine = " ".join(filter(None, (platform.machine(), platform.processor(), f"{os.cpu_count()} CPU cores")))
    if device.startswith("cuda") and torch.cuda.is_available():
        machine += f", {torch.cuda.get_device_name(torch.device(device))}"
    return {
        "command": shlex.join(["eightbit", *getattr(args, "argv", ())]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "device": device,
        "torch": torch.__version__,
        **extra,
    }


def _scorers(args, configs, max_model_len, data_dir):
    """Yield (config, scorer or error string), building one model at a time and freeing it after use."""
    from eightbit.eval.configs import build_scorer, default_sq_checkpoint_dir, ensure_sq_checkpoint
    from eightbit.eval.peers import PeerNotRunnable

    sq = None
    if any(c.weights == "smoothquant" for c in configs):
        sq = ensure_sq_checkpoint(args.sq_checkpoint or default_sq_checkpoint_dir(args.model), args.model,
                                  progress=not args.no_progress, data_dir=data_dir)
    for config in configs:
        started = time.perf_counter()
        try:
            scorer = build_scorer(config, model=args.model, device=args.device, sq_checkpoint=sq,
                                  kv_cache_memory_gb=args.kv_cache_memory_gb, max_model_len=max_model_len)
        except PeerNotRunnable as e:
            print(f"[eval] {config.name}: not runnable here: {e}", flush=True)
            yield config, f"not runnable here: {e}", 0.0
            continue
        except Exception as e:
            traceback.print_exc()
            yield config, f"failed to load: {type(e).__name__}: {e}", 0.0
            continue
        yield config, scorer, time.perf_counter() - started
        scorer.close()
        del scorer


def _row(config, scorer, load_seconds) -> dict:
    return {"config": config.name, "backend": config.backend, "baseline": config.baseline,
            "description": config.description, "weight_bytes": scorer.weight_bytes,
            "kv_bytes_per_token": scorer.kv_bytes_per_token, "load_seconds": load_seconds, **scorer.info}


def _error_row(config, error) -> dict:
    return {"config": config.name, "backend": config.backend, "baseline": config.baseline,
            "description": config.description, "error": error}


def _check_args(args, stem, positive):
    """Fail before any loading: numbers out of range, or an earlier run's results that this run would replace."""
    for name in positive:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not (math.isfinite(args.kv_cache_memory_gb) and args.kv_cache_memory_gb > 0):
        raise ValueError(f"--kv-cache-memory-gb must be > 0, got {args.kv_cache_memory_gb}")
    if args.device is not None:
        _check_device(args.device)
    out = Path(args.out).absolute()
    nearest = next(p for p in (out, *out.parents) if p.exists())  # the folder it is (or will be) made in
    if not nearest.is_dir():
        raise ValueError(f"--out {args.out}: {nearest} is a file, not a folder: the results would be lost after "
                         f"the run")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise ValueError(f"--out {args.out}: {nearest} is not writable: the results would be lost after the run")
    taken = [p.name for p in (Path(args.out) / f"{stem}{ext}" for ext in (".json", ".md", ".png")) if p.exists()]
    if taken and not args.overwrite:
        raise ValueError(f"{args.out} already holds an earlier run's results ({', '.join(taken)}): "
                         f"pass --overwrite to replace them, or another --out")


def _check_device(device):
    from eightbit.engine.config import checked_device

    try:
        checked_device(device)
    except ValueError as e:
        raise ValueError(f"--device {device}: {e}") from None


def _model_context(model) -> int:
    """The longest sequence the model runs (its config only: the weights load per configuration)."""
    from eightbit.engine.models.llama import context_limit
    from eightbit.engine.weights import open_checkpoint

    return context_limit(open_checkpoint(model).config)


def _quiet_transformers(args) -> None:
    """--no-progress silences transformers' own bars too (its weight loading and GGUF conversion have them)."""
    if args.no_progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def run_ppl(args) -> int:
    from eightbit.eval import report
    from eightbit.eval.configs import (check_float_model, data_record, load_tokenizer, parse_configs,
                                       resolve_data_dir, unpublished_note)
    from eightbit.eval.perplexity import WIKITEXT_TEST, evaluate_perplexity, make_windows, wikitext_text

    if args.window_size < 2:
        raise ValueError(f"--window-size must be >= 2 (a window's first token is context only), got {args.window_size}")
    _check_args(args, "ppl", ("windows",))
    _quiet_transformers(args)
    configs = parse_configs(args.configs)
    check_float_model(args.model)
    data_dir = resolve_data_dir(args.data_dir)
    data = {"wikitext": data_record(data_dir, WIKITEXT_TEST)}
    data_note = _print_note(unpublished_note(data))
    text = wikitext_text(data_dir)
    tokenizer = load_tokenizer(args.model)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    max_pos = _model_context(args.model)
    window = min(args.window_size, max_pos - 1)
    windows = make_windows(ids, window, args.windows)
    total_windows = len(make_windows(ids, window))
    if not windows:
        raise ValueError(f"the WikiText-2 test text in {data_dir} has {len(ids)} tokens: not one window of {window}")
    print(f"[eval] WikiText-2 test: {len(ids):,} tokens, {len(windows)} of {total_windows} windows of {window}",
          flush=True)
    out = Path(args.out)
    meta = _meta(args, {"dataset": "wikitext-2-raw-v1 test", "data": data, "data_note": data_note,
                        "tokens": len(ids), "window": window, "windows": len(windows),
                        "total_windows": total_windows})
    rows = []
    max_model_len = min(max_pos, -(-(window + 1) // 16) * 16)  # room for the window + the 1 sampled token
    for config, scorer, load_s in _scorers(args, configs, max_model_len, data_dir):
        if isinstance(scorer, str):
            rows.append(_error_row(config, scorer))
        else:
            try:
                row = _row(config, scorer, load_s)
                row.update(evaluate_perplexity(scorer, windows, progress=not args.no_progress))
                print(f"[eval] {config.name}: ppl {row['ppl']:.4f} ({row['seconds']:.0f} s)", flush=True)
                rows.append(row)
            except Exception as e:
                traceback.print_exc()
                rows.append(_error_row(config, f"{type(e).__name__}: {e}"))
        header, table = _ppl_header(meta, rows), report.ppl_table(rows)
        chart = _write_results(args, "ppl", meta, rows, header, table, report.ppl_chart)
    print("\n" + header + "\n\n" + table)
    print(f"\n[eval] wrote {out / 'ppl.json'}, {out / 'ppl.md'}" + (f", {chart}" if chart else ""))
    return 0 if all("error" not in r for r in rows) else 1


def _write_results(args, stem, meta, rows, header, table, draw, *extra):
    """JSON, markdown table and chart of the rows so far, rewritten together after every configuration in args.out:
    each is written beside its final name first (the chart takes seconds: matplotlib), then the three replace the
    old ones with Ctrl-C held back, so an interrupted run leaves them agreeing (not a new JSON beside an earlier
    run's chart) and args.results_written saying whether they are there. Returns the chart, or None where no row
    has a result to draw: an earlier run's chart is then removed, not left beside this run's tables."""
    from eightbit.eval import report
    from eightbit.engine.signals import signals_deferred

    out = Path(args.out)
    final = {ext: out / f"{stem}.{ext}" for ext in ("json", "md", "png")}
    staged = {ext: out / f"{stem}.partial.{ext}" for ext in final}
    try:
        report.write_json(staged["json"], {"meta": meta, "rows": rows})
        staged["md"].write_text(header + "\n\n" + table + "\n")
        chart = draw(rows, *extra, staged["png"])
        with signals_deferred():
            for ext in ("json", "md", "png") if chart is not None else ("json", "md"):
                staged[ext].replace(final[ext])
            if chart is None:
                final["png"].unlink(missing_ok=True)
            args.results_written = True
    finally:
        for path in (*staged.values(), report.temp_path(staged["json"])):
            path.unlink(missing_ok=True)
    return None if chart is None else final["png"]


def _ppl_header(meta, rows) -> str:
    return (f"WikiText-2 raw test, {meta['windows']}/{meta['total_windows']} windows of {meta['window']} tokens "
            f"({next((r['scored_tokens'] for r in rows if 'scored_tokens' in r), 0):,} scored tokens), "
            f"{meta['machine']}, {meta['date']}" + _note(meta))


def _note(meta) -> str:
    return f" ({meta['data_note']})" if meta.get("data_note") else ""


def _print_note(note) -> str:
    """Say, before any scoring, when the data is not the published copy; returns the note for the results."""
    if note:
        print(f"[eval] note: {note}; its numbers are not comparable with results on the published files", flush=True)
    return note


def _check_requests_fit(requests, max_model_len, max_pos, configs):
    """Before any model loads: an engine configuration scores a request in one sequence of max_model_len tokens,
    with room for the one token it samples (EngineScorer.loglikelihood), so a longer one would fail every
    configuration's task only after its model had loaded."""
    if not any(c.backend == "engine" for c in configs):
        return
    longest = {t: max((len(ids) for ids, _ in reqs), default=0) for t, reqs in requests.items()}
    too_long = {t: n for t, n in longest.items() if n >= max_model_len}
    if too_long:
        need = max(too_long.values()) + 1
        fix = (f"pass --max-model-len {need} or more" if need <= max_pos else
               f"the model's context is {max_pos} tokens; leave the task out or use a model with a longer one")
        raise ValueError(f"requests of up to {need - 1} tokens ("
                         + ", ".join(f"{t}: {n}" for t, n in too_long.items())
                         + f") do not fit --max-model-len {max_model_len} with the token the engine samples: {fix}")


def run_tasks(args) -> int:
    from eightbit.eval import report
    from eightbit.eval.configs import (check_float_model, data_record, load_tokenizer, parse_configs,
                                       resolve_data_dir, unpublished_note)
    from eightbit.eval.tasks import TASK_FILES, TASKS, build_requests, evaluate_task, load_task

    _check_args(args, "tasks", ("limit", "max_model_len"))
    _quiet_transformers(args)
    configs = parse_configs(args.configs)
    check_float_model(args.model)
    tasks = list(dict.fromkeys(t.strip() for t in args.tasks.split(",") if t.strip()))  # order kept, once each
    if not tasks:
        raise ValueError(f"--tasks names no task; known: {', '.join(TASKS)}")
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        raise ValueError(f"unknown tasks {bad}; known: {', '.join(TASKS)}")
    data_dir = resolve_data_dir(args.data_dir)
    data = {t: data_record(data_dir, TASK_FILES[t]) for t in tasks}
    data_note = _print_note(unpublished_note(data))
    items = {t: load_task(t, data_dir, args.limit) for t in tasks}
    tokenizer = load_tokenizer(args.model)
    print("[eval] " + ", ".join(f"{t}: {len(v)} items" for t, v in items.items()), flush=True)
    # once for every configuration (they share the tokenizer), and before any model loads: an item that cannot be
    # tokenized fails here
    requests = {t: build_requests(items[t], tokenizer, progress=not args.no_progress) for t in tasks}
    max_pos = _model_context(args.model)
    max_model_len = min(args.max_model_len, max_pos)
    if max_model_len < args.max_model_len:
        print(f"[eval] --max-model-len {args.max_model_len} capped at the model's context, {max_pos}", flush=True)
    _check_requests_fit(requests, max_model_len, max_pos, configs)
    out = Path(args.out)
    meta = _meta(args, {"items": {t: len(v) for t, v in items.items()}, "data": data,
                        "data_note": data_note})
    rows = []

    def write():
        header = f"Zero-shot tasks, {meta['machine']}, {meta['date']}" + _note(meta)
        table = report.tasks_table(rows, tasks, meta["items"])
        chart = _write_results(args, "tasks", meta, rows, header, table, report.tasks_chart, tasks)
        return header, table, chart

    for config, scorer, load_s in _scorers(args, configs, max_model_len, data_dir):
        if isinstance(scorer, str):
            rows.append(_error_row(config, scorer))
            header, table, chart = write()
            continue
        row = _row(config, scorer, load_s)
        row["tasks"] = {}
        rows.append(row)
        for i, task in enumerate(tasks):
            try:
                res = evaluate_task(scorer, task, items[task], requests[task], progress=not args.no_progress)
                row["tasks"][task] = res
                print(f"[eval] {config.name} {task}: acc {100 * res['acc']:.2f}"
                      + (f", acc_norm {100 * res['acc_norm']:.2f}" if "acc_norm" in res else "")
                      + f" ({res['seconds']:.0f} s)", flush=True)
            except Exception as e:
                traceback.print_exc()
                row.setdefault("task_errors", {})[task] = f"{type(e).__name__}: {e}"
            row["unfinished"] = tasks[i + 1:]  # what an interruption before the next write leaves unscored
            if not row["unfinished"]:
                del row["unfinished"]
            header, table, chart = write()  # after every task: a CPU run of one configuration takes hours
    print("\n" + header + "\n\n" + table)
    print(f"\n[eval] wrote {out / 'tasks.json'}, {out / 'tasks.md'}" + (f", {chart}" if chart else ""))
    return 0 if all("error" not in r and "task_errors" not in r for r in rows) else 1


def main(argv=None) -> int:
    """`python -m eightbit.eval.cli ppl ...` = `eightbit eval ppl ...`."""
    from eightbit.cli import main as eightbit_main

    return eightbit_main(["eval", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
