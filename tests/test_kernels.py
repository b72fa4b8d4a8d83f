"""Chapter 16 without Triton: the tiled PyTorch attention, the online softmax, the traffic model
against the code's own byte counts, and the engine's attention-backend switch."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from minillm.bench.__main__ import main as bench_main
from minillm.cli import UsageError
from minillm.model.config import ModelConfig
from minillm.engine import LLM
from minillm.engine.config import EngineConfig
from minillm.machine.hardware import get_spec
from minillm.speedups.kernels import (
    TrafficCounter,
    decode_bytes,
    naive_attention,
    naive_bytes,
    naive_kernels,
    online_softmax,
    online_softmax_steps,
    roofline_seconds,
    tiled_attention,
    tiled_bytes,
)
from minillm.speedups.kernels import runtime
from minillm.model.gpt import GPT
from server.config import parse_args


def reference(q, k, v, causal: bool) -> torch.Tensor:
    """SDPA in fp64, with the bottom-right causal mask the engine uses."""
    t_q, t_k = q.shape[-2], k.shape[-2]
    mask = torch.ones(t_q, t_k, dtype=torch.bool).tril(t_k - t_q) if causal else None
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)


def qkv(t_q: int, t_k: int, d: int = 16, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    make = lambda t: torch.randn(2, 3, t, d, generator=g).to(dtype)  # noqa: E731
    return make(t_q), make(t_k), make(t_k)


# (T_q, T_k): square and ragged (not a multiple of any block), a chunk after a cached prefix, a decode
SHAPES = [(37, 37), (64, 64), (5, 50), (1, 29)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("blocks", [(16, 8), (7, 5), (64, 64)])
def test_tiled_attention_equals_sdpa(causal, shape, blocks) -> None:
    q, k, v = qkv(*shape)
    out = tiled_attention(q, k, v, causal=causal, block_q=blocks[0], block_k=blocks[1])
    torch.testing.assert_close(out.double(), reference(q, k, v, causal), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_naive_attention_equals_sdpa(causal, shape) -> None:
    q, k, v = qkv(*shape)
    torch.testing.assert_close(naive_attention(q, k, v, causal=causal).double(), reference(q, k, v, causal),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype, atol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_tiled_attention_half_inputs_accumulate_in_fp32(dtype, atol) -> None:
    q, k, v = qkv(45, 45, dtype=dtype)
    out = tiled_attention(q, k, v, causal=True, block_q=16, block_k=16)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), reference(q, k, v, True), atol=atol, rtol=0)


def test_causal_needs_as_many_keys_as_queries() -> None:
    q, k, v = qkv(10, 4)
    with pytest.raises(ValueError, match="at least as many keys"):
        tiled_attention(q, k, v, causal=True)
    with pytest.raises(ValueError, match="block sizes"):
        tiled_attention(*qkv(4, 4), block_q=0)


@pytest.mark.parametrize("block", [1, 3, 16, 100])
def test_online_softmax_equals_softmax(block) -> None:
    x = torch.randn(4, 37) * 20  # large values: without the running max, exp would overflow
    torch.testing.assert_close(online_softmax(x, block), torch.softmax(x, -1))
    *_, (m, l) = online_softmax_steps(x, block)
    torch.testing.assert_close(m, x.amax(-1))
    torch.testing.assert_close(l, torch.exp(x - x.amax(-1, keepdim=True)).sum(-1))
    with pytest.raises(ValueError, match="block >= 1"):
        online_softmax(x, 0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("blocks", [(16, 8), (7, 5), (8, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_traffic_model_matches_the_tiled_codes_own_count(causal, shape, blocks, dtype) -> None:
    q, k, v = qkv(*shape, dtype=dtype)
    counter = TrafficCounter()
    tiled_attention(q, k, v, causal=causal, block_q=blocks[0], block_k=blocks[1], counter=counter)
    model = tiled_bytes(*shape, 16, block_q=blocks[0], block_k=blocks[1], causal=causal, heads=3, batch=2,
                        dtype_bytes=dtype.itemsize)
    assert counter.traffic == model


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_traffic_model_matches_the_naive_codes_own_count(causal, shape) -> None:
    q, k, v = qkv(*shape)
    counter = TrafficCounter()
    naive_attention(q, k, v, causal=causal, counter=counter)
    assert counter.traffic == naive_bytes(*shape, 16, heads=3, batch=2, dtype_bytes=4)


def test_traffic_model_worked_numbers() -> None:
    """T = 1024, d = 64, fp16, one head: naive moves Q, K, V, O once and the 1024^2 score
    matrix four times (S written and read, P written and read); tiled with 128-query blocks
    moves Q and O once and K, V eight times. Causal skips the blocks above the diagonal."""
    t, d, e = 1024, 64, 2
    assert naive_bytes(t, t, d).total == (4 * t * d + 4 * t * t) * e
    assert tiled_bytes(t, t, d, block_q=128, block_k=64).total == (2 * t * d + 8 * 2 * t * d) * e
    causal_key_rows = sum(128 * (i + 1) for i in range(8))  # block i needs keys 0 .. 128(i+1)
    assert tiled_bytes(t, t, d, block_q=128, block_k=64, causal=True).total == (2 * t * d + 2 * causal_key_rows * d) * e
    # the ratio naive / tiled tends to 2 * block_q / d as T grows: the bigger the tile, the less traffic
    big = 1 << 16
    ratio = naive_bytes(big, big, d).total / tiled_bytes(big, big, d, block_q=128, block_k=64).total
    assert math.isclose(ratio, 2 * 128 / d, rel_tol=0.01)


def test_roofline_floor_finds_the_softmax_bandwidth_bound() -> None:
    """On an A100 in fp16 the softmax does 5 FLOPs per 4 bytes moved, far below the ridge: its
    floor is its bytes over the bandwidth. The whole naive attention is slower than the tiled
    kernel's floor by more than the byte ratio alone would say, since the tiled kernel's FLOPs
    and bytes overlap in one kernel."""
    spec = get_spec("a100-sxm-80gb")
    kernels = naive_kernels(4096, 4096, 64)
    name, flops, traffic = kernels[1]
    assert name == "P = softmax(S)" and roofline_seconds(flops, traffic, spec, "fp16") == traffic.total / spec.bandwidth
    qk_flops, qk_traffic = kernels[0][1:]
    assert roofline_seconds(qk_flops, qk_traffic, spec, "fp16") == max(qk_flops / 312e12, qk_traffic.total / 2039e9)
    naive = sum(roofline_seconds(f, t, spec, "fp16") for _, f, t in kernels)
    tiled_flops = sum(f for _, f, _ in kernels)
    tiled = roofline_seconds(tiled_flops, tiled_bytes(4096, 4096, 64, block_q=128, block_k=64), spec, "fp16")
    assert naive / tiled > 1.5


def test_decode_traffic_gathered_moves_the_cache_three_times() -> None:
    kv = 2 * 1000 * 64 * 8 * 2
    gathered, in_place = decode_bytes(1000, 64, heads=8, gathered=True), decode_bytes(1000, 64, heads=8, gathered=False)
    assert gathered.read - in_place.read == kv and gathered.written - in_place.written == kv
    assert 2.99 < gathered.total / in_place.total < 3.0


def test_traffic_model_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="head_dim"):
        naive_bytes(8, 8, 0)
    with pytest.raises(ValueError, match="block sizes"):
        tiled_bytes(8, 8, 16, block_q=0, block_k=8)


# ----------------------------------------------------------------------------- engine and server


def test_attention_backend_is_checked() -> None:
    with pytest.raises(ValueError, match="attention must be one of torch, torch-loop, triton"):
        EngineConfig(attention="cuda")
    assert parse_args(["--attention", "TRITON"]).engine_config().attention == "triton"
    with pytest.raises(UsageError, match="attention must be one of"):
        parse_args(["--attention", "flash"])


def test_attention_by_default_is_the_paged_kernel_only_on_one_gpu_where_triton_compiles(monkeypatch) -> None:
    """``attention=None`` takes the Triton kernels for a model on one CUDA device where Triton
    compiles, and not anywhere else, without asking for Triton there (on a CPU it takes the C++
    kernel, tests/test_decode_attention.py, for the dtypes it reads, else the torch path)."""
    from minillm.engine import build

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    asked = []
    monkeypatch.setattr(runtime, "require_triton", lambda device: asked.append(device))
    monkeypatch.setattr(build, "triton_compiles", lambda: True)
    bf16 = torch.bfloat16
    assert build.attention_kernels(EngineConfig(), cpu, torch.float16) is None
    assert build.attention_kernels(EngineConfig(tensor_parallel_size=2), cuda, bf16) is None
    assert build.attention_kernels(EngineConfig(pipeline_parallel_size=2), cuda, bf16) is None
    assert build.attention_kernels(EngineConfig(attention="torch"), cuda, bf16) is None
    assert asked == []
    kernels = build.attention_kernels(EngineConfig(), cuda, bf16)
    assert kernels is not None and kernels.name == "triton" and asked == [cuda]
    monkeypatch.setattr(build, "triton_compiles", lambda: False)  # not installed, or interpreting
    assert build.attention_kernels(EngineConfig(), cuda, bf16) is None
    assert parse_args([]).engine_config().attention is None


def test_triton_backend_fails_at_startup_where_it_cannot_run(monkeypatch) -> None:
    model = GPT(ModelConfig(context_length=32, d_model=32, n_layers=1, n_heads=2))
    monkeypatch.setattr(runtime, "triton_installed", lambda: False)
    with pytest.raises(ValueError, match=r"attention='triton' cannot run here: Triton is not installed.*\[triton\]"):
        LLM(model, attention="triton")
    monkeypatch.setattr(runtime, "triton_installed", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU without the interpreter cannot run Triton at all
    with pytest.raises(ValueError, match="interpreter"):
        LLM(model, attention="triton", num_blocks=4)
    with pytest.raises(ValueError, match="not meta"):
        LLM(model, device="meta", attention="triton", num_blocks=4)


# ----------------------------------------------------------------------------- the benchmark


def test_attention_bench_on_cpu_times_pytorch_only_and_says_so(tmp_path, capsys) -> None:
    assert bench_main(["attention", "--smoke", "--device", "cpu", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "no CUDA device" in printed
    report = json.loads((tmp_path / "attention-cpu.json").read_text())
    methods = {row["method"] for row in report["kernels"]}
    assert methods == {"naive", "tiled (PyTorch)", "sdpa"}  # never the interpreted Triton kernel
    assert report["engine"] == []
    for row in report["kernels"]:
        assert row["seconds"] > 0 and row["max_abs_error"] < 1e-4
        q1, q3 = row["quartiles"]
        assert q1 <= row["seconds"] <= q3
    traffic = report["traffic"]
    assert all(n > t for n, t in zip(traffic["naive_bytes"], traffic["tiled_bytes"]))
    assert (tmp_path / "attention-cpu.png").stat().st_size > 1000
