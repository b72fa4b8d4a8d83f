"""Weight-only quantization: error bounds, int4 packing, the kernels, a quantized model, the engine."""

from __future__ import annotations

import copy
import platform
import time

import pytest
import torch

from minillm.speedups import gemv, quant
from minillm.model.config import ModelConfig
from minillm.engine import LLM, SamplingParams
from minillm.decoding.generate import generate_kv_cache, generate_naive
from minillm.model.gpt import GPT
from minillm.speedups.quant import (
    _TILE_PROBE,
    FUSED_MAX_ROWS,
    SCHEMES,
    QuantEmbedding,
    QuantLinear,
    cast_and_quantize,
    dequantize_int4,
    dequantize_int8,
    fused_kernel_works,
    kernels_used,
    model_bytes,
    pack_int4,
    quantize_int4,
    quantize_int8,
    quantize_model,
    unpack_int4,
)
from minillm.speedups.quant import _aten_int4_rows, _tile_from_probe


def weights(rows: int = 48, cols: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    w[3, 7] = 25.0  # an outlier: per-row and per-group scales must keep it from spoiling the rest
    return w


def test_int8_error_is_at_most_half_a_step_of_its_row() -> None:
    w = weights()
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.shape == (48,)
    err = (dequantize_int8(q, scales) - w).abs()
    assert (err <= scales[:, None] / 2 * (1 + 1e-5)).all()
    assert (q.abs().amax(dim=1) == 127).all()  # each row's largest weight uses the full range
    assert err[3].max() > 5 * err[4].max()  # the outlier's row pays for it; the others do not


@pytest.mark.parametrize("group_size", [16, 32, 64])
def test_int4_error_is_at_most_half_a_step_of_its_group(group_size: int) -> None:
    w = weights()
    packed, scales = quantize_int4(w, group_size)
    assert packed.dtype == torch.uint8 and packed.shape == (48, 64) and scales.shape == (48, 128 // group_size)
    err = (dequantize_int4(packed, scales, group_size) - w).abs().view(48, -1, group_size)
    assert (err <= scales[..., None] / 2 * (1 + 1e-5)).all()
    nibbles = unpack_int4(packed)
    assert int(nibbles.min()) >= 1 and int(nibbles.max()) <= 15  # q + 8 with q in [-7, 7]


def test_smaller_groups_give_smaller_error() -> None:
    w = weights(64, 256)
    errors = [(dequantize_int4(*quantize_int4(w, g), g) - w).pow(2).mean() for g in (16, 64, 256)]
    assert errors[0] < errors[1] < errors[2]


def test_int4_packing_round_trips_two_to_a_byte() -> None:
    nibbles = torch.randint(0, 16, (5, 34), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    packed = pack_int4(nibbles)
    assert packed.shape == (5, 17) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), nibbles)
    assert pack_int4(torch.tensor([[3, 12]])).item() == 3 | 12 << 4  # low nibble first
    with pytest.raises(ValueError, match="even number of columns"):
        pack_int4(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="group_size"):
        quantize_int4(torch.zeros(4, 96), 64)


def kernels(scheme: str) -> list[str]:
    """Both ways of multiplying where the fused kernel works here; dequantize everywhere."""
    return ["fused", "dequantize"] if fused_kernel_works(scheme, "cpu") else ["dequantize"]


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quant_linear_matches_its_own_dequantized_matrix(scheme: str) -> None:
    w, bias = weights(100, 64), torch.randn(100)  # 100 rows: not a multiple of aten's tiles
    for kernel in kernels(scheme):
        layer = QuantLinear.from_float(w, bias, scheme, 32, kernel=kernel)
        dense = layer.dequantized_weight()
        assert (dense - w).abs().max() < 2.0  # what the integers stand for is near the weights
        rows = torch.tensor([99, 0, 3, 64, 3])
        assert torch.equal(layer.weight_rows(rows), dense[rows])
        half = QuantLinear.from_float(w, bias, scheme, 32, kernel=kernel).to(torch.bfloat16)
        for n in (1, FUSED_MAX_ROWS + 5):  # the fused kernel (bf16 only), then the wide-batch path
            x = torch.randn(2, n, 64)
            torch.testing.assert_close(layer(x), x @ dense.T + bias, rtol=1e-4, atol=1e-4)
            expected = x.bfloat16().float() @ half.dequantized_weight().float().T + half.bias.float()
            torch.testing.assert_close(half(x.bfloat16()).float(), expected, rtol=0.02, atol=0.15)
    if len(kernels(scheme)) == 2:  # aten's layout and ours must hold the same numbers
        fused, plain = (QuantLinear.from_float(w, bias, scheme, 32, kernel=k) for k in ("fused", "dequantize"))
        assert torch.equal(fused.dequantized_weight(), plain.dequantized_weight())


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="checked on x86 CPUs only")
def test_the_fused_cpu_kernels_are_in_use_on_the_pinned_torch() -> None:
    """torch is pinned, and its CPU int8 and int4 kernels work on x86 whatever the vector width
    (AVX-512, AVX2, none), so a self-check that fails means our side broke. It would go unseen:
    the layer falls back to dequantizing, which computes the same numbers, only slower."""
    assert fused_kernel_works("int8", "cpu") and fused_kernel_works("int4", "cpu")
    for scheme in SCHEMES:
        assert QuantLinear.from_float(weights(100, 64), None, scheme, 32, kernel="auto").kernel == "fused"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_fused_layer_holds_the_rows_of_its_dequantizing_twin(scheme: str) -> None:
    """Forced to the fused kernel, whatever the self-check says: aten's layout must hold exactly the
    numbers ours does, at any rows asked for in any order, and its kernel must multiply by them.
    A wrong row lookup in that layout is otherwise seen only as a fast path quietly turned off."""
    w, bias = weights(200, 128, seed=3), torch.randn(200)  # 200 rows: several tiles, then padding
    fused = QuantLinear.from_float(w, bias, scheme, 32, kernel="fused")
    plain = QuantLinear.from_float(w, bias, scheme, 32, kernel="dequantize")
    assert fused.kernel == "fused" and plain.kernel == "dequantize"
    rows = torch.cat([torch.randperm(200, generator=torch.Generator().manual_seed(4)), torch.tensor([199, 0, 199, 37])])
    assert torch.equal(fused.row_scales(), plain.row_scales())
    assert torch.equal(fused.nibbles_or_ints(rows), plain.nibbles_or_ints(rows))
    dense = plain.dequantized_weight()
    own = dequantize_int8(*quantize_int8(w)) if scheme == "int8" else dequantize_int4(*quantize_int4(w, 32), 32)
    assert torch.equal(dense, own)  # the twin itself is what the quantizer made
    assert torch.equal(fused.weight_rows(rows), dense[rows])
    assert torch.equal(fused.dequantized_weight(), dense)
    for layer in (fused, plain):
        layer.to(torch.bfloat16)  # the fused kernel's input type
    expected_w, expected_b = plain.dequantized_weight().float(), plain.bias.float()
    for n in (1, 5, FUSED_MAX_ROWS):
        x = torch.randn(n, 128, generator=torch.Generator().manual_seed(n)).bfloat16()
        torch.testing.assert_close(fused.fused(x).float(), x.float() @ expected_w.T, rtol=0.02, atol=0.15)
        torch.testing.assert_close(fused(x).float(), x.float() @ expected_w.T + expected_b, rtol=0.02, atol=0.15)


