"""The CPU's C++ decode attention computes what the gather does, writes only the new tokens'
slots, refuses what it cannot read, and is the engine's default attention on a CPU, where the
engine's greedy tokens are the torch path's."""

from __future__ import annotations

import pytest
import torch

from minillm.decoding.sampling import SamplingParams
from minillm.engine import LLM, build_engine
from minillm.engine.config import EngineConfig, EngineOptionError
from minillm.engine.kv_cache import gather_decode_attention, slot_of
from minillm.model.config import get_preset
from minillm.model.gpt import GPT
from minillm.speedups import gemv


def paged_case(dtype: torch.dtype, seed: int, block_size: int = 4, heads: int = 3, head_dim: int = 24):
    """A pool of three layers, rows of lengths 1 to 30 over shuffled blocks, tables padded with
    the pad block, and each row's new key and value with the slot of its last position."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, 30, 5, 4, 17, 9])[: 2 + seed % 5]
    width = -(-int(lengths.max()) // block_size) + 1  # one padding column past the longest
    blocks = 40
    pool = [torch.randn(3, blocks + 1, block_size, heads, head_dim, generator=gen).to(dtype) for _ in range(2)]
    order = torch.randperm(blocks, generator=gen)
    tables = torch.full((len(lengths), width), blocks)  # the pad block
    used = 0
    for i, n in enumerate(lengths.tolist()):
        need = -(-n // block_size)
        tables[i, :need] = order[used : used + need]
        used += need
    slots = torch.stack([slot_of(tables[i], n - 1, block_size) for i, n in enumerate(lengths.tolist())])
    q, k, v = (torch.randn(len(lengths), heads, head_dim, generator=gen).to(dtype) for _ in range(3))
    return q, k, v, pool, tables, lengths, slots


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("seed", range(4))
def test_decode_attention_equals_the_gather_and_writes_only_the_new_slots(kernel, dtype, tolerance, seed):
    q, k, v, (k_pool, v_pool), tables, lengths, slots = paged_case(dtype, seed, block_size=4 + seed % 3 * 4)
    expected_k, expected_v = k_pool.clone(), v_pool.clone()
    for pool, new in ((expected_k, k), (expected_v, v)):
        pool[1].view(-1, *new.shape[1:]).index_copy_(0, slots, new)
    expected = gather_decode_attention(q, expected_k[1], expected_v[1], tables, lengths)

    strided_q = q.transpose(0, 1).contiguous().transpose(0, 1)  # as a step hands it: rows apart
    out = gemv.decode_attention(strided_q, k_pool, v_pool, 1, tables, lengths, k, v, slots)
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)
    assert torch.equal(k_pool, expected_k) and torch.equal(v_pool, expected_v)

    # nothing to write: the pool is read as it is, and left alone
    again = gemv.paged_decode(q, k_pool[1], v_pool[1], tables, lengths)
    assert torch.equal(again, out) and torch.equal(k_pool, expected_k)


def test_decode_attention_is_an_operator_a_compiler_can_trace(kernel):
    q, k, v, (k_pool, v_pool), tables, lengths, slots = paged_case(torch.float32, 1)
    checks = torch.library.opcheck(torch.ops.minillm.decode_attention.default,
                                   (q, k_pool, v_pool, 1, tables, lengths, k, v, slots))
    assert set(checks.values()) == {"SUCCESS"} and "test_faketensor" in checks


def test_decode_attention_refuses_what_it_cannot_read(kernel):
    q, k, v, (k_pool, v_pool), tables, lengths, slots = paged_case(torch.float32, 2)
    with pytest.raises(RuntimeError, match="come together"):
        gemv.decode_attention(q, k_pool, v_pool, 0, tables, lengths, k, v)  # no slots
    with pytest.raises(RuntimeError, match="float32 or bfloat16, not Double"):
        gemv.decode_attention(q.double(), k_pool, v_pool, 0, tables, lengths)
    with pytest.raises(RuntimeError, match="the pools' heads, head_dim or dtype are not q's"):
        gemv.decode_attention(q.bfloat16(), k_pool, v_pool, 0, tables, lengths)
    with pytest.raises(RuntimeError, match="no layer 3"):
        gemv.decode_attention(q, k_pool, v_pool, 3, tables, lengths)
    with pytest.raises(RuntimeError, match="one row per query"):
        gemv.decode_attention(q, k_pool, v_pool, 0, tables[:1], lengths)


def tiny_model() -> GPT:
    torch.manual_seed(0)
    return GPT(get_preset("tiny")).eval()


PROMPTS = [[5, 6, 7], [100, 200, 300, 400, 500] * 5, [9], [42, 43] * 9]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("captured", [False, True])
def test_the_cpu_engine_attends_by_the_kernel_with_the_plain_paths_tokens(kernel, captured):
    model = tiny_model()
    options = dict(num_blocks=48, block_size=4)
    default = LLM(model, **options, enforce_eager=False if captured else None)
    assert getattr(default.engine.runner.attention, "name", None) == "cpu"
    plain = LLM(model, **options, enforce_eager=True)  # the reference path gathers
    assert plain.engine.runner.attention == "torch"
    outputs = [[o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] for llm in (default, plain)]
    assert outputs[0] == outputs[1]


def test_cpu_attention_is_refused_where_it_cannot_run(kernel, monkeypatch):
    with pytest.raises(EngineOptionError, match="runs on one device"):
        EngineConfig(attention="cpu", tensor_parallel_size=2)
    with pytest.raises(EngineOptionError, match="attention='cpu'"):
        EngineConfig(attention="cpu", pipeline_parallel_size=2)
    with pytest.raises(EngineOptionError, match="attention='cpu' needs float32 or bfloat16"):
        build_engine(tiny_model().half(), EngineConfig(num_blocks=8, block_size=4, attention="cpu"))
    monkeypatch.setattr(gemv, "_loaded", False)  # a machine where the kernels did not build
    engine = build_engine(tiny_model(), EngineConfig(num_blocks=8, block_size=4))
    assert engine.runner.attention == "torch"  # the default falls back to the gather
    with pytest.raises(EngineOptionError, match="the C\\+\\+ kernels built"):
        build_engine(tiny_model(), EngineConfig(num_blocks=8, block_size=4, attention="cpu"))
