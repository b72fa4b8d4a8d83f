"""GGUF export, and llama.cpp as a second implementation of our model.

The file checks need only the ``gguf`` package: every key llama.cpp's GPT-2 loader reads, every
tensor under the name and shape it asks for, holding our weights. The llama.cpp checks run
where ``make llamacpp`` has built its programs (never in CI) and are skipped elsewhere: its
greedy tokens must be ours.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from minillm.bench import llamacpp
from minillm.model.checkpoint import load_model
from minillm.decoding.generate import generate_kv_cache
from minillm.export.gguf import export_gguf, gguf_context_length
from minillm.export.hf import gpt2_vocab, tensor_names
from minillm.model.gpt import GPT
from minillm.settings import preset_dir
from minillm.data.tokenizer import EOT_ID, get_tokenizer
from models import lively_tiny

PROMPTS = ["Once upon a time", "The little girl saw a", "Tom and his dog went to the park. They"]
needs_llamacpp = pytest.mark.skipif(not llamacpp.available(), reason="llama.cpp is not built (make llamacpp)")




@pytest.fixture(scope="module")
def model() -> GPT:
    return lively_tiny()


@pytest.fixture(scope="module")
def f32_path(model, tmp_path_factory) -> Path:
    return export_gguf(model, tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf", "f32")


@pytest.fixture(scope="module")
def f32_file(f32_path) -> gguf.GGUFReader:
    return gguf.GGUFReader(f32_path)


def field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def expected_ne(cfg) -> dict[str, tuple[int, ...]]:
    """Each tensor's dimensions as llama.cpp's ``llama_model_gpt2::load_arch_tensors`` asks for
    them (ggml order: the fastest-varying dimension first)."""
    d, ff, v, ctx = cfg.d_model, 4 * cfg.d_model, cfg.vocab_size, cfg.context_length
    ne = {"token_embd.weight": (d, v), "position_embd.weight": (d, ctx),
          "output_norm.weight": (d,), "output_norm.bias": (d,)}
    for i in range(cfg.n_layers):
        ne |= {f"blk.{i}.attn_norm.weight": (d,), f"blk.{i}.attn_norm.bias": (d,),
               f"blk.{i}.attn_qkv.weight": (d, 3 * d), f"blk.{i}.attn_qkv.bias": (3 * d,),
               f"blk.{i}.attn_output.weight": (d, d), f"blk.{i}.attn_output.bias": (d,),
               f"blk.{i}.ffn_norm.weight": (d,), f"blk.{i}.ffn_norm.bias": (d,),
               f"blk.{i}.ffn_up.weight": (d, ff), f"blk.{i}.ffn_up.bias": (ff,),
               f"blk.{i}.ffn_down.weight": (ff, d), f"blk.{i}.ffn_down.bias": (d,)}
    return ne


def test_metadata_is_what_llamacpps_gpt2_loader_reads(model, f32_path, f32_file) -> None:
    cfg = model.cfg
    expected = {
        "general.architecture": "gpt2", "general.file_type": gguf.LlamaFileType.ALL_F32,
        "gpt2.context_length": cfg.context_length, "gpt2.embedding_length": cfg.d_model,
        "gpt2.block_count": cfg.n_layers, "gpt2.feed_forward_length": 4 * cfg.d_model,
        "gpt2.attention.head_count": cfg.n_heads,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.bos_token_id": EOT_ID, "tokenizer.ggml.eos_token_id": EOT_ID,
        "tokenizer.ggml.add_bos_token": False,
    }
    assert {key: field(f32_file, key) for key in expected} == expected
    assert math.isclose(field(f32_file, "gpt2.attention.layer_norm_epsilon"), cfg.layer_norm_eps, rel_tol=1e-6)
    assert gguf_context_length(f32_path) == cfg.context_length


def test_tokenizer_is_gpt2s(f32_file) -> None:
    vocab, merges = gpt2_vocab()
    tokens = field(f32_file, "tokenizer.ggml.tokens")
    assert len(tokens) == len(vocab) == 50257
    assert all(vocab[token] == i for i, token in enumerate(tokens))
    assert field(f32_file, "tokenizer.ggml.merges") == [f"{a} {b}" for a, b in merges]
    types = field(f32_file, "tokenizer.ggml.token_type")
    assert types[EOT_ID] == gguf.TokenType.CONTROL
    assert set(types[:EOT_ID]) == {gguf.TokenType.NORMAL}


def test_tensors_hold_our_weights_under_llamacpps_names(model, f32_file) -> None:
    tensors = {t.name: t for t in f32_file.tensors}
    assert {name: tuple(int(n) for n in t.shape) for name, t in tensors.items()} == expected_ne(model.cfg)
    # the names gguf-py lists for llama.cpp's gpt2 architecture; "output" is absent: it is tied
    known = {gguf.TENSOR_NAMES[t].format(bid=i)
             for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.GPT2] for i in range(model.cfg.n_layers)}
    assert {name.rsplit(".", 1)[0] for name in tensors} == known - {"output"}
    state = model.state_dict()
    for ours, _, theirs in tensor_names(model.cfg.n_layers):
        assert tensors[theirs].tensor_type == gguf.GGMLQuantizationType.F32, theirs
        assert np.array_equal(tensors[theirs].data, state[ours].numpy()), theirs


@pytest.mark.parametrize("dtype", ["f16", "bf16", "q8_0"])
def test_lower_precisions_round_only_the_matrices(model, tmp_path, dtype) -> None:
    """Vectors and the position table stay f32, as in llama.cpp's converter; every other matrix
    holds our weights rounded to ``dtype`` (q8_0: within half a step of its 32-value block, the
    step being the block's largest magnitude / 127, stored as f16)."""
    reader = gguf.GGUFReader(export_gguf(model, tmp_path / f"tiny-{dtype}.gguf", dtype))
    qtype = gguf.GGMLQuantizationType[dtype.upper()]
    tensors = {t.name: t for t in reader.tensors}
    state = model.state_dict()
    for ours, _, theirs in tensor_names(model.cfg.n_layers):
        t, w = tensors[theirs], state[ours]
        assert tuple(int(n) for n in t.shape) == tuple(reversed(w.shape)), theirs
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape)
        if w.dim() == 1 or theirs == "position_embd.weight":
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, theirs
            assert np.array_equal(values, w.numpy()), theirs
        elif dtype == "q8_0":
            assert t.tensor_type == qtype, theirs
            # half a step from rounding to int8, and up to 127 steps times the scale's f16 rounding
            blocks = w.reshape(-1, 32)
            step = blocks.abs().amax(dim=1, keepdim=True) / 127
            excess = (torch.from_numpy(values).reshape(-1, 32) - blocks).abs() / (0.5 + 127 * 2**-11) - step
            assert excess.max() <= 1e-9, theirs
        else:
            assert t.tensor_type == qtype, theirs
            rounded = w.to({"f16": torch.float16, "bf16": torch.bfloat16}[dtype]).float()
            assert np.array_equal(values, rounded.numpy()), theirs


