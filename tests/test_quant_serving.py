"""``--quantize`` end to end: the flag and its variable, bad values, and a real quantized server."""

from __future__ import annotations

import copy
import json
import os
import urllib.request
from pathlib import Path

import pytest
import torch

from minillm.cli import UsageError
from minillm.model.checkpoint import save_checkpoint
from minillm.engine import LLM, SamplingParams
from minillm.speedups.quant import QuantEmbedding, QuantLinear
from server.__main__ import build
from server.config import ServerConfig, parse_args
from server.launch import start_server
from test_quant import VOCAB, tiny_model


def test_the_flag_and_its_environment_variable() -> None:
    assert parse_args(["--quantize", "int4"], environ={}).quantize == "int4"
    assert parse_args([], environ={"MINILLM_QUANTIZE": "INT8"}).quantize == "int8"
    assert parse_args([], environ={}).quantize is None


def test_a_bad_value_names_the_flag() -> None:
    with pytest.raises(UsageError, match="--quantize: quantize must be one of int8, int4, got 'fp8'"):
        parse_args(["--quantize", "FP8"], environ={})
    with pytest.raises(UsageError, match="--quantize: quantize does not combine with tensor_parallel_size"):
        parse_args(["--quantize", "int8", "--tensor-parallel-size", "2"], environ={})


def checkpoint(tmp_path: Path) -> Path:
    m = tiny_model()
    return save_checkpoint(tmp_path / "ckpt.pt", {"model": m.state_dict(), "model_config": m.cfg.to_dict()})


def test_load_quantizes_in_bf16_unless_told_otherwise(tmp_path: Path) -> None:
    ckpt = str(checkpoint(tmp_path))
    model = build(ServerConfig(checkpoint=ckpt, device="cpu", quantize="int4", kv_cache_memory="8MiB")).model
    assert isinstance(model.tok_emb, QuantEmbedding) and isinstance(model.blocks[1].attn.qkv, QuantLinear)
    assert model.ln_f.weight.dtype == torch.bfloat16 and model.blocks[0].mlp.fc.scheme == "int4"
    model = build(ServerConfig(checkpoint=ckpt, device="cpu", quantize="int8", dtype="float32", kv_cache_memory="8MiB")).model
    assert model.ln_f.weight.dtype == torch.float32 and model.blocks[0].mlp.fc.qweight.dtype == torch.int8


def test_a_quantized_server_answers_like_the_offline_engine(tmp_path: Path) -> None:
    prompt = [17, 402, 9, 1000, 33]
    offline = LLM(tiny_model(), quantize="int8", num_blocks=16, block_size=8)
    expected = offline.generate([prompt], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0]
    env = {**os.environ, "MINILLM_HOME": str(tmp_path)}
    with start_server(checkpoint(tmp_path), "--device", "cpu", "--quantize", "int8", "--kv-cache-memory", "8MiB",
                      timeout=90, env=env) as server:
        body = json.dumps({"model": "minillm", "prompt": prompt, "max_tokens": 12, "temperature": 0}).encode()
        request = urllib.request.Request(f"{server.url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.load(response)
    assert answer["usage"]["completion_tokens"] == len(expected.token_ids) == 12
    assert answer["choices"][0]["text"] == expected.text
    assert max(expected.token_ids) < VOCAB


def test_the_banner_says_what_computes(tmp_path: Path) -> None:
    from server.__main__ import model_line

    ckpt = str(checkpoint(tmp_path))
    config = ServerConfig(checkpoint=ckpt, device="cpu", quantize="int8", kv_cache_memory="8MiB")
    assert model_line(build(config), config).startswith("model on cpu in int8 weights, bfloat16 activations; ")
    config = ServerConfig(checkpoint=ckpt, device="cpu", dtype="float32", enforce_eager=True, kv_cache_memory="8MiB",
                          async_scheduling=True)
    assert model_line(build(config), config) == "model on cpu in float32; attention: torch; overlap scheduling"
