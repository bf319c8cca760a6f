"""`pagoda bench compare`: Pagoda and its peers on one offline workload, one after another on this machine, with the
ratios issue 5's targets name.

    pagoda bench compare                                   # 128 requests, prompts of 64-512 tokens, 128 generated
    pagoda bench compare --pagoda "" --pagoda "--quantization q4_1 --kv-cache-dtype int8" --save-result cmp.json

Each run is `pagoda bench throughput WORKLOAD --json` in a fresh process (a run's memory, threads and kernels do not
carry into the next), in this order: HF transformers `generate` (`--backend hf`, static batches of
`--hf-batch-size` in `--hf-dtype`: bfloat16 at 32 was its best on the Zen 4 machine, BENCHMARKS.md), llama.cpp
(`--backend llamacpp`, `--llamacpp-parallel` sequences; skipped, and said so, where llama-cpp-python is not
installed), then each `--pagoda` flag set (engine flags, quoted; "" runs the defaults). A run that fails is reported
with its error and the others go on.

The table gives each run's total (prompt + generated) tokens/s, its ratio to HF's and to llama.cpp's, the share of
the compute floor (the run's matmul FLOPs a second over the best float32 matmul rate measured around it: the
issue's measure for float32 models; a quantized model's int8 arithmetic can pass 100%), and mean and p99 time to
first token. Then, with `--also stream,prompt` (the default), the issue's two one-request comparisons, llama.cpp
(one sequence) against each Pagoda flag set: one stream's decode tokens/s after its first token (a 16-token prompt,
129 generated) and one 512-token prompt's tokens/s. These machines' speed drifts by up to 1.7x within an hour, so
compare runs of one invocation, not figures of different ones.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import subprocess
import sys
from typing import Any

from pagoda.bench.common import add_workload_flags, workload_spec

# The issue's targets for the offline workload: Pagoda's total tokens/s over HF's and llama.cpp's, and the compute
# floor's share (float32 models).
TARGETS = {"hf": 5.0, "llamacpp": 2.0, "floor": 0.70, "prompt_over_llamacpp": 1.5}
DEFAULT_PAGODA = ("", "--quantization q4_1")
# The one-request workloads (`--also`): bench throughput's workload flags, the figure compared, its label. llama.cpp
# runs them with one sequence and its batch of 512 (a whole prompt in one llama_decode call).
SINGLE = {
    "stream": (["--num-prompts", "1", "--input-len", "16:16", "--output-len", "129"], "decode_tokens_per_second",
               "one stream, decode tokens/s after the first token (16-token prompt, 129 generated)"),
    "prompt": (["--num-prompts", "1", "--input-len", "512:512", "--output-len", "1"], "prompt_tokens_per_second",
               "one 512-token prompt, tokens/s"),
}
LLAMACPP_SINGLE = ["--backend", "llamacpp", "--llamacpp-parallel", "1", "--llamacpp-batch", "512"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("compare", help="Pagoda, HF transformers and llama.cpp on one offline workload, in turn",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_flags(p, num_prompts=128)
    p.set_defaults(input_len=(64, 512))  # the issue's workload
    p.add_argument("--model", default=None, help="the model every run loads (default: the engine's default)")
    p.add_argument("--pagoda", action="append", default=None, metavar="FLAGS",
                   help='engine flags of one Pagoda run, quoted, with "=" where they are one flag alone '
                        '(--pagoda="--kv-cache-prefault"; "" for the defaults); repeatable (default: "" and '
                        '"--quantization q4_1")')
    p.add_argument("--peers", default="hf,llamacpp",
                   help="comma-separated peers of the offline comparison, run first: hf, llamacpp ('' for none; "
                        "default both; the one-request ones of --also always run llama.cpp where it is installed)")
    p.add_argument("--hf-batch-size", type=int, default=32, help="the hf peer's static batch size (default 32)")
    p.add_argument("--hf-dtype", default="bfloat16", help="the hf peer's dtype (default bfloat16)")
    p.add_argument("--llamacpp-parallel", type=int, default=16,
                   help="sequences the llamacpp peer decodes together (default 16)")
    p.add_argument("--also", default="stream,prompt",
                   help="one-request comparisons against llama.cpp to run after the offline one: stream, prompt "
                        "('' for none; default both)")
    p.add_argument("--save-result", default=None, metavar="FILE", help="write every run's result and the table as JSON")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def workload_args(args: argparse.Namespace, workload: str = "offline") -> list[str]:
    """The flags of `bench throughput` that reproduce args' workload (offline) or a one-request one (SINGLE), with
    the model."""
    if workload == "offline":
        lo, hi = args.input_len
        out = ["--dataset", args.dataset, "--num-prompts", str(args.num_prompts), "--input-len", f"{lo}:{hi}",
               "--output-len", str(args.output_len), "--seed", str(args.seed)]
        if args.dataset == "prefix":  # the only dataset that reads it: left out of the others' commands
            out += ["--prefix-len", str(args.prefix_len)]
        if args.dataset_path is not None:
            out += ["--dataset-path", args.dataset_path]
    else:
        out = [*SINGLE[workload][0], "--seed", str(args.seed)]
    if args.model is not None:
        out += ["--model", args.model]
    return out


Plan = tuple[str, str, list[str] | None, str | None]


def _names(value: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        raise ValueError(f"{flag} takes {' and '.join(allowed)}; got {', '.join(unknown)}")
    return names


def planned_runs(args: argparse.Namespace) -> list[Plan]:
    """(workload: offline, stream or prompt; name; `bench throughput` arguments after the workload's, or None with
    the reason it is skipped)."""
    peers = _names(args.peers, ("hf", "llamacpp"), "--peers")
    also = _names(args.also, tuple(SINGLE), "--also")
    missing = "llama-cpp-python is not installed (pip install llama-cpp-python==0.3.36)"
    have_llamacpp = importlib.util.find_spec("llama_cpp") is not None
    pagoda = [(f"Pagoda {flags}".rstrip() if flags.strip() else "Pagoda (defaults)", shlex.split(flags))
              for flags in (args.pagoda if args.pagoda is not None else DEFAULT_PAGODA)]
    runs: list[Plan] = []
    if "hf" in peers:
        runs.append(("offline", f"HF transformers, {args.hf_dtype}, batches of {args.hf_batch_size}",
                     ["--backend", "hf", "--hf-batch-size", str(args.hf_batch_size), "--dtype", args.hf_dtype], None))
    if "llamacpp" in peers:
        runs.append(("offline", f"llama.cpp, {args.llamacpp_parallel} parallel sequences",
                     ["--backend", "llamacpp", "--llamacpp-parallel", str(args.llamacpp_parallel)] if have_llamacpp
                     else None, None if have_llamacpp else missing))
    runs += [("offline", name, argv, None) for name, argv in pagoda]
    for workload in also:
        runs.append((workload, "llama.cpp, one sequence", LLAMACPP_SINGLE if have_llamacpp else None,
                     None if have_llamacpp else missing))
        runs += [(workload, name, argv, None) for name, argv in pagoda]
    return runs


def run_one(argv: list[str]) -> dict[str, Any]:
    """`pagoda bench throughput ARGV --json` in a fresh process: its JSON result, or {"error": ...}."""
    cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "bench", "throughput", *argv, "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        try:
            return dict(json.loads(lines[-1]))
        except json.JSONDecodeError:
            pass
    tail = (proc.stderr.strip().splitlines() or lines or ["no output"])[-1]
    return {"error": f"exit status {proc.returncode}: {tail}"}


def is_float32_run(result: dict[str, Any]) -> bool:
    """Whether the floor target applies: a Pagoda run of a float32 model without weight quantization."""
    opts = result.get("engine_options") or {}
    return opts.get("quantization", "none") in (None, "none") and opts.get("dtype", "auto") in ("auto", "float32")


def _row(run: dict[str, Any]) -> dict[str, Any]:
    """A table row's start: the run's name, and why it has no figures where it has none."""
    row: dict[str, Any] = {"name": run["name"]}
    if "result" not in run:
        row["skipped" if "skipped" in run else "error"] = run.get("skipped") or run.get("error")
    return row


def single_table(runs: list[dict[str, Any]], workload: str) -> list[dict[str, Any]]:
    """One row per run of a one-request workload: its figure (SINGLE) and, for Pagoda's, the ratio to llama.cpp's."""
    key = SINGLE[workload][1]
    runs = [r for r in runs if r.get("workload") == workload]
    peer = next((r["result"].get(key) for r in runs if r.get("result", {}).get("backend") == "llamacpp"), None)
    rows = []
    for r in runs:
        row = _row(r)
        if "result" in r:
            row[key] = value = r["result"].get(key)
            if r["result"].get("backend") == "pagoda":
                row["over_llamacpp"] = value / peer if value and peer else None
        rows.append(row)
    return rows


def table(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run of the offline workload: its figures and its ratios to the peers that ran."""
    runs = [r for r in runs if r.get("workload", "offline") == "offline"]

    def total(backend: str) -> float | None:
        return next((r["result"]["total_tokens_per_second"] for r in runs
                     if "result" in r and r["result"].get("backend") == backend), None)

    hf, llamacpp = total("hf"), total("llamacpp")
    rows = []
    for r in runs:
        row = _row(r)
        rows.append(row)
        if "result" not in r:
            continue
        res = r["result"]
        tps, ttft = res["total_tokens_per_second"], res.get("ttft_s") or {}
        row |= {"elapsed_s": res["elapsed_s"], "total_tokens_per_second": tps, "ttft_mean_s": ttft.get("mean"),
                "ttft_p99_s": ttft.get("p99")}
        if res.get("backend") == "pagoda":
            row["over_hf"] = tps / hf if hf else None
            row["over_llamacpp"] = tps / llamacpp if llamacpp else None
            row["compute_floor_fraction"] = res.get("compute_floor_fraction")
            row["floor_target_applies"] = is_float32_run(res)
    return rows


