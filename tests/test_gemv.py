"""The small-batch CPU kernel computes what ``F.linear`` does, on every path this CPU runs;
the engine gives the same greedy tokens through it; and where it cannot be built, products take
the library's path and say so."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F

from minillm.decoding.sampling import SamplingParams
from minillm.engine import LLM
from minillm.model.config import get_preset
from minillm.model.gpt import GPT
from minillm.speedups import gemv, packed


def every_path(dtype: torch.dtype) -> list:
    return [pytest.param(dtype, path, id=f"{str(dtype)[6:]}-{path}") for path in ("avx512", "avx2", "scalar")]


def cases():
    """(rows, in, out, bias, layout of x): odd sizes, row counts 1-64, strided and 3-D inputs."""
    gen = torch.Generator().manual_seed(0)
    sizes = [(1, 191, 97), (2, 16, 4), (3, 17, 5), (4, 1, 3), (5, 33, 8), (7, 64, 58), (8, 191, 97), (9, 32, 1),
             (16, 512, 129), (17, 100, 33), (31, 48, 23), (64, 191, 97), (6, 2048, 13)]
    for i, (rows, k, n) in enumerate(sizes):
        yield rows, k, n, i % 2 == 0, ("contiguous", "transposed", "sliced")[i % 3]
    for _ in range(6):  # random shapes
        rows, k, n = (int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((1, 65), (1, 300), (1, 200)))
        yield rows, k, n, bool(torch.randint(0, 2, (1,), generator=gen)), "transposed"


def make_x(rows: int, k: int, layout: str, dtype: torch.dtype) -> torch.Tensor:
    if layout == "transposed":  # columns apart
        return torch.randn(k, rows).to(dtype).t()
    if layout == "sliced":  # [2, rows // 2 + 1, k] every other row of a wider tensor
        return torch.randn(2, rows + 2, k + 3).to(dtype)[:, ::2, 1 : k + 1]
    return torch.randn(rows, k).to(dtype)


@pytest.mark.parametrize("dtype,path", every_path(torch.float32) + every_path(torch.bfloat16))
def test_products_equal_f_linear(kernel, dtype, path):
    if path not in gemv.paths(dtype):
        pytest.skip(f"this CPU does not run the {path} path for {dtype}")
    torch.manual_seed(0)
    for rows, k, n, with_bias, layout in cases():
        x = make_x(rows, k, layout, dtype)
        weight, bias = torch.randn(n, k).to(dtype), torch.randn(n).to(dtype) if with_bias else None
        y = gemv.small_linear(x, weight, bias, path)
        assert y.shape == (*x.shape[:-1], n) and y.dtype == dtype
        # F.linear in fp32 on the same (bf16-rounded) inputs: bf16 results may differ by the one
        # rounding to bf16 (2^-9 relative) and both by the order fp32 sums are taken in
        up = lambda t: None if t is None else t.float()  # noqa: E731
        expected = F.linear(up(x), up(weight), up(bias))
        tolerance = dict(rtol=2**-8, atol=1e-3) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(y.float(), expected, **tolerance, msg=lambda m: f"{rows}x{k} by {n}x{k}, "
                                   f"bias {with_bias}, {layout}: {m}")


@pytest.mark.parametrize("path", ["avx512", "avx2", "scalar"])
def test_int8_products_equal_the_dequantized_product(kernel, path):
    """int8 weights with a scale per row, read as stored and widened in registers: the product
    of the dequantized matrix, for fp32 and bf16 inputs alike (bf16 is summed in fp32)."""
    if path not in gemv.paths(torch.int8):
        pytest.skip(f"this CPU does not run the {path} path for int8")
    torch.manual_seed(0)
    for rows, k, n, with_bias, layout in cases():
        qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        scales, bias = torch.rand(n) / 100 + 1e-3, torch.randn(n) if with_bias else None
        dense = qweight.float() * scales[:, None]
        for dtype in (torch.float32, torch.bfloat16):
            x = make_x(rows, k, layout, dtype)
            y = gemv.small_linear_int8(x, qweight, scales.to(dtype), None if bias is None else bias.to(dtype), path)
            assert y.shape == (*x.shape[:-1], n) and y.dtype == dtype
            expected = F.linear(x.float(), qweight.float() * scales.to(dtype).float()[:, None],
                                None if bias is None else bias.to(dtype).float())
            tolerance = dict(rtol=2**-8, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(y.float(), expected, **tolerance, msg=lambda m: f"{rows}x{k} by {n}x{k} "
                                       f"{dtype}, bias {with_bias}, {layout}: {m}")
        assert not torch.equal(dense, dense.round())  # the scales matter: a missed one would show


def test_the_int8_operator_checks_its_inputs_and_a_compiler_can_trace_it(kernel):
    x, qweight, scales = torch.randn(2, 3, 40), torch.randint(-127, 128, (7, 40), dtype=torch.int8), torch.rand(7)
    with pytest.raises(RuntimeError, match="weight must be int8"):
        gemv.small_linear_int8(x, qweight.float(), scales)
    with pytest.raises(RuntimeError, match="scale must have 7 values"):
        gemv.small_linear_int8(x, qweight, scales[:6])
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16"):
        gemv.small_linear_int8(x.double(), qweight, scales)
    checks = torch.library.opcheck(torch.ops.minillm.small_linear_int8.default, (x, qweight, scales, torch.randn(7), ""))
    assert set(checks.values()) == {"SUCCESS"} and "test_faketensor" in checks


def test_the_fastest_path_is_the_default_and_a_missing_one_is_refused(kernel):
    for dtype in gemv.DTYPES:
        assert gemv.paths(dtype)[-1] == "scalar"
    x, weight = torch.randn(3, 40), torch.randn(7, 40)
    assert torch.equal(gemv.small_linear(x, weight), gemv.small_linear(x, weight, path=gemv.paths(torch.float32)[0]))
    with pytest.raises(RuntimeError, match="cannot run path 'neon'"):
        gemv.small_linear(x, weight, path="neon")
    with pytest.raises(RuntimeError, match="x is BFloat16, weight is Float"):
        gemv.small_linear(x.bfloat16(), weight)
    with pytest.raises(RuntimeError, match="last dimension must be 40"):
        gemv.small_linear(x[:, :39], weight)


def test_the_operator_is_one_a_compiler_can_trace(kernel):
    x, weight, bias = torch.randn(2, 3, 191), torch.randn(97, 191), torch.randn(97)
    checks = torch.library.opcheck(torch.ops.minillm.small_linear.default, (x, weight, bias, ""))
    assert set(checks.values()) == {"SUCCESS"} and "test_faketensor" in checks


def tiny_model() -> GPT:
    torch.manual_seed(0)
    return GPT(get_preset("tiny")).eval()


PROMPTS = [[5, 6, 7], [100, 200, 300, 400, 500], [9], [42, 43], [7, 7, 7, 7], [1000, 2000, 3000]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def tokens(llm: LLM) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_the_engine_gives_the_plain_paths_greedy_tokens_through_the_kernel(kernel, monkeypatch):
    calls = []
    small_linear = gemv.small_linear
    monkeypatch.setattr(gemv, "small_linear", lambda x, *args: calls.append(x.shape[0]) or small_linear(x, *args))
    # whatever this machine would time, every decode-sized product takes the kernel
    monkeypatch.setattr(packed, "time_roads", lambda weights: {
        tuple(w.shape): {rows: {"packed": 1.0, "plain": 1.0, "gemv": 0.0} for rows in packed.BUCKETS} for w in weights})
    model = tiny_model()
    fast = LLM(model, num_blocks=32, block_size=4)
    assert fast.engine.model is not model  # packed
    plain = tokens(LLM(model, num_blocks=32, block_size=4, enforce_eager=True))
    assert tokens(fast) == plain
    alone = fast.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].token_ids  # one row decoding
    assert alone == plain[0]
    assert set(calls) >= {1, len(PROMPTS)}  # one row and the whole batch decoding


def test_without_the_kernel_products_take_the_librarys_path_and_say_so(monkeypatch, caplog):
    def no_compiler() -> None:
        raise RuntimeError("Error building extension 'minillm_gemv': c++: not found")

    monkeypatch.setattr(gemv, "build", no_compiler)
    monkeypatch.setattr(gemv, "_loaded", None)
    monkeypatch.setattr(packed, "_TIMINGS", {})
    with caplog.at_level(logging.WARNING, logger="minillm.speedups.gemv"):
        assert not gemv.load() and not gemv.load()
        assert not gemv.supports(torch.randn(4, 4))
    [record] = caplog.records  # once, in one line
    assert "did not build" in record.getMessage() and "c++: not found" in record.getMessage()
    assert "\n" not in record.getMessage()
    weight = torch.randn(58, 64)
    assert all("gemv" not in seconds for seconds in packed.time_roads([weight], rounds=1)[(58, 64)].values())
    model = tiny_model()
    fast = LLM(model, num_blocks=32, block_size=4)
    assert fast.engine.model is not model  # still packed, by the other roads
    entries = [packed._PACKED[packed._key(m.weight)] for m in fast.engine.model.modules()
               if isinstance(m, (packed.PackedLinear, packed.PackedTokenEmbedding))]
    assert entries and "gemv" not in {road for e in entries for road in e.roads.values()}
    assert tokens(fast) == tokens(LLM(model, num_blocks=32, block_size=4, enforce_eager=True))


def test_the_products_benchmark_times_every_road_and_a_steps_total(kernel, tmp_path, capsys):
    from minillm.bench.__main__ import main

    assert main(["products", "--presets", "tiny", "--rows", "1,3", "--dtypes", "float32", "--repeats", "1",
                 "--max-copies", "2", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "products-cpu.json").read_text())
    run = report["runs"]["tiny float32"]
    assert set(run["shapes"]) == {"qkv", "attention out", "MLP up", "MLP down", "LM head"}
    head = run["shapes"]["LM head"]["ms"]
    assert set(head["1"]) == {"F.linear", "oneDNN packed", "slabs", "small-batch kernel"}  # 50,257 = 29 slabs
    assert set(head["3"]) == {"F.linear", "oneDNN packed", "small-batch kernel"}
    assert all(t > 0 for found in head.values() for times in found.values() for t in times)
    assert "a step's products" in capsys.readouterr().out and (tmp_path / "products-cpu.png").is_file()


def test_the_decode_benchmark_can_build_engines_without_the_kernel(kernel):
    from minillm.bench.decode import without_small_kernel
    from minillm.speedups.packed import pack_weights

    model = tiny_model()
    with without_small_kernel():
        library = pack_weights(model)
    entries = [packed._PACKED[packed._key(m.weight)] for m in library.modules() if isinstance(m, packed.PackedLinear)]
    assert entries and "gemv" not in {road for e in entries for road in e.roads.values()}
    with without_small_kernel():
        assert packed.small_batch_products(model) is None  # a compiled step keeps Inductor's products
    assert gemv.supports(model.tok_emb.weight)  # only while it built the engine
    assert packed.small_batch_products(model) is not None


def test_a_compiled_bf16_step_keeps_inductors_products_where_the_cpu_has_amx(kernel, monkeypatch):
    model = tiny_model().bfloat16()
    if packed.packing_unsupported(model) is not None:
        pytest.skip("oneDNN has no bf16 products on this CPU, so no compiled step is timed against them")
    for amx in (True, False):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        assert (packed.small_batch_products(model) is None) == amx
