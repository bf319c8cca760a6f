"""Pieces shared by every `pagoda bench` command: workload flags, length ranges, percentiles, and
the tokenizer that turns a workload into token ids without loading any weights."""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from pagoda.bench.datasets import DATASETS, WorkloadSpec

if TYPE_CHECKING:
    from pagoda.tokenizer import Tokenizer


def machine_info() -> dict[str, object]:
    """What a benchmark figure depends on besides the code: CPU, its vector features, threads, torch.
    Recorded with every result because these shared machines differ from one session to the next."""
    import platform

    import torch

    flags: set[str] = set()
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
    return {"cpu": model, "cpu_count": os.cpu_count(), "cpu_flags": [f for f in wanted if f in flags],
            "torch": torch.__version__, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_threads": torch.get_num_threads()}


def process_memory() -> dict[str, float]:
    """This process's resident memory now and its peak so far, MiB (Linux's /proc/self/status VmRSS and VmHWM); {}
    where that file is not there."""
    fields = {"VmRSS": "rss_mib", "VmHWM": "peak_rss_mib"}
    out: dict[str, float] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in fields:
                    out[fields[name]] = round(int(value.split()[0]) / 1024, 1)  # kB
    except OSError:
        return {}
    return out


def parse_range(value: str) -> tuple[int, int]:
    """'128:512' -> (128, 512); '256' -> (256, 256)."""
    try:
        parts = [int(x) for x in value.split(":")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {value!r}") from None
    lo, hi = (parts[0], parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    if len(parts) > 2 or not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX with 1 <= MIN <= MAX, got {value!r}")
    return lo, hi


def percentiles(values: list[float]) -> dict[str, float]:
    """mean, median, p90, p99 (inclusive method: p99 of a small sample stays inside its range)."""
    if not values:
        return {}
    qs = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "p90": qs[89], "p99": qs[98]}


def add_workload_flags(p: argparse.ArgumentParser, num_prompts: int = 64) -> None:
    p.add_argument("--dataset", choices=DATASETS, default="random")
    p.add_argument("--dataset-path", default=None, help="JSONL of prompts (file) or ShareGPT JSON (sharegpt)")
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument("--input-len", type=parse_range, default=(128, 512),
                   help="N or MIN:MAX (uniform); for `prefix`, the length after the shared prefix")
    p.add_argument("--prefix-len", type=int, default=1024, help="shared prefix length (dataset prefix)")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request (ignore_eos)")
    p.add_argument("--seed", type=int, default=0)


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.output_len < 1:
        raise ValueError(f"--output-len must be >= 1, got {args.output_len}")
    return WorkloadSpec(dataset=args.dataset, num_prompts=args.num_prompts, input_len=args.input_len,
                        output_len=args.output_len, prefix_len=args.prefix_len, path=args.dataset_path,
                        seed=args.seed)


def load_tokenizer(model: str) -> tuple[Tokenizer, int]:
    """A model's tokenizer and the number of token ids safe to put in a prompt, read from its files
    (GGUF metadata or a HF folder) without loading the weights."""
    from pagoda.model.loader import resolve_model_path
    from pagoda.tokenizer import Tokenizer

    path = resolve_model_path(model)
    if path.suffix == ".gguf":
        from pagoda.model.gguf_loader import load_gguf

        gguf_model = load_gguf(path)
        tok, config = gguf_model.tokenizer, gguf_model.hf_config
    else:
        tok, config = Tokenizer.from_hf_folder(path), json.loads((Path(path) / "config.json").read_text())
    # The embedding table can be padded past the tokenizer's vocabulary: ids there mean nothing to
    # other engines (llama.cpp rejects them), so stay inside both.
    return tok, min(tok.vocab_size, int(config.get("vocab_size", tok.vocab_size)))