def run_compare(args: argparse.Namespace) -> dict[str, Any]:
    workload_spec(args)  # a bad workload flag fails here, once, not in every child process
    plans = planned_runs(args)
    runs: list[dict[str, Any]] = []
    for workload, name, argv, skipped in plans:
        if argv is None:
            runs.append({"workload": workload, "name": name, "skipped": skipped})
            continue
        print(f"running {name} ({workload}) ...", file=sys.stderr, flush=True)
        base = workload_args(args, workload)
        result = run_one(base + argv)
        done = result.get("error") or (f"{result['total_tokens_per_second']:.1f} total tokens/s in "
                                       f"{result['elapsed_s']:.1f} s")
        print(f"  {done}", file=sys.stderr, flush=True)
        runs.append({"workload": workload, "name": name,
                     "command": ["pagoda", "bench", "throughput", *base, *argv, "--json"],
                     **({"error": result["error"]} if "error" in result else {"result": result})})
    singles = sorted({w for w, *_ in plans} - {"offline"}, key=list(SINGLE).index)
    out = {"workload": workload_args(args), "targets": TARGETS, "runs": runs, "table": table(runs),
           **{f"{w}_table": single_table(runs, w) for w in singles}}
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(out, f, indent=1)
    return out


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "" if x is None else f"{x:{spec}}{suffix}"


