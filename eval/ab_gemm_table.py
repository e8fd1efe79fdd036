"""Engine A/B of a GEMM table: does a candidate table make the engine's decode faster than the table in use?

    python -m eightbit.eval.ab_gemm_table CANDIDATE.json [--baseline TABLE.json] [--batch-sizes 1,4,32,64]
        [--rounds 2] [--card-entries on|off] [--model llama-3-8b] [--prompt-len 512] [--new-tokens 64] [--out DIR]

Small-M GEMM configs cannot be ranked for the engine by timing them alone, behind quant_per_token or behind the
engine's own producer: on an H200 an 8B o config 2-3.5 % faster in all three timings made batch-1 decode 2.2 %
slower (docs/benchmarks/gemm.md, thirty-sixth session; only a whole decode layer timed outside the engine
ranked it as the engine does, thirty-seventh). So a re-tuned table is checked in the engine before its
entries are filed. Each arm runs `bench_cli run --benches latency` in a fresh process with EIGHTBIT_GEMM_TABLE
set to its table, in the order baseline, candidate, candidate, baseline each round, and the decode-step bandwidth
(bench_engine's achieved_gbs: the steps whose M is the batch size, so the steps one M bucket runs) is compared per
batch size. A batch size's candidate wins when every candidate run beats every baseline run, loses when every one
is slower, and is otherwise within the runs' spread. With no real difference and no drift the ABBA order does not
cancel, a batch size reads "wins" by chance 1 time in 70 with the default two rounds (1 in 6 with one), and "loses"
as often; over several batch sizes one of them wins by chance up to that many times as often (the output says so
for the runs made). A run that fails, or records no
bandwidth for a batch size, stops the A/B with its error (each run's output is in its folder's run.log).

The candidate replaces the whole table (a shape it lacks runs the default config, not the baseline's), so it
should be a full table, as `tune_gemm --out` writes. A card's own entries (gemm_configs_by_device.json) apply
in both arms: the shapes they cover compare equal, and the script names any candidate entry they hid. To compare
those (a re-tune of buckets the card has entries in), --card-entries off runs both arms on their tables alone
(EIGHTBIT_GEMM_BY_DEVICE=0) against, unless --baseline is given, the table this card runs now (the table in use
with the card's entries in place, written to OUT/in_use.json). Prints the
table, writes it with every run's numbers to OUT/ab.json, and names the buckets whose every batch size won
(`tune_gemm --device-overrides CANDIDATE --buckets ...` files those buckets' entries that differ from the
committed table as the card's own).
"""

import argparse
import json
import math
import os
import subprocess
import sys

import torch

from eightbit.eval.bench_common import load_records
from eightbit.kernels import gemm_configs
from eightbit.kernels.gemm_configs import TABLE_ENV, device_entries, device_name_of, m_bucket, table_path

ORDER = ("baseline", "candidate", "candidate", "baseline")


def parse_batch_sizes(text):
    """'1,4,32' -> [1, 4, 32]; ValueError for anything else."""
    sizes = [int(b) for b in text.split(",") if b]
    if not sizes or min(sizes) < 1:
        raise ValueError(text)
    return sizes


def read_table(path):
    """gemm_configs.read_table, with what is wrong as a SystemExit before any engine run."""
    try:
        return gemm_configs.read_table(path)
    except (OSError, ValueError) as e:
        raise SystemExit(str(e) if isinstance(e, ValueError) else f"{path}: {e.strerror}") from e


def decode_gbs(out_dir, batch_sizes):
    """{batch size: achieved GB/s over the decode steps} of the latency records in out_dir; SystemExit with the
    recorded error for a batch size without one."""
    records = [r for r in load_records([out_dir]) if r.get("bench") == "latency"]
    gbs = {r["batch"]: r["achieved_gbs"] for r in records if r.get("ok") and r.get("achieved_gbs")}
    for b in batch_sizes:
        if b not in gbs:
            errors = [r.get("error") for r in records if r.get("batch") in (b, None) and r.get("error")]
            raise SystemExit(f"the engine run in {out_dir} measured no decode bandwidth at batch {b}: "
                             f"{errors[-1] if errors else 'no record'}")
    return gbs


