"""Accuracy of a model dtype, or of float32 with --quantization q4_1 or q8_0, against float32 on the default model:
perplexity on a text corpus that ships with the machine and the top-1 agreement of every next-token prediction
(teacher-forced).

    python -m pagoda.bench.dtype_accuracy --dtype bfloat16
    python -m pagoda.bench.dtype_accuracy --quantization q4_1
"""

from __future__ import annotations

import argparse
import json
import math

from pagoda import LLM
from pagoda.bench.kv_accuracy import DEFAULT_CORPUS, corpus_windows, prompt_scores
from pagoda.config import QUANTIZATIONS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default=None, help="default: bfloat16, or float32 with --quantization")
    p.add_argument("--quantization", default="none", choices=QUANTIZATIONS)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--num-windows", type=int, default=4)
    args = p.parse_args()
    dtype = args.dtype or ("float32" if args.quantization != "none" else "bfloat16")
    label = dtype if args.quantization == "none" else f"{dtype}+{args.quantization}"
    scores = {}
    for name, options in (("float32", {"dtype": "float32"}),
                          (label, {"dtype": dtype, "quantization": args.quantization})):
        llm = LLM(args.model, kv_cache_memory="256MiB", **options)
        windows = corpus_windows(llm.get_tokenizer().encode, DEFAULT_CORPUS[:1], args.window, args.num_windows)
        scores[name] = prompt_scores(llm, windows)
    (ref_lp, ref_top), (lp, top) = scores["float32"], scores[label]
    ppl = {d: math.exp(-sum(s[0]) / len(s[0])) for d, s in scores.items()}
    print(json.dumps({
        "dtype": label, "positions": len(ref_lp),
        "perplexity_float32": ppl["float32"], f"perplexity_{label}": ppl[label],
        "perplexity_change": ppl[label] / ppl["float32"] - 1,
        "top1_agreement": sum(a == b for a, b in zip(ref_top, top, strict=True)) / len(top),
        "mean_abs_logprob_change": sum(abs(a - b) for a, b in zip(ref_lp, lp, strict=True)) / len(lp),
    }))


if __name__ == "__main__":
    main()
