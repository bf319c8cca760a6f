"""Benchmark workloads, shared by `bench throughput` and (later) `bench serve`.

Each yields `BenchRequest`s: a prompt (token ids, or text for chat-style files) and the number of
tokens to generate. Token-id prompts avoid tokenizer round-trip drift between engines.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("random", "prefix", "file", "sharegpt")


@dataclass
class BenchRequest:
    prompt: list[int] | str
    output_len: int


@dataclass(frozen=True)
class WorkloadSpec:
    dataset: str = "random"
    num_prompts: int = 64
    input_len: tuple[int, int] = (128, 512)
    output_len: int = 128
    prefix_len: int = 1024  # `prefix`: shared system prompt length; input_len is then the suffix
    path: str | None = None  # `file` (JSONL with "prompt") or `sharegpt` (JSON)
    seed: int = 0


def _ordinary_ids(vocab_size: int, special: frozenset[int]) -> list[int]:
    return [t for t in range(vocab_size) if t not in special]


def make_workload(spec: WorkloadSpec, vocab_size: int, special: frozenset[int]) -> list[BenchRequest]:
    rng = random.Random(spec.seed)
    if spec.dataset == "random":
        ids = _ordinary_ids(vocab_size, special)
        return [BenchRequest([rng.choice(ids) for _ in range(rng.randint(*spec.input_len))], spec.output_len)
                for _ in range(spec.num_prompts)]
    if spec.dataset == "prefix":
        ids = _ordinary_ids(vocab_size, special)
        system = [rng.choice(ids) for _ in range(spec.prefix_len)]
        return [BenchRequest(system + [rng.choice(ids) for _ in range(rng.randint(*spec.input_len))],
                             spec.output_len) for _ in range(spec.num_prompts)]
    if spec.dataset in ("file", "sharegpt"):
        if not spec.path:
            raise ValueError(f"dataset {spec.dataset!r} needs --dataset-path")
        texts = _read_texts(Path(spec.path), spec.dataset)
        if not texts:
            raise ValueError(f"no prompts found in {spec.path}")
        rng.shuffle(texts)
        return [BenchRequest(texts[i % len(texts)], spec.output_len) for i in range(spec.num_prompts)]
    raise ValueError(f"dataset must be one of {', '.join(DATASETS)}; got {spec.dataset!r}")


def _read_texts(path: Path, kind: str) -> list[str]:
    if kind == "file":
        out = []
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                obj = json.loads(line)
                if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                    raise ValueError(f"{path}: each JSONL line needs a string 'prompt' field")
                out.append(obj["prompt"])
        return out
    # ShareGPT: [{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}, ...]
    data = json.loads(path.read_text(encoding="utf-8"))
    texts = []
    for item in data:
        convs = item.get("conversations") or item.get("conversation") or []
        if convs and isinstance(convs[0], dict) and isinstance(convs[0].get("value"), str):
            texts.append(convs[0]["value"])
    return texts