def write_in_use_table(path, base_path, own):
    """The table at base_path with `own` ({(m_bucket, n, k): GemmConfig}, a card's entries) in place, as get_config
    merges them, written to path; returns path."""
    merged = {**read_table(base_path), **own}
    configs = [dict(m_bucket=mb, n=n, k=k, config=c.to_dict()) for (mb, n, k), c in sorted(merged.items())]
    with open(path, "w") as f:
        json.dump(dict(note=f"{base_path} with this card's own entries in place (ab_gemm_table --card-entries off)",
                       configs=configs), f, indent=1)
    return path


def run_arm(table, out_dir, args):
    """One fresh engine process on table, its output in out_dir/run.log; its decode GB/s per batch size."""
    cmd = [sys.executable, "-m", "eightbit.eval.bench_cli", "run", "--system", "eightbit-int8", "--model", args.model,
           "--benches", "latency", "--batch-sizes", args.batch_sizes, "--prompt-len", str(args.prompt_len),
           "--new-tokens", str(args.new_tokens), "--out", out_dir]
    os.makedirs(out_dir, exist_ok=True)
    log = os.path.join(out_dir, "run.log")
    with open(log, "w") as f:
        env = dict(os.environ, **{TABLE_ENV: table})
        if args.card_entries == "off":
            env["EIGHTBIT_GEMM_BY_DEVICE"] = "0"
        done = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"the engine run on {table} failed (exit code {done.returncode}): see {log}")
    return decode_gbs(out_dir, parse_batch_sizes(args.batch_sizes))


def verdict(base, cand):
    if min(cand) > max(base):
        return "wins"
    if max(cand) < min(base):
        return "loses"
    return "within the spread"


def compare(runs, batch_sizes):
    """Per batch size: its M bucket, each arm's GB/s, the change of the means and the verdict."""
    rows = []
    for b in batch_sizes:
        base = [r["gbs"][b] for r in runs if r["arm"] == "baseline"]
        cand = [r["gbs"][b] for r in runs if r["arm"] == "candidate"]
        change = (sum(cand) / len(cand)) / (sum(base) / len(base)) - 1
        rows.append(dict(batch=b, bucket=m_bucket(b), baseline=base, candidate=cand, change=change,
                         verdict=verdict(base, cand)))
    return rows


def winning_buckets(rows):
    """Buckets where the candidate won at every batch size measured in them."""
    by_bucket = {}
    for r in rows:
        by_bucket.setdefault(r["bucket"], []).append(r["verdict"])
    return sorted(b for b, vs in by_bucket.items() if all(v == "wins" for v in vs))


def _gbs(values):
    return " / ".join(f"{x:,.0f}" for x in values)


def chance_of_wins_by_noise(runs_per_arm):
    """With no real difference (every order of the runs' speeds equally likely), the chance that every candidate run
    beats every baseline run, at one batch size: 1 / C(2n, n). The same for "loses"."""
    return 1 / math.comb(2 * runs_per_arm, runs_per_arm)


def render(rows, candidate, hidden=()):
    """The table, the buckets that won and how to file them; `hidden`: candidate entries the card's own entries
    replaced in both arms (not measured, yet filed with their bucket)."""
    lines = ["| batch | M bucket | baseline decode GB/s | candidate decode GB/s | change | candidate |",
             "|---:|---:|---|---|---:|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['bucket']} | {_gbs(r['baseline'])} | {_gbs(r['candidate'])} | "
                     f"{100 * r['change']:+.1f} % | {r['verdict']} |")
    won = winning_buckets(rows)
    lines.append("")
    if rows:
        n, sizes = len(rows[0]["baseline"]), len(rows)
        odds = round(1 / chance_of_wins_by_noise(n))
        several = f"; some one of these {sizes} up to {sizes} in {odds}" if sizes > 1 else ""
        lines.append(f"{n} runs per arm: with no real difference a batch size reads \"wins\" by chance 1 time in "
                     f"{odds} (\"loses\" as often){several}")
    if not won:
        lines.append("no bucket won in every run")
        return "\n".join(lines)
    buckets = ",".join(map(str, won))
    lines.append(f"won in every run: buckets {buckets} (file them: python -m eightbit.eval.tune_gemm "
                 f"--device-overrides {candidate} --buckets {buckets})")
    unmeasured = sorted(key for key in hidden if key[0] in won)
    if unmeasured:
        lines.append("not measured, though filing those buckets files them: the candidate's entries at (M bucket, N, "
                     "K) " + ", ".join(map(str, unmeasured)) + ", which this card's own entries replaced in both arms")
    return "\n".join(lines)


