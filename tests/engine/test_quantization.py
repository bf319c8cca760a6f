"""`quantization="q4_1"` through the engine, on the default model: every decoder linear runs the Q4_1 kernel and
the lm_head the Q8_0 one on the file's own weights (checked layer by layer against tests/layers/test_q4_linear.py's
float64 references), and the whole model's teacher-forced predictions sit as far from float32's as transformers'
do with the same arithmetic patched into its linears; and the settings it refuses.

Not token for token against transformers: rounding each layer's input to int8 turns last-bit differences between
two float32 implementations into a step of one int8 value here and there, and those grow through the 30 layers
into noise of their own. Measured when this was written (the lm_head still float32), mean |logprob change| on
299 positions of text: transformers with the reference arithmetic against float32 0.109 (93.6% same top-1), the
engine's q4_1 against float32 0.116 (95.7%), and the two q4_1 sides against each other 0.140 (93.3%): as far
apart as two independent roundings. (bfloat16 weights and activations, for scale: 97% same top-1, BENCHMARKS.md.)
Where the CPU has AMX tiles, Q4_1 steps of 20 rows or more (the 299-token prompt here) compute in bfloat16
instead (q4_gemm.cpp, q4amx), and the reference follows: both sides then sit ~0.03 from float32.

`quantization="q8_0"` (8-bit weights for every linear) is checked the same way, layer by layer and for its distance
from float32 (test_q8_0_on_the_default_model)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pagoda import LLM
from pagoda.bench.kv_accuracy import prompt_scores
from pagoda.layers.q4_linear import (
    Q4Linear,
    Q8Linear,
    amx_min_rows,
    is_quantized,
    packed_of,
    q4_library,
    quantize_q4_1,
    quantize_q8_0,
)
from pagoda.layers.tied_embedding import TiedEmbedding
from pagoda.model.loader import resolve_model_path
from tests.engine.test_smollm2 import corpus_text
from tests.layers.test_q4_linear import reference_bf16_linear, reference_linear, reference_q8_linear

TOKENS = 300


def reference_forward(layer: nn.Linear, lm_head: bool = False) -> Any:
    """The float64 reference of the layer's arithmetic under q4_1: Q8_0 weights for the lm_head, Q4_1 else, and
    for steps of amx_min_rows rows or more on a CPU with AMX tiles, the tiles' bfloat16 arithmetic."""
    if lm_head:
        q8, d8 = quantize_q8_0(layer.weight)
    else:
        q, d, m = quantize_q4_1(layer.weight)
    amx_rows = amx_min_rows(q4_library())

    def forward(x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).float()
        tiles = bool(amx_rows) and x2.shape[0] >= amx_rows
        if lm_head:
            y = (reference_bf16_linear(x2, q8, d8, None, layer.bias) if tiles
                 else reference_q8_linear(x2, q8, d8, layer.bias))
        elif tiles:
            y = reference_bf16_linear(x2, q, d, m, layer.bias)
        else:
            y = reference_linear(x2, q, d, m, layer.bias)
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)

    return forward


def decoder_linears(plain: LLM, quantized: LLM) -> list[tuple[str, nn.Linear, nn.Linear]]:
    """(name, float layer, quantized layer) for each of the decoder's linears, all 4 a layer checked present."""
    pairs = zip(plain.engine.model.model.named_modules(), quantized.engine.model.model.named_modules(), strict=True)
    linears = [(name, a, b) for (name, a), (_, b) in pairs if isinstance(a, nn.Linear)]
    assert len(linears) == 4 * quantized.engine.arch.num_layers
    return linears