def _not_run(row: dict[str, Any]) -> str:
    return f"skipped: {row['skipped']}" if "skipped" in row else f"failed: {row['error']}"


def report(out: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(out))
        return
    print(f"workload: {' '.join(out['workload'])}")
    print("| run | elapsed | total tokens/s | over HF | over llama.cpp | of the compute floor | TTFT mean / p99 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in out["table"]:
        if "total_tokens_per_second" not in row:
            print(f"| {row['name']} | {_not_run(row)} | | | | | |")
            continue
        floor = row.get("compute_floor_fraction")
        floor_s = _fmt(100 * floor if floor is not None else None, ".1f", "%")
        if floor_s and not row.get("floor_target_applies"):
            floor_s += " (not float32)"
        ttft = f"{row['ttft_mean_s']:.1f} / {row['ttft_p99_s']:.1f} s" if row.get("ttft_mean_s") is not None else ""
        print(f"| {row['name']} | {row['elapsed_s']:.1f} s | {row['total_tokens_per_second']:.1f} | "
              f"{_fmt(row.get('over_hf'), '.2f', 'x')} | {_fmt(row.get('over_llamacpp'), '.2f', 'x')} | {floor_s} | "
              f"{ttft} |")
    t = out["targets"]
    print(f"targets: {t['hf']:g}x HF, {t['llamacpp']:g}x llama.cpp, {100 * t['floor']:.0f}% of the compute floor "
          "(float32 models)")
    for workload, (_, key, label) in SINGLE.items():
        rows = out.get(f"{workload}_table")
        if not rows:
            continue
        print(f"\n{label}:\n| run | {key.replace('_', ' ')} | over llama.cpp |\n|---|---:|---:|")
        for row in rows:
            if key not in row:
                print(f"| {row['name']} | {_not_run(row)} | |")
            else:
                print(f"| {row['name']} | {_fmt(row[key], '.1f')} | {_fmt(row.get('over_llamacpp'), '.2f', 'x')} |")
    if out.get("prompt_table"):
        print(f"target: one prompt at {t['prompt_over_llamacpp']:g}x llama.cpp")
