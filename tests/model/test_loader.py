"""load_model's on_loaded hook: each module handed over once all of its own parameters hold their checkpoint's values
(a tied lm_head right after the embedding, whose weight it is), while the rest still loads, and nothing in the loader
keeping a parameter the hook replaced alive (the engine packs each layer there: the float model is then never resident
at once); a whole tensor of the model's dtype becomes its parameter without a copy."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from pagoda.layers.attention import get_attention_backend
from pagoda.layers.linear import prepack_linears, tiles_of
from pagoda.layers.q4_linear import packed_of, quantize_linears
from pagoda.layers.tied_embedding import free_weight
from pagoda.model import loader
from pagoda.model.loader import load_model


def _load(path: Path, on_loaded: loader.ModuleLoaded | None = None) -> nn.Module:
    return load_model(str(path), torch.float32, get_attention_backend("torch"), on_loaded=on_loaded).model


def test_each_module_is_handed_over_once_its_weights_are_in(tiny_model: tuple[str, Path],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    _, path = tiny_model
    reference = _load(path)
    seen: list[str] = []
    events: list[tuple[str, str]] = []  # ("read", checkpoint name) and ("hook", module name), in order
    read_source = loader._read_source

    def reading(*args: object) -> object:
        config, tokenizer, tensors = read_source(*args)  # type: ignore[arg-type]
        return config, tokenizer, ((events.append(("read", n)), (n, t))[1] for n, t in tensors)

    def check(model: nn.Module, name: str, module: nn.Module) -> None:
        assert module is model.get_submodule(name)
        for pname, p in module.named_parameters(recurse=False):
            assert torch.equal(p, reference.get_parameter(f"{name}.{pname}")), f"{name}.{pname}"
        seen.append(name)
        events.append(("hook", name))

    monkeypatch.setattr(loader, "_read_source", reading)
    model = _load(path, check)
    with_params = [name for name, m in model.named_modules() if next(m.parameters(recurse=False), None) is not None]
    assert sorted(seen) == sorted(with_params)  # each once
    if model.config.tie_word_embeddings:  # the lm_head's weight is loaded with the embedding
        assert seen.index("lm_head") == seen.index("model.embed_tokens") + 1
    # each module right after its last tensor's read, before the next read: while the rest still loads
    for i, (kind, name) in enumerate(events):
        if kind == "hook" and name != "lm_head":
            before = next(n for k, n in reversed(events[:i]) if k == "read")
            parts = [n for n, (t, _) in model.checkpoint_parameters().items() if t.rpartition(".")[0] == name]
            assert before in parts, (name, before)
    assert events[-1][0] == "hook" and sum(k == "read" for k, _ in events) > 1


def test_a_parameter_the_hook_replaces_is_freed_there(tiny_model: tuple[str, Path]) -> None:
    """The engine's use: a layer's float weight freed by its hook is gone before the next module's turn (the loader had
    held every parameter to its end: the q4_1 start-up then peaked at 1,234 MiB, 877 without)."""
    _, path = tiny_model
    dropped: list[weakref.ref[torch.Tensor]] = []

    def replace(model: nn.Module, name: str, module: nn.Module) -> None:
        assert all(r() is None for r in dropped), "a weight freed by an earlier call is still alive"
        if isinstance(module, nn.Linear) and name != "lm_head":
            dropped.append(weakref.ref(module.weight))
            free_weight(module)

    _load(path, replace)
    assert dropped


def test_quantizing_each_layer_as_it_loads_packs_the_same_bytes(tiny_model: tuple[str, Path]) -> None:
    """The engine's --quantization: the decoder's layers quantized by the hook, the rest after the load, the same
    packed weights as quantizing the loaded model, with their float copies freed."""
    _, path = tiny_model
    after = _load(path)
    quantize_linears(after, "q4_1")
    during = _load(path, lambda model, name, _: quantize_linears(model, "q4_1", only=name))
    quantize_linears(during, "q4_1")
    names = [name for name, m in after.named_modules() if packed_of(m) is not None]
    assert any(".mlp." in name for name in names)
    assert names == [name for name, m in during.named_modules() if packed_of(m) is not None]
    for name in names:
        layer = during.get_submodule(name)
        assert torch.equal(packed_of(layer).w, packed_of(after.get_submodule(name)).w), name
        assert layer.weight.numel() == 0, name


def test_tiling_each_layer_as_it_loads_packs_the_same_tiles(tiny_model: tuple[str, Path]) -> None:
    """The engine's float32 default: the layers packed for the tile kernels by the hook (a tied lm_head with the
    embedding, which then reads its rows from the tiles), the same tiles as packing the loaded model."""
    _, path = tiny_model
    after = _load(path)
    prepack_linears(after)
    during = _load(path, lambda model, name, _: prepack_linears(model, only=name))
    names = [name for name, m in after.named_modules() if tiles_of(m) is not None]
    assert "lm_head" in names
    assert names == [name for name, m in during.named_modules() if tiles_of(m) is not None]
    for name in names:
        assert torch.equal(tiles_of(during.get_submodule(name)), tiles_of(after.get_submodule(name))), name
        assert during.get_submodule(name).weight.numel() == 0, name
    ids = torch.tensor([0, 5, 299])
    assert torch.equal(during.model.embed_tokens(ids), after.model.embed_tokens(ids))


def test_a_tensor_twice_in_the_checkpoint_is_refused(tiny_model: tuple[str, Path]) -> None:
    _, path = tiny_model
    model = _load(path)
    name, param = next((n, p) for n, p in model.named_parameters() if n.endswith("input_layernorm.weight"))
    with pytest.raises(ValueError, match="appears twice"):
        loader._load_weights(model, iter([(name, param.detach().clone())] * 2))


def test_a_whole_tensor_of_the_models_dtype_becomes_the_parameter(tiny_model: tuple[str, Path]) -> None:
    """No second copy where the checkpoint's tensor can be the parameter (all of it, the dtype, memory of its own on a
    64-byte boundary); a part of a merged projection, another dtype or a view into a larger buffer is copied in."""
    _, path = tiny_model
    model = _load(path)
    norm = next(n for n, _ in model.named_parameters() if n.endswith("input_layernorm.weight"))
    shape = model.get_parameter(norm).shape
    whole = torch.randn(shape)
    checkpoint = {n: model.get_parameter(t)[rows].detach().clone()
                  for n, (t, rows) in model.checkpoint_parameters().items()}
    checkpoint[norm] = whole
    view = torch.randn(16 + shape.numel())[16:]  # 64 bytes into a larger allocation: aligned, not its own
    other = next(n for n in checkpoint if n.endswith("post_attention_layernorm.weight"))
    checkpoint[other] = view
    q = next(n for n in checkpoint if n.endswith("self_attn.q_proj.weight"))
    wide = torch.randn(model.get_parameter("model.norm.weight").shape, dtype=torch.float64)
    checkpoint["model.norm.weight"] = wide
    if model.config.tie_word_embeddings:
        del checkpoint["lm_head.weight"]
    loader._load_weights(model, iter(checkpoint.items()))
    assert model.get_parameter(norm).data_ptr() == whole.data_ptr()
    assert model.get_parameter(other).data_ptr() != view.data_ptr() and torch.equal(model.get_parameter(other), view)
    qkv = model.get_parameter(model.checkpoint_parameters()[q][0])
    assert qkv.data_ptr() != checkpoint[q].data_ptr() and torch.equal(qkv[:len(checkpoint[q])], checkpoint[q])
    final = model.get_parameter("model.norm.weight")
    assert final.dtype == torch.float32 and torch.equal(final, wide.float())
