"""`pagoda bench throughput --backend hf`: HF transformers `generate` on static batches.

The baseline the PagedAttention paper beat: requests go in fixed batches of --hf-batch-size,
left-padded to the longest prompt; a batch ends when its longest request does, and the next batch
waits for it. min_new_tokens = max_new_tokens, so every request generates exactly its output_len,
as ignore_eos does in the other backends. Same workload (same token ids) as the pagoda backend.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from tqdm import tqdm

from pagoda.bench.common import load_tokenizer, workload_spec
from pagoda.bench.datasets import BenchRequest, make_workload


def token_id_workload(args: argparse.Namespace, model: str) -> tuple[list[list[int]], list[int], int | None]:
    """The workload as token ids (text prompts encoded with the model's tokenizer, as the pagoda
    backend does), their output lengths, and the tokenizer's EOS id."""
    tok, vocab_size = load_tokenizer(model)
    work: list[BenchRequest] = make_workload(workload_spec(args), vocab_size, tok.all_special_ids)
    prompts = [w.prompt if isinstance(w.prompt, list) else tok.encode(w.prompt) for w in work]
    return prompts, [w.output_len for w in work], tok.eos_token_id


def load_hf_model(model: str, dtype: torch.dtype) -> Any:
    """A HF folder, or a GGUF file (transformers dequantizes it; needs accelerate)."""
    from transformers import AutoModelForCausalLM

    from pagoda.model.loader import resolve_model_path

    path = resolve_model_path(model)
    if path.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return hf.eval()


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, longest) input ids and attention mask, padded on the left so that every prompt
    ends at the last column and generation continues from there."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p):] = 1
    return ids, mask


def _first_token_clock() -> tuple[Any, list[float]]:
    """A stopping criterion that never stops but records when the batch's first token is out:
    `generate` calls it after every step, the first call right after the prefill's token."""
    from transformers import StoppingCriteria

    stamps: list[float] = []

    class FirstToken(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            if not stamps:
                stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return FirstToken(), stamps


@torch.inference_mode()
def generate_batch(hf: Any, prompts: list[list[int]], new_tokens: int, pad_id: int, eos_id: int | None,
                   seed: int) -> tuple[int, float | None]:
    """Generate exactly `new_tokens` for every prompt of one static batch; returns the number of
    generated tokens and when the first one came out (perf_counter)."""
    from transformers import GenerationConfig, StoppingCriteriaList

    ids, mask = left_pad(prompts, pad_id)
    # Pure sampling at temperature 1, like the pagoda backend: HF's default top_k=50 is switched off.
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                              temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad_id, eos_token_id=eos_id)
    criterion, stamps = _first_token_clock()
    torch.manual_seed(seed)
    out = hf.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                      stopping_criteria=StoppingCriteriaList([criterion]))
    return int(out.shape[0] * (out.shape[1] - ids.shape[1])), (stamps[0] if stamps else None)


def run_hf_throughput(args: argparse.Namespace, model: str, dtype: str = "auto") -> dict[str, Any]:
    from pagoda.bench.throughput import summarize

    if args.hf_batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {args.hf_batch_size}")
    torch_dtype = torch.float32 if dtype == "auto" else getattr(torch, dtype)
    prompts, output_lens, eos_id = token_id_workload(args, model)
    hf = load_hf_model(model, torch_dtype)
    pad_id = eos_id if eos_id is not None else 0
    size = args.hf_batch_size
    output_tokens, ttft = 0, []
    start = time.perf_counter()
    for b in tqdm(range(0, len(prompts), size), desc="hf batches", disable=args.json):
        batch, lens = prompts[b:b + size], output_lens[b:b + size]
        # A static batch runs to its longest output; only the tokens each request asked for count.
        _, first = generate_batch(hf, batch, max(lens), pad_id, eos_id, args.seed + b)
        output_tokens += sum(lens)
        if first is not None:  # every request of the batch arrived at `start`
            ttft += [first - start] * len(batch)
    elapsed = time.perf_counter() - start
    result = summarize("hf", args, model, len(prompts), sum(len(p) for p in prompts), output_tokens, elapsed, ttft)
    result["hf_batch_size"] = size
    return result
