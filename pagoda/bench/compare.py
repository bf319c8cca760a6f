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

`--rounds N` runs the whole sequence N times over, so that every run has a peer's run next to it in each round;
the tables then give medians over the rounds: of each run's figures, and of its ratios to the peers taken round by
round (a run over the peer's run of the same round), with their range.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import statistics
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
    p.add_argument("--rounds", type=int, default=1,
                   help="run the whole sequence this many times over; the tables give medians (default 1)")
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


def _by_name(runs: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The runs grouped by name (one run a round), in the order the names first ran."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault(r["name"], []).append(r)
    return list(groups.values())


def _peer(runs: list[dict[str, Any]], backend: str, key: str) -> dict[int, float]:
    """Per round, the figure key of the run of that backend (where it ran)."""
    return {r.get("round", 0): r["result"][key] for r in runs
            if "result" in r and r["result"].get("backend") == backend and r["result"].get(key)}


def _summarize(row: dict[str, Any], name: str, values: list[float]) -> None:
    """row[name] = the median of values (None where there are none), and with more than one, row[name + '_range'] =
    [min, max]."""
    row[name] = statistics.median(values) if values else None
    if len(values) > 1:
        row[f"{name}_range"] = [min(values), max(values)]


def _ratios(row: dict[str, Any], runs: list[dict[str, Any]], key: str, peers: dict[str, dict[int, float]]) -> None:
    """row['over_' + peer]: the median over rounds of the runs' figure key over that peer's in the same round."""
    for peer, per_round in peers.items():
        _summarize(row, f"over_{peer}", [r["result"][key] / per_round[r.get("round", 0)] for r in runs
                                         if r["result"].get(key) and per_round.get(r.get("round", 0))])


def single_table(runs: list[dict[str, Any]], workload: str) -> list[dict[str, Any]]:
    """One row per run of a one-request workload: its figure (SINGLE) and, for Pagoda's, the ratio to llama.cpp's
    (medians over the rounds)."""
    key = SINGLE[workload][1]
    runs = [r for r in runs if r.get("workload") == workload]
    peers = {"llamacpp": _peer(runs, "llamacpp", key)}
    rows = []
    for group in _by_name(runs):
        done = [r for r in group if "result" in r]
        row = _row(done[0] if done else group[0])
        if done:
            _summarize(row, key, [r["result"][key] for r in done if r["result"].get(key) is not None])
            if done[0]["result"].get("backend") == "pagoda":
                _ratios(row, done, key, peers)
        rows.append(row)
    return rows


def table(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run of the offline workload: its figures and its ratios to the peers that ran (medians over the
    rounds, with their range where there are several)."""
    runs = [r for r in runs if r.get("workload", "offline") == "offline"]
    key = "total_tokens_per_second"
    peers = {"hf": _peer(runs, "hf", key), "llamacpp": _peer(runs, "llamacpp", key)}
    rows = []
    for group in _by_name(runs):
        done = [r for r in group if "result" in r]
        row = _row(done[0] if done else group[0])
        rows.append(row)
        if not done:
            continue
        if len(done) < len(group):
            row["failed_rounds"] = len(group) - len(done)
        res = [r["result"] for r in done]
        _summarize(row, "elapsed_s", [x["elapsed_s"] for x in res])
        _summarize(row, key, [x[key] for x in res])
        ttfts = [x["ttft_s"] for x in res if x.get("ttft_s")]
        row["ttft_mean_s"] = statistics.median(t["mean"] for t in ttfts) if ttfts else None
        row["ttft_p99_s"] = statistics.median(t["p99"] for t in ttfts) if ttfts else None
        if res[0].get("backend") == "pagoda":
            _ratios(row, done, key, peers)
            floors = [x["compute_floor_fraction"] for x in res if x.get("compute_floor_fraction") is not None]
            _summarize(row, "compute_floor_fraction", floors)
            row["floor_target_applies"] = is_float32_run(res[0])
    return rows


def run_compare(args: argparse.Namespace) -> dict[str, Any]:
    workload_spec(args)  # a bad workload flag fails here, once, not in every child process
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    plans = planned_runs(args)
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for workload, name, argv, skipped in plans:
            if argv is None:
                runs.append({"workload": workload, "name": name, "round": round_, "skipped": skipped})
                continue
            of = f", round {round_ + 1} of {args.rounds}" if args.rounds > 1 else ""
            print(f"running {name} ({workload}{of}) ...", file=sys.stderr, flush=True)
            base = workload_args(args, workload)
            result = run_one(base + argv)
            done = result.get("error") or (f"{result['total_tokens_per_second']:.1f} total tokens/s in "
                                           f"{result['elapsed_s']:.1f} s")
            print(f"  {done}", file=sys.stderr, flush=True)
            runs.append({"workload": workload, "name": name, "round": round_,
                         "command": ["pagoda", "bench", "throughput", *base, *argv, "--json"],
                         **({"error": result["error"]} if "error" in result else {"result": result})})
    singles = sorted({w for w, *_ in plans} - {"offline"}, key=list(SINGLE).index)
    out = {"workload": workload_args(args), "rounds": args.rounds, "targets": TARGETS, "runs": runs,
           "table": table(runs),
           **{f"{w}_table": single_table(runs, w) for w in singles}}
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(out, f, indent=1)
    return out


def _cell(row: dict[str, Any], name: str, spec: str, suffix: str = "", scale: float = 1.0) -> str:
    """row[name] formatted, with its range over the rounds where it has one: "5.02x (4.81-5.20x)"."""
    x, span = row.get(name), row.get(f"{name}_range")
    if x is None:
        return ""
    text = f"{scale * x:{spec}}{suffix}"
    return text + (f" ({scale * span[0]:{spec}}-{scale * span[1]:{spec}}{suffix})" if span else "")


def _not_run(row: dict[str, Any]) -> str:
    return f"skipped: {row['skipped']}" if "skipped" in row else f"failed: {row['error']}"


def report(out: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(out))
        return
    rounds = out.get("rounds", 1)
    print(f"workload: {' '.join(out['workload'])}" + (f"; medians of {rounds} rounds (range)" if rounds > 1 else ""))
    print("| run | elapsed | total tokens/s | over HF | over llama.cpp | of the compute floor | TTFT mean / p99 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in out["table"]:
        if "total_tokens_per_second" not in row:
            print(f"| {row['name']} | {_not_run(row)} | | | | | |")
            continue
        floor_s = _cell(row, "compute_floor_fraction", ".1f", "%", 100.0)
        if floor_s and not row.get("floor_target_applies"):
            floor_s += " (not float32)"
        ttft = f"{row['ttft_mean_s']:.1f} / {row['ttft_p99_s']:.1f} s" if row.get("ttft_mean_s") is not None else ""
        failed = f" ({row['failed_rounds']} rounds failed)" if row.get("failed_rounds") else ""
        print(f"| {row['name']}{failed} | {row['elapsed_s']:.1f} s | {_cell(row, 'total_tokens_per_second', '.1f')} | "
              f"{_cell(row, 'over_hf', '.2f', 'x')} | {_cell(row, 'over_llamacpp', '.2f', 'x')} | {floor_s} | "
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
                print(f"| {row['name']} | {_cell(row, key, '.1f')} | {_cell(row, 'over_llamacpp', '.2f', 'x')} |")
    if out.get("prompt_table"):
        print(f"target: one prompt at {t['prompt_over_llamacpp']:g}x llama.cpp")
