"""PNG plots for `pagoda bench serve --plot DIR` (matplotlib, Agg: no display needed).

Per run: the CDFs of TTFT, TPOT, ITL and E2E latency. For a sweep of finite request rates: output
and request throughput against the offered rate, and p99 TTFT/TPOT against it (where the knee
shows: the rate a server stops keeping up with).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagoda.bench.serve_client import RequestResult


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; must precede importing pyplot
    import matplotlib.pyplot as plt

    return plt


def latency_samples(results: list[RequestResult]) -> dict[str, list[float]]:
    ok = [r for r in results if r.success]
    return {
        "TTFT": [r.ttft * 1e3 for r in ok],
        "TPOT": [t * 1e3 for r in ok if (t := r.tpot) is not None],
        "ITL": [g * 1e3 for r in ok for g in r.itl],
        "E2E": [r.e2e * 1e3 for r in ok],
    }


def plot_cdfs(run: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, values) in zip(axes.flat, latency_samples(run["results"]).items(), strict=True):
        values = sorted(values)
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post")
        ax.set_title(f"{name} CDF ({len(values)} samples)")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"{run['model']} @ {run['request_rate']} req/s (burstiness {run['burstiness']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(runs: list[dict[str, Any]], out: Path) -> list[Path]:
    """Throughput and p99 latency against the offered rate; `inf` has no place on that axis."""
    finite = sorted((r for r in runs if r["request_rate"] != "inf"), key=lambda r: r["request_rate"])
    if len(finite) < 2:
        return []
    plt = _pyplot()
    rates = [r["request_rate"] for r in finite]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(rates, [r["output_throughput"] for r in finite], "o-", label="output tokens/s")
    left.set_xlabel("request rate (req/s)")
    left.set_ylabel("output tokens/s")
    twin = left.twinx()
    twin.plot(rates, [r["request_throughput"] for r in finite], "s--", color="tab:orange", label="requests/s")
    twin.set_ylabel("completed requests/s")
    left.set_title("throughput")
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms")):
        right.plot(rates, [r[key].get("p99", float("nan")) for r in finite], "o-", label=f"p99 {name}")
    right.set_xlabel("request rate (req/s)")
    right.set_ylabel("ms")
    right.set_yscale("log")
    right.set_title("p99 latency")
    right.legend()
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    paths = [out / "sweep.png"]
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)
    return paths


def plot_runs(runs: list[dict[str, Any]], out_dir: str) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for run in runs:
        path = out / f"latency_cdf_rate_{run['request_rate']}.png"
        plot_cdfs(run, path)
        paths.append(path)
    return paths + plot_sweep(runs, out)