def _check_tables(baseline, candidate):
    """The two tables, refused when they cannot make an A/B; a warning for shapes only one of them has."""
    if os.path.abspath(baseline) == os.path.abspath(candidate):
        raise SystemExit(f"the candidate is the baseline itself ({baseline}): nothing to compare")
    base, cand = read_table(baseline), read_table(candidate)
    if not cand:
        raise SystemExit(f"{candidate} holds no entries")
    only = sorted(set(base) ^ set(cand))
    if only:
        print(f"[ab] warning: {len(only)} (M bucket, N, K) entries are in only one of the tables, e.g. {only[:3]}; "
              "a shape a table lacks runs the default config in that arm", flush=True)
    return base, cand


def main(argv=None, run=run_arm):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("candidate", help="the table to check (tune_gemm --out)")
    ap.add_argument("--baseline", default=None, help="default: the table in use (EIGHTBIT_GEMM_TABLE or the committed)")
    ap.add_argument("--batch-sizes", default="1,4,32,64")
    ap.add_argument("--rounds", type=int, default=2, help="each round: baseline, candidate, candidate, baseline")
    ap.add_argument("--card-entries", choices=("on", "off"), default="on",
                    help="off: both arms run their table alone (EIGHTBIT_GEMM_BY_DEVICE=0); the default baseline is "
                         "then the table this card runs now, its own entries in place (OUT/in_use.json)")
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT") or ".", "ab_gemm_table"))
    args = ap.parse_args(argv)
    try:
        batch_sizes = parse_batch_sizes(args.batch_sizes)
    except ValueError:
        ap.error(f"--batch-sizes must be comma-separated integers >= 1, got {args.batch_sizes!r}")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    tables = {"baseline": os.path.abspath(args.baseline or table_path()), "candidate": os.path.abspath(args.candidate)}
    _, cand = _check_tables(tables["baseline"], tables["candidate"])
    if os.path.isdir(args.out) and os.listdir(args.out):
        raise SystemExit(f"{args.out} is not empty (an earlier A/B?): give another --out")
    if not torch.cuda.is_available():
        raise SystemExit("ab_gemm_table compares GEMM tables in the engine on a CUDA GPU, and this machine has none")
    own = device_entries(device_name_of(torch.device("cuda")))
    os.makedirs(args.out, exist_ok=True)
    if args.card_entries == "off":
        if args.baseline is None:
            tables["baseline"] = write_in_use_table(os.path.join(args.out, "in_use.json"), tables["baseline"], own)
            _check_tables(tables["baseline"], tables["candidate"])
        own = {}
    hidden = [key for key in cand if key in own and own[key] != cand[key]]
    if hidden:
        print(f"[ab] warning: this card's own entries replace {len(hidden)} of the candidate's in both arms, so they "
              f"compare equal, e.g. (M bucket, N, K) {hidden[:3]}; to compare them, run with "
              "--card-entries off", flush=True)
    runs = []
    for i, arm in enumerate(ORDER * args.rounds):
        gbs = run(tables[arm], os.path.join(args.out, f"{i:02d}_{arm}"), args)
        runs.append(dict(arm=arm, gbs=gbs))
        print(f"[ab] run {i + 1}/{len(ORDER) * args.rounds} {arm}: " +
              ", ".join(f"batch {b} {g:,.0f} GB/s" for b, g in sorted(gbs.items())), flush=True)
    rows = compare(runs, batch_sizes)
    saved = [dict(arm=r["arm"], gbs=sorted(r["gbs"].items())) for r in runs]  # [batch, GB/s] pairs: JSON keys are str
    with open(os.path.join(args.out, "ab.json"), "w") as f:
        json.dump(dict(tables=tables, args=vars(args), runs=saved, rows=rows), f, indent=1)
    print(render(rows, args.candidate, hidden))
    return 0


if __name__ == "__main__":
    sys.exit(main())
