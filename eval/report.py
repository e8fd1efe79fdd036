"""Tables (markdown), JSON and PNG charts of eval results.

A result row is a dict with at least "config", "backend", "baseline", "weight_bytes",
"kv_bytes_per_token" and the metrics ("ppl" for perplexity; per task dicts for tasks).
Rows that failed carry "error" instead of metrics and are listed as such.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def _fmt_bytes(n) -> str:
    return "—" if n in (None, 0) else f"{n / 1e6:.1f} MB"


def _fmt_pct(x, signed=True) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:+.2f}%" if signed else f"{x:.2f}%"


def ppl_deltas(rows) -> dict:
    """config -> Δ% of its perplexity vs its baseline row's (None when the baseline is missing)."""
    by_name = {r["config"]: r for r in rows if "ppl" in r}
    out = {}
    for r in rows:
        base = by_name.get(r.get("baseline"))
        if "ppl" in r and base is not None:
            out[r["config"]] = 100.0 * (r["ppl"] / base["ppl"] - 1.0)
        else:
            out[r["config"]] = None
    return out


def ppl_table(rows) -> str:
    deltas = ppl_deltas(rows)
    lines = [
        "| config | backend | ppl | Δ% vs baseline | baseline | weight bytes | KV bytes/token | windows | tokens | s |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['backend']} | {r['error']} | | | | | | | |")
            continue
        lines.append(
            f"| {r['config']} | {r['backend']} | {r['ppl']:.4f} | {_delta_cell(r, deltas)} | {r['baseline']} "
            f"| {_fmt_bytes(r.get('weight_bytes'))} | {r.get('kv_bytes_per_token', 0):,.0f} | {r['windows']} "
            f"| {r['scored_tokens']:,} | {r.get('seconds', 0):.0f} |"
        )
    return "\n".join(lines)


def _delta_cell(row, deltas) -> str:
    return "—" if row["config"] == row.get("baseline") else _fmt_pct(deltas[row["config"]])  # a baseline row: no Δ


def task_deltas(rows, task, metric) -> dict:
    """config -> paired (diff, stderr) in points of `metric` vs the baseline row, on the same items."""
    from eightbit.eval.tasks import paired_difference

    by_name = {r["config"]: r for r in rows if task in r.get("tasks", {})}
    out = {}
    for r in rows:
        mine, base = by_name.get(r["config"]), by_name.get(r.get("baseline"))
        if mine is None or base is None:
            continue
        a = mine["tasks"][task]["outcomes"].get(metric)
        b = base["tasks"][task]["outcomes"].get(metric)
        if a is None or b is None or len(a) != len(b):
            continue
        d = paired_difference(a, b)
        out[r["config"]] = {"diff": 100 * d["diff"], "stderr": 100 * d["stderr"]}
    return out


def tasks_table(rows, tasks, items=None) -> str:
    """items: {task: item count} of the run, for the footer of tasks that no configuration finished."""
    cols = []
    for task in tasks:
        cols += [(task, "acc")] + ([] if task == "lambada" else [(task, "acc_norm")])
    header = "| config | backend | " + " | ".join(f"{t} {m} (Δ ± paired se)" for t, m in cols) + " |"
    lines = [header, "| --- | --- |" + " ---: |" * len(cols)]
    deltas = {(t, m): task_deltas(rows, t, m) for t, m in cols}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['backend']} | {r['error']} |" + " |" * (len(cols) - 1))
            continue
        cells = []
        for t, m in cols:
            res = r.get("tasks", {}).get(t)
            if res is None or m not in res:
                error = r.get("task_errors", {}).get(t)
                cells.append(f"error: {error}" if error and m == "acc" else "—")  # why, not a bare dash
                continue
            cell = f"{100 * res[m]:.2f}"
            d = deltas[(t, m)].get(r["config"])
            if d is not None and r["config"] != r.get("baseline"):
                cell += f" ({d['diff']:+.2f} ± {d['stderr']:.2f})"
            cells.append(cell)
        name = r["config"] + (" (unfinished)" if r.get("unfinished") else "")
        lines.append(f"| {name} | {r['backend']} | " + " | ".join(cells) + " |")
    sizes = []
    for t in tasks:
        n = next((r["tasks"][t]["items"] for r in rows if t in r.get("tasks", {})), (items or {}).get(t))
        if n is not None:
            sizes.append(f"{t}: {n} items")
    return "\n".join(lines) + ("\n\n" + ", ".join(sizes) if sizes else "")


