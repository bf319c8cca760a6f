"""Accuracy cost of a 16-bit or quantized KV cache on a real model: `python -m pagoda.bench.kv_accuracy`.

For each KV cache layout (bfloat16 and float16; int8 and fp8, with scales per (token, kv head) or per
(block, kv head)), against the cache in the model dtype ("auto") on the same weights:

- Greedy top-1 agreement: the unquantized cache decodes N chat prompts greedily for L tokens each.
  Each quantized cache is then teacher-forced along those same trajectories, one token per sequence
  per step, batched as decodes (so per-block scales grow and re-quantize exactly as they do while
  generating), and its argmax at every generated position is compared with the reference token.
- Perplexity on a text corpus that ships with the machine (Debian's license texts): prompt logprobs
  through the engine (`SamplingParams(prompt_logprobs=1)`, the prefill path a long prompt takes),
  over windows of W tokens; also the top-1 agreement of those prefill predictions with "auto".
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pagoda.config import DEFAULT_MODEL
from pagoda.entrypoints.llm import LLM
from pagoda.layers.attention import AttentionMetadata
from pagoda.layers.attention.backend import build_attention_metadata
from pagoda.model.llama import ArchConfig, LlamaForCausalLM
from pagoda.sampling_params import SamplingParams
from pagoda.worker.kv_cache import allocate_kv_cache, plan_kv_cache

KVLayout = tuple[str, str]  # (kv_cache_dtype, kv_cache_scale_granularity)
LAYOUTS: list[KVLayout] = [("bfloat16", "token"), ("float16", "token"), ("int8", "token"), ("int8", "block"),
                           ("fp8", "token"), ("fp8", "block")]  # the granularity of a 16-bit cache is unused
REFERENCE: KVLayout = ("auto", "token")
DEFAULT_CORPUS = ["/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0"]
PROMPTS = [
    "Explain how a refrigerator works.", "Write a short story about a lighthouse keeper.",
    "What are the main causes of inflation?", "Describe the water cycle step by step.",
    "Give me advice for learning to play the guitar.", "Why do leaves change color in autumn?",
    "Summarize the plot of a heist movie you invent.", "How does a compiler turn code into a program?",
    "Write a letter to a friend about a trip to the mountains.", "What is photosynthesis?",
    "Compare cats and dogs as pets.", "Explain the rules of chess to a beginner.",
    "Describe a busy market in the morning.", "How do vaccines train the immune system?",
    "Plan a healthy week of dinners.", "What happened during the industrial revolution?",
]


@dataclass
class LayoutResult:
    kv_cache: str  # e.g. "int8 per token"
    bytes_per_token: float
    capacity_vs_auto: float  # tokens that fit in the same budget, relative to the unquantized cache
    greedy_agreement: float  # share of generated positions whose argmax matches the reference token
    greedy_positions: int
    perplexity: float
    perplexity_change_pct: float
    mean_abs_logprob_change: float  # over the corpus positions: a steadier signal than the perplexity
    corpus_agreement: float  # prefill argmax vs the unquantized cache's, over the corpus positions
    corpus_positions: int
    seconds: float


# ---- teacher-forced decoding ------------------------------------------------------------------

def decode_metadata(tables: torch.Tensor, pos: int, block_size: int) -> AttentionMetadata:
    """Every row of tables (B, num_blocks) decodes the token at position pos."""
    used = tables[:, : pos // block_size + 1]
    return build_attention_metadata([(row.tolist(), pos, 1) for row in used], block_size)


@torch.inference_mode()
def decode_along(model: LlamaForCausalLM, arch: ArchConfig, dtype: torch.dtype, layout: KVLayout,
                 prompts: list[list[int]], gen_len: int, forced: list[list[int]] | None,
                 block_size: int = 16) -> list[list[int]]:
    """Feed every sequence one token per step (all batched as decodes) and return, per sequence, the
    argmax at each of its gen_len generated positions. The token fed after the prompt is forced[i][j]
    when given (teacher forcing), else the argmax itself (greedy decoding)."""
    lens = [len(p) + gen_len for p in prompts]
    blocks_per_seq = -(-max(lens) // block_size)
    probe = plan_kv_cache(arch, dtype, block_size, 1 << 40, *layout)
    plan = plan_kv_cache(arch, dtype, block_size, probe.bytes_per_block * len(prompts) * blocks_per_seq, *layout)
    caches = allocate_kv_cache(arch, plan, dtype)
    tables = torch.arange(len(prompts) * blocks_per_seq).view(len(prompts), blocks_per_seq)
    tokens = [list(p) for p in prompts]
    preds: list[list[int]] = [[] for _ in prompts]
    for pos in range(max(lens) - 1):  # the token at pos predicts position pos + 1
        active = [i for i, n in enumerate(lens) if pos < n - 1]
        ids = torch.tensor([tokens[i][pos] for i in active])
        meta = decode_metadata(tables[active], pos, block_size)
        hidden = model(ids, torch.full((len(active),), pos), caches, meta)
        argmax = model.compute_logits(hidden).argmax(dim=-1).tolist()
        for i, pred in zip(active, argmax, strict=True):
            j = pos + 1 - len(prompts[i])  # index of the generated position predicted
            if j < 0:
                continue
            preds[i].append(pred)
            tokens[i].append(forced[i][j] if forced is not None else pred)
    return preds


# ---- perplexity through the engine ------------------------------------------------------------

def corpus_windows(encode: Callable[[str], list[int]], paths: list[str], window: int, num_windows: int
                   ) -> list[list[int]]:
    """The files' tokens, cut into num_windows windows of window tokens."""
    ids: list[int] = []
    for p in paths:
        ids.extend(encode(Path(p).read_text(encoding="utf-8")))
    windows = [ids[i: i + window] for i in range(0, len(ids) - window + 1, window)][:num_windows]
    if len(windows) < num_windows:
        raise ValueError(f"the corpus has {len(ids)} tokens: fewer than {num_windows} windows of {window}")
    return windows


