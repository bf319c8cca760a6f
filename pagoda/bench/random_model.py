"""A model in the shape of a published one, with random weights, saved as a Hugging Face folder with a byte-level
tokenizer: an engine's speed does not depend on the weights' values, so architectures whose weights this machine
cannot download (no model hub here) can still be timed end to end (BENCHMARKS.md, "Qwen3 in the one-call forward").

    python -m pagoda.bench.random_model --shape qwen3-0.6b /tmp/qwen3-06b
    pagoda bench throughput --model /tmp/qwen3-06b --num-prompts 1 --input-len 64:64 --output-len 400

The tokenizer knows 256 bytes and two specials (ids 256, 257: BOS and EOS); the model's other ids decode to nothing,
which the benchmarks' random prompts and ignore_eos do not mind. Needs transformers (a test and benchmark
dependency). --num-layers and --vocab-size shrink a shape (the tests build a one-layer one)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

# The published configs' shapes (config.json of each model), the weights' dtype they are published in
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       tie_word_embeddings=True, torch_dtype="bfloat16"),
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                         tie_word_embeddings=True, torch_dtype="bfloat16"),
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                         tie_word_embeddings=True, torch_dtype="bfloat16"),
}
BOS, EOS = 256, 257


def write_byte_tokenizer(folder: Path) -> None:
    """A byte-level tokenizer (no merges): any text encodes, ids < 256 are bytes; BOS and EOS 256 and 257; a chat
    template of role tags."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])  # ids 256, 257
    tok.save(str(folder / "tokenizer.json"))
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}))


def build(shape: str, folder: Path, num_layers: int | None = None, vocab_size: int | None = None,
          seed: int = 0) -> int:
    """The shape's model with random weights (transformers' initialization, seeded) saved to folder; its number of
    parameters."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(SHAPES[shape])
    if num_layers is not None:
        spec["num_hidden_layers"] = num_layers
    if vocab_size is not None:
        spec["vocab_size"] = vocab_size
    dtype = getattr(torch, spec.pop("torch_dtype"))
    cfg = AutoConfig.for_model(spec.pop("model_type"), bos_token_id=BOS, eos_token_id=EOS, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_byte_tokenizer(folder)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--vocab-size", type=int)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    params = build(args.shape, args.folder, args.num_layers, args.vocab_size, args.seed)
    print(json.dumps({"shape": args.shape, "folder": str(args.folder), "parameters": params}))


if __name__ == "__main__":
    main()