def temp_path(path: Path) -> Path:
    """Where write_json writes `path` before it replaces it."""
    return path.with_suffix(path.suffix + ".tmp")


def write_json(path, payload) -> Path:
    """Strict JSON (NaN, e.g. the standard error of one item, becomes null), replacing `path` in one step."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    tmp.write_text(json.dumps(_finite(payload), indent=1, default=str, allow_nan=False))
    tmp.replace(path)
    return path


def ppl_chart(rows, path, title="WikiText-2 perplexity") -> Path | None:
    """Bar chart of Δ% vs baseline, and ppl vs KV bytes/token for the int8-KV group sweep if present."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in rows if "ppl" in r]
    if not good:
        return None
    deltas = ppl_deltas(good)
    sweep = sorted((r for r in good if r["config"].startswith("kv8-g")), key=lambda r: r["kv_bytes_per_token"])
    fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(12 if sweep else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    names = [r["config"] for r in good]
    values = [deltas[n] if deltas[n] is not None else 0.0 for n in names]
    colors = ["tab:blue" if r["backend"] == "engine" else "tab:gray" for r in good]
    ax.barh(names, values, color=colors)
    for i, (n, v, r) in enumerate(zip(names, values, good)):
        delta = ("baseline" if r.get("baseline") == n else "no baseline" if deltas[n] is None
                 else f"{v:+.2f}%")  # as the table's "—", not a +0.00 % bar
        ax.text(v, i, f" {delta} (ppl {r['ppl']:.3f})", va="center", fontsize=8)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("Δ perplexity vs baseline (%)  [blue: eightbit, gray: HF peers]")
    ax.set_title(title)
    if sweep:
        ax2 = axes[0][1]
        x = [r["kv_bytes_per_token"] for r in sweep]
        y = [r["ppl"] for r in sweep]
        ax2.plot(x, y, "o-")
        for r in sweep:
            ax2.annotate(r["config"].replace("kv8-", ""), (r["kv_bytes_per_token"], r["ppl"]),
                         textcoords="offset points", xytext=(4, 4), fontsize=8)
        base = next((r for r in good if r["config"] == "bf16"), None)
        if base is not None:
            ax2.axhline(base["ppl"], color="gray", linestyle="--", label=f"bf16 KV ({base['kv_bytes_per_token']:,.0f} B/token)")
            ax2.legend(fontsize=8)
        ax2.set_xlabel("KV bytes per token")
        ax2.set_ylabel("perplexity")
        ax2.set_title("int8 KV: group size sweep")
    return _save(fig, path)


def _save(fig, path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _finite(value):
    """value with every non-finite float (NaN, inf) replaced by None, which JSON has a word for."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def tasks_chart(rows, tasks, path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in rows if r.get("tasks")]
    if not good:
        return None
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        metric = "acc" if task == "lambada" else "acc_norm"
        have = [r for r in good if task in r["tasks"]]
        names = [r["config"] for r in have]
        vals = [100 * r["tasks"][task][metric] for r in have]
        errs = [100 * r["tasks"][task].get(f"{metric}_stderr", 0) for r in have]
        colors = ["tab:blue" if r["backend"] == "engine" else "tab:gray" for r in have]
        ax.barh(names, vals, xerr=errs, color=colors)
        ax.invert_yaxis()
        lo = min(vals) - 5 if vals else 0
        ax.set_xlim(max(0, lo), max(vals) + 3 if vals else 100)
        ax.set_title(f"{task} {metric} (%)")
    return _save(fig, path)