def prompt_scores(llm: LLM, windows: list[list[int]]) -> tuple[list[float], list[int]]:
    """Logprob of every actual next token and the argmax, at every corpus position after the first."""
    outs = llm.generate(windows, SamplingParams(prompt_logprobs=1, max_tokens=1), use_tqdm=False)
    logprobs, top1 = [], []
    for out, ids in zip(outs, windows, strict=True):
        assert out.prompt_logprobs is not None
        for pos in range(1, len(ids)):
            entry = out.prompt_logprobs[pos]
            assert entry is not None
            logprobs.append(entry[ids[pos]])
            top1.append(max(entry, key=lambda t: entry[t]))
    return logprobs, top1


# ---- the measurement --------------------------------------------------------------------------

@dataclass
class Reference:
    generated: list[list[int]]
    perplexity: float
    logprobs: list[float]
    top1: list[int]
    num_tokens: int  # KV capacity in tokens of the reference cache


def measure(args: argparse.Namespace) -> tuple[Reference, list[LayoutResult]]:
    results: list[LayoutResult] = []
    ref: Reference | None = None
    prompts: list[list[int]] = []
    windows: list[list[int]] = []
    for layout in [REFERENCE, *args.layouts]:
        start = time.perf_counter()
        llm = LLM(args.model, dtype=args.dtype, kv_cache_dtype=layout[0], kv_cache_scale_granularity=layout[1],
                  kv_cache_memory=args.kv_cache_memory)
        eng = llm.engine
        if ref is None:
            tok = llm.get_tokenizer()
            prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
                       for p in PROMPTS[: args.num_prompts]]
            windows = corpus_windows(tok.encode, args.corpus, args.window, args.num_windows)
        dtype = eng.config.model.torch_dtype
        forced = None if ref is None else ref.generated
        preds = decode_along(eng.model, eng.arch, dtype, layout, prompts, args.gen_len, forced)
        logprobs, top1 = prompt_scores(llm, windows)
        ppl = math.exp(-sum(logprobs) / len(logprobs))
        plan = eng.limits.kv
        if ref is None:
            ref = Reference(preds, ppl, logprobs, top1, plan.num_tokens)
        results.append(LayoutResult(
            kv_cache=plan.spec.name, bytes_per_token=plan.bytes_per_token,
            capacity_vs_auto=plan.num_tokens / ref.num_tokens,
            greedy_agreement=_agreement(sum(preds, []), sum(ref.generated, [])),
            greedy_positions=sum(map(len, preds)), perplexity=ppl,
            perplexity_change_pct=100 * (ppl / ref.perplexity - 1),
            mean_abs_logprob_change=_mean_abs_diff(logprobs, ref.logprobs),
            corpus_agreement=_agreement(top1, ref.top1), corpus_positions=len(top1),
            seconds=time.perf_counter() - start))
        print(json.dumps(asdict(results[-1])), flush=True)
        del llm, eng
        gc.collect()
    assert ref is not None
    return ref, results


def _agreement(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def _mean_abs_diff(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def report(results: list[LayoutResult]) -> str:
    lines = ["| KV cache | bytes/token | tokens vs auto | greedy top-1 agreement (positions) | perplexity "
             "| change | mean abs logprob change | corpus top-1 agreement (positions) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.kv_cache} | {r.bytes_per_token:g} | {r.capacity_vs_auto:.2f}x "
                     f"| {100 * r.greedy_agreement:.2f}% ({r.greedy_positions}) | {r.perplexity:.4f} "
                     f"| {r.perplexity_change_pct:+.2f}% | {r.mean_abs_logprob_change:.4f} "
                     f"| {100 * r.corpus_agreement:.2f}% ({r.corpus_positions}) |")
    return "\n".join(lines)


def parse_layout(value: str) -> KVLayout:
    dtype, _, granularity = value.partition(":")
    if dtype in ("bfloat16", "float16") and not granularity:
        return dtype, "token"
    if dtype not in ("int8", "fp8") or granularity not in ("token", "block"):
        raise argparse.ArgumentTypeError(f"expected bfloat16, float16 or int8|fp8:token|block, got {value!r}")
    return dtype, granularity


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pagoda.bench.kv_accuracy", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto", help="model dtype (auto = float32 on CPU)")
    p.add_argument("--layouts", type=parse_layout, nargs="+", default=LAYOUTS,
                   help="KV layouts to compare with auto, e.g. bfloat16 int8:token fp8:block")
    p.add_argument("--num-prompts", type=int, default=16, help=f"greedy prompts (at most {len(PROMPTS)})")
    p.add_argument("--gen-len", type=int, default=128, help="generated tokens per prompt")
    p.add_argument("--corpus", nargs="+", default=DEFAULT_CORPUS, help="text files for the perplexity")
    p.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    p.add_argument("--num-windows", type=int, default=4)
    p.add_argument("--kv-cache-memory", default="512MiB", help="engine KV budget for the perplexity runs")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's; 1 is faster on a CPU shared with other jobs)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON list")
    return p


def main() -> None:
    args = build_parser().parse_args()
    if not 1 <= args.num_prompts <= len(PROMPTS):
        raise SystemExit(f"--num-prompts must be in [1, {len(PROMPTS)}]")
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    _, results = measure(args)
    if args.json:
        print(json.dumps([asdict(r) for r in results]))
    else:
        print(report(results))
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