def test_default_dtype_is_the_models_own(tmp_path) -> None:
    model = lively_tiny().to(torch.bfloat16)
    reader = gguf.GGUFReader(export_gguf(model, tmp_path / "m.gguf"))
    assert field(reader, "general.file_type") == gguf.LlamaFileType.MOSTLY_BF16
    with pytest.raises(ValueError, match="dtype must be one of"):
        export_gguf(model, tmp_path / "x.gguf", "int4")


def test_missing_binaries_say_how_to_build_them(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(llamacpp.BIN_ENV, str(tmp_path))
    assert not llamacpp.available()
    with pytest.raises(llamacpp.LlamaCppError, match="make llamacpp"):
        llamacpp.binary("llama-server")


# ----------------------------------------------------------------------------- llama.cpp itself


def reference_model() -> GPT:
    """The trained cpu model where there is one (its continuations are text, not noise), else
    the lively random tiny model."""
    try:
        return load_model(preset_dir("cpu"))
    except FileNotFoundError:
        return lively_tiny()


@needs_llamacpp
@torch.no_grad()
def test_llamacpp_greedy_tokens_are_ours(tmp_path) -> None:
    """llama.cpp computes in its own order (and its GELU through an f16 table), so two logits
    closer than its rounding may swap. Tokens are compared up to the first step whose top two
    logits (ours) are within ``TIE`` of each other, and most steps must get that far."""
    TIE, n = 0.01, 32
    model = reference_model()
    path = export_gguf(model, tmp_path / "model.gguf", "f32")
    tokenizer, compared, total = get_tokenizer(), 0, 0
    with llamacpp.llama_server(path) as url:
        for prompt in PROMPTS:
            ids = tokenizer.encode(prompt)
            ours = generate_kv_cache(model, ids, n, stop_token=EOT_ID)
            theirs = llamacpp.server_greedy_tokens(url, ids, n)
            top2 = model(torch.tensor([ids + ours]))[0, len(ids) - 1 : -1].topk(2).values
            near_ties = ((top2[:, 0] - top2[:, 1]) < TIE).nonzero()
            clear = int(near_ties[0]) + 1 if len(near_ties) else len(ours)  # the first near tie still counts
            assert theirs[:clear] == ours[:clear], (prompt, tokenizer.decode(ours), tokenizer.decode(theirs))
            if clear == len(ours):
                assert theirs == ours, prompt
            compared, total = compared + clear, total + len(ours)
    assert compared >= total // 2, f"only {compared} of {total} steps were clear of near ties"


@needs_llamacpp
def test_benchmarks_report_a_rate_per_batch_size(model, tmp_path) -> None:
    path = export_gguf(model, tmp_path / "tiny.gguf", "f32")
    assert llamacpp.llama_bench_tg(path, 8, repetitions=1) > 0
    rates = llamacpp.batched_bench_tg(path, (1, 4), n_prompt=8, n_gen=8)
    assert list(rates) == [1, 4] and all(r > 0 for r in rates.values())
    with pytest.raises(llamacpp.LlamaCppError, match="beyond the model's context"):
        llamacpp.llama_bench_tg(path, model.cfg.context_length + 1)