def aten_style_pack(nibbles: torch.Tensor, block: int, halves: bool) -> torch.Tensor:
    """What aten's CPU int4 packer writes for whole tiles of ``block`` rows (its
    ``weight_to_int4pack_kernel``): per tile ``[in, block / 2]`` bytes, the low nibble row ``d`` and
    the high one row ``d + block / 2`` (``halves``: its AVX-512 and AVX2 code), or rows ``2d`` and
    ``2d + 1`` (its code without vectors)."""
    rows, cols = nibbles.shape
    tiles = nibbles.to(torch.uint8).view(rows // block, block, cols).transpose(1, 2)  # [tile, in, row]
    low, high = (tiles[..., : block // 2], tiles[..., block // 2 :]) if halves else (tiles[..., 0::2], tiles[..., 1::2])
    return (low | high << 4).reshape(rows, cols // 2)


ATEN_INT4_LAYOUTS = [(64, True), (32, True), (32, False), (16, False)]  # AVX-512, AVX2, then no x86 vectors: 8 or 4 floats wide


def test_this_machines_int4_packer_is_one_of_the_known_layouts() -> None:
    """So that the emulated packers below stand for the real one."""
    real = torch.ops.aten._convert_weight_to_int4pack_for_cpu(_TILE_PROBE, 1)
    assert any(torch.equal(real, aten_style_pack(_TILE_PROBE, *layout)) for layout in ATEN_INT4_LAYOUTS)


@pytest.mark.parametrize("block, halves", ATEN_INT4_LAYOUTS)
def test_the_int4_layout_is_read_off_each_of_atens_packers(block: int, halves: bool, monkeypatch) -> None:
    """aten's int4 tile depends on the CPU it runs on; a reader fitted to one machine's tile (once
    64 rows, wrong on AVX2) loses the fused kernel on the others. Each packer must be read right."""
    tile = _tile_from_probe(aten_style_pack(_TILE_PROBE, block, halves))
    assert tile is not None and tile[0] == block
    monkeypatch.setattr(quant, "_aten_int4_tile", lambda: tile)
    nibbles = torch.randint(0, 16, (3 * block, 64), generator=torch.Generator().manual_seed(block), dtype=torch.uint8)
    packed = aten_style_pack(nibbles, block, halves)
    rows = torch.randperm(3 * block, generator=torch.Generator().manual_seed(5))
    assert torch.equal(_aten_int4_rows(packed, rows), nibbles[rows])
    assert _tile_from_probe(torch.zeros(128, 1, dtype=torch.uint8)) is None  # a packing no tile explains


VOCAB = 1024  # small, so a test decodes in milliseconds (the token ids are still GPT-2's)


def tiny_model() -> GPT:
    """Small blocks near the identity and a large tied embedding: confident logits, like a trained
    model's, so greedy decoding has no near-ties for quantization noise to flip at random."""
    torch.manual_seed(0)
    m = GPT(ModelConfig(vocab_size=VOCAB, context_length=96, d_model=64, n_layers=2, n_heads=4)).eval()
    with torch.no_grad():
        m.tok_emb.weight.mul_(10)
    return m


def prompts(n: int = 8) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(VOCAB, (int(k),), generator=g).tolist() for k in torch.randint(3, 30, (n,), generator=g)]


# Relative logit error ||q - fp32|| / ||fp32|| we promise, and the greedy agreement, per scheme.
TOLERANCE = {"int8": (0.02, 0.95), "int4": (0.25, 0.80)}


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_model_stays_near_fp32(scheme: str) -> None:
    model = tiny_model()
    quantized = cast_and_quantize(copy.deepcopy(model), None, scheme)  # as served: bf16 activations
    library = {"aten._weight_int8pack_mm", "aten._weight_int4pack_mm_for_cpu", "dequantize on the fly + matmul"}
    assert isinstance(quantized.tok_emb, QuantEmbedding) and all(
        name in library or name.startswith("minillm.small_linear_int8 at ") for name in kernels_used(quantized))
    assert sum(kernels_used(quantized).values()) == 2 * 4 + 1  # every block's four, and the tied matrix once
    ratio = model_bytes(quantized) / model_bytes(model)
    assert ratio < (0.30 if scheme == "int8" else 0.20)
    tokens = torch.tensor([p[:3] for p in prompts()])
    with torch.no_grad():
        ref, out = model(tokens), quantized(tokens).float()
    max_rel, min_agree = TOLERANCE[scheme]
    assert (out - ref).norm() / ref.norm() < max_rel
    expected = [generate_kv_cache(model, p, 12) for p in prompts()]
    got = [generate_kv_cache(quantized, p, 12) for p in prompts()]
    agree = sum(a == b for x, y in zip(got, expected) for a, b in zip(x, y)) / sum(map(len, expected))
    assert agree >= min_agree


def test_generating_never_rebuilds_the_quantized_tables_float_matrix() -> None:
    """A quantized token table has no float ``weight`` to rebuild at all (the loops once asked
    for it at every step just to learn the model's device): every path that generates works
    without one, learning the device and dtype from ``GPT.device`` and ``GPT.dtype``."""
    quantized = cast_and_quantize(tiny_model(), torch.float32, "int4")
    assert not hasattr(quantized.tok_emb, "weight") and quantized.dtype == torch.float32
    naive = generate_naive(quantized, prompts()[0], 6)
    assert generate_kv_cache(quantized, prompts()[0], 6) == naive
    outs = LLM(quantized, num_blocks=16, block_size=8).generate([prompts()[0]], SamplingParams(max_tokens=6, temperature=0,
                                                                 ignore_eos=True), use_tqdm=False)
    assert outs[0].token_ids == naive


def test_a_quantized_model_is_exactly_its_dequantized_twin() -> None:
    """The quantized GPT computes what a float GPT holding the dequantized weights computes."""
    quantized = quantize_model(tiny_model(), "int4")
    twin = tiny_model()
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if isinstance(module, QuantLinear):
                target = twin.tok_emb if name == "tok_emb.table" else twin.get_submodule(name)
                target.weight.copy_(module.dequantized_weight())
        tokens = torch.tensor([prompts()[0][:3]])
        torch.testing.assert_close(quantized(tokens), twin(tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_the_engine_runs_a_quantized_model_like_the_simple_loop(scheme: str) -> None:
    """In fp32, where both take the same path, exactly the same tokens."""
    model = tiny_model()
    llm = LLM(copy.deepcopy(model), quantize=scheme, dtype="float32", num_blocks=32, block_size=8)
    outs = llm.generate(prompts(4), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    alone = cast_and_quantize(copy.deepcopy(model), torch.float32, scheme)
    assert [o.token_ids for o in outs] == [generate_kv_cache(alone, p, 8) for p in prompts(4)]
    assert llm.engine.stats().kv_blocks_used == 0
    served = LLM(copy.deepcopy(model), quantize=scheme, num_blocks=8).engine.model
    assert served.dtype == torch.bfloat16 and isinstance(served.blocks[0].mlp.fc, QuantLinear)


def test_int8_layers_take_the_small_batch_kernel_at_the_rows_it_was_timed_faster(kernel, monkeypatch) -> None:
    """The timing picks, by bucket, whichever of the kernel and the layer's own product is
    faster; the layers then route each product by its row count; int4 layers are left alone."""
    layers = [QuantLinear.from_float(weights(48, 128, seed), torch.randn(48), "int8") for seed in range(2)]
    monkeypatch.setattr(quant, "_KERNEL_ROWS", {})
    monkeypatch.setattr(QuantLinear, "library", lambda self, flat: time.sleep(2e-3) or self.small(flat))
    assert quant.small_kernel_rows(layers, torch.float32, rounds=1) == frozenset(quant.KERNEL_BUCKETS)
    monkeypatch.undo()
    monkeypatch.setattr(quant, "_KERNEL_ROWS", {})
    monkeypatch.setattr(QuantLinear, "small", lambda self, flat: time.sleep(2e-3) or self.library(flat))
    assert quant.small_kernel_rows(layers, torch.float32, rounds=1) == frozenset()
    monkeypatch.undo()

    model = quantize_model(tiny_model(), "int8")
    monkeypatch.setattr(quant, "small_kernel_rows", lambda layers, dtype: frozenset({1, 2}))
    quant.use_small_kernel(model)
    layer = model.blocks[0].mlp.fc
    assert all(m.kernel_rows == {1, 2} for m in quant.step_layers(model)) and quant.step_layers(model)[-1] is model.tok_emb.table
    assert "small_linear_int8 at 1, 2 rows" in layer.kernel_name
    calls = []
    monkeypatch.setattr(gemv, "small_linear_int8", lambda *args: calls.append(args[0].shape[0]) or torch.ops.minillm.small_linear_int8(*args))
    for rows in (1, 2, 3, 17):
        x = torch.randn(rows, layer.in_features)
        torch.testing.assert_close(layer(x), x @ layer.dequantized_weight().T + layer.bias, rtol=1e-4, atol=1e-4)
    assert calls == [1, 2]  # 3 rows fall in bucket 4, 17 in bucket 32
    layer.kernel_rows = frozenset(quant.KERNEL_BUCKETS)
    layer(torch.randn(quant.FUSED_MAX_ROWS, layer.in_features))
    layer(torch.randn(quant.FUSED_MAX_ROWS + 1, layer.in_features))  # a prefill: past every bucket
    assert calls == [1, 2, quant.FUSED_MAX_ROWS]
    int4 = quant.use_small_kernel(quantize_model(tiny_model(), "int4"))
    assert all(not m.kernel_rows for m in quant.step_layers(int4))


def test_a_bad_scheme_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="quantize must be one of int8, int4, got 'int3'"):
        LLM(tiny_model(), quantize="int3")
    with pytest.raises(ValueError, match="quantize does not combine with tensor_parallel_size"):
        LLM(tiny_model(), quantize="int8", tensor_parallel_size=2)