@pytest.mark.slow
def test_q4_1_on_the_default_model() -> None:
    from transformers import AutoModelForCausalLM

    path = resolve_model_path("smollm2-135m-instruct")
    plain = LLM(kv_cache_memory="64MiB", prepack_weights=False)  # its float weights stay (the tiles free them)
    q4 = LLM(quantization="q4_1", kv_cache_memory="64MiB")
    # prompts over q4_1's float16 cache may take the AMX tiles (CppAttentionBackend.bf16_prompts), float32's may not
    assert q4.engine.model.backend.bf16_prompts and not plain.engine.model.backend.bf16_prompts
    # every decoder linear is quantized, from the file's weights, and computes the reference arithmetic
    g = torch.Generator().manual_seed(0)
    for name, float_layer, q4_layer in decoder_linears(plain, q4):
        assert isinstance(packed_of(q4_layer), Q4Linear) and q4_layer.weight.numel() == 0, name
        x = torch.randn(5, float_layer.in_features, generator=g)
        want = reference_linear(x, *quantize_q4_1(float_layer.weight), None)
        torch.testing.assert_close(q4_layer(x).double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    lm_head = q4.engine.model.lm_head
    assert is_quantized(lm_head) and not isinstance(packed_of(lm_head), Q4Linear)
    x = torch.randn(3, lm_head.in_features, generator=g)
    want = reference_q8_linear(x, *quantize_q8_0(plain.engine.model.lm_head.weight), None)
    torch.testing.assert_close(lm_head(x).double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))

    ids = q4.get_tokenizer().encode(corpus_text())[:TOKENS]
    targets = torch.tensor(ids[1:])
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.inference_mode():
        hf_float = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].double(), dim=-1)
        for module in hf.model.modules():  # the decoder's layers
            if isinstance(module, nn.Linear):
                module.forward = reference_forward(module)  # type: ignore[method-assign]
        hf.lm_head.forward = reference_forward(hf.lm_head, lm_head=True)  # type: ignore[method-assign]
        hf_q4 = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].double(), dim=-1)

    def scores(lp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return lp.gather(1, targets[:, None])[:, 0], lp.argmax(-1)

    def engine_scores(llm: LLM) -> tuple[torch.Tensor, torch.Tensor]:
        lp, top = prompt_scores(llm, [ids])
        return torch.tensor(lp, dtype=torch.float64), torch.tensor(top)

    def change(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
        return float((a[0] - b[0]).abs().mean()), float((a[1] == b[1]).double().mean())

    ref_change, ref_agree = change(scores(hf_q4), scores(hf_float))
    q4_change, q4_agree = change(engine_scores(q4), engine_scores(plain))
    # the reference's own distance from float32 is 0.109 (93.6% top-1) in int8 activations, 0.03 in the AMX tiles'
    # bfloat16: a layer left in float32 or quantized wrongly would move the engine's far from it
    assert 0.6 * ref_change < q4_change < 1.6 * ref_change, (q4_change, ref_change)
    assert q4_agree >= 0.9, (q4_agree, ref_agree)


@pytest.mark.slow
def test_q8_0_on_the_default_model() -> None:
    """quantization="q8_0": every decoder linear runs Q8_0 weights (the file's Q4_1 weights re-quantized to 8 bits)
    computing the reference arithmetic, and the teacher-forced predictions stay close to float32's. Measured on
    2,044 positions (`bench.dtype_accuracy --quantization q8_0`, BENCHMARKS.md): 96.3% same top-1, mean |logprob
    change| 0.079 (q4_1: 92.8%, 0.139); a layer computing the wrong thing drops far below the bounds here. The
    lm_head's Q8_0 records are the file's embedding, so the embedding reads its rows from them, the same values."""
    plain = LLM(kv_cache_memory="64MiB", prepack_weights=False)  # its float weights stay (the tiles free them)
    q8 = LLM(quantization="q8_0", kv_cache_memory="64MiB")
    g = torch.Generator().manual_seed(1)
    lm_head = ("lm_head", plain.engine.model.lm_head, q8.engine.model.lm_head)
    for name, float_layer, q8_layer in [*decoder_linears(plain, q8), lm_head]:
        assert isinstance(packed_of(q8_layer), Q8Linear), name
        assert q8_layer.weight.numel() == 0, name  # the lm_head's too: its Q8_0 records hold the file's embedding
        x = torch.randn(3, float_layer.in_features, generator=g)
        want = reference_q8_linear(x, *quantize_q8_0(float_layer.weight), None)
        torch.testing.assert_close(q8_layer(x).double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    ids = q8.get_tokenizer().encode(corpus_text())[:TOKENS]
    embed = q8.engine.model.model.embed_tokens  # reads its rows from the lm_head's records: the file's, exactly
    assert isinstance(embed, TiedEmbedding) and torch.equal(embed(torch.tensor(ids)),
                                                             plain.engine.model.model.embed_tokens(torch.tensor(ids)))
    (lp, top), (ref_lp, ref_top) = prompt_scores(q8, [ids]), prompt_scores(plain, [ids])
    change = float((torch.tensor(lp) - torch.tensor(ref_lp)).abs().mean())
    agree = float((torch.tensor(top) == torch.tensor(ref_top)).double().mean())
    assert change < 0.12 and agree >= 0.93, (change, agree)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"quantization": "int3"}, "quantization must be one of none, q4_1, q8_0"),
    ({"quantization": "q4_1", "dtype": "bfloat16"}, "needs dtype float32"),
    ({"quantization": "q4_1", "compile_model": True}, "quantization and compile_model cannot be combined"),
])
def test_q4_1_settings_it_refuses(kwargs: dict[str, Any], message: str) -> None:
    from pagoda.config import ModelConfig

    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)
