"""The captured decode step: padded to buckets, compiled (CPU) or recorded (CUDA), and always
giving the tokens the eager step gives."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from minillm.model.config import get_preset
from minillm.engine import LLM, build_engine
from minillm.speedups import decode_graphs, gemv, packed, quant
from minillm.engine.block_allocator import BlockAllocator
from minillm.speedups.decode_graphs import DecodeGraphs, bucket_sizes, capture_unsupported
from minillm.engine.kv_cache import PagedKVPool, gather_decode_attention, loop_decode_attention, slot_of
from minillm.engine.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.model.gpt import GPT
from minillm.speedups.packed import FEW_ROWS
from minillm.speedups.quant import quantize_model
from minillm.decoding.sampling import SamplingParams

SHARED = [11, 12, 13, 14, 15, 16, 17, 18, 19]  # two full blocks of 4: a prefix-cache hit for each prompt after the first


@pytest.fixture(autouse=True)
def inductor_without_autotuning(monkeypatch) -> None:
    """Compile with frozen weights but without max-autotune. These tests check the step's
    logic (buckets, padding, pad block, preemption); which matrix kernel autotuning picks
    changes none of it, and timing every candidate costs minutes on a cold CI cache. The real
    configuration's tokens are checked against eager in chapter 12, which asserts them."""
    monkeypatch.setattr(decode_graphs, "CPU_INDUCTOR_CONFIG", {**decode_graphs.CPU_INDUCTOR_CONFIG, "max_autotune": False})


def _model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(get_preset("tiny")).eval()


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts that share a prefix, outputs of different lengths (so the batch shrinks through
    every bucket), two of them sampled with a seed."""
    prompts = [SHARED + [(7 * i + j) % 400 + 20 for j in range(i % 3 + 1)] for i in range(7)]
    params = [SamplingParams(max_tokens=6 + 5 * i, temperature=0, ignore_eos=True) for i in range(7)]
    params[2] = SamplingParams(max_tokens=20, temperature=0.8, top_k=50, seed=5, ignore_eos=True)
    params[5] = SamplingParams(max_tokens=14, temperature=1.0, seed=9, ignore_eos=True)
    return prompts, params


def _generate(llm: LLM, prompts, params) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def test_buckets_are_powers_of_two_up_to_the_first_that_holds_the_batch():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(5) == [1, 2, 4, 8]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    graphs = DecodeGraphs(_model(), PagedKVPool(get_preset("tiny"), 8, 4, torch.device("cpu"), torch.float32), 5)
    assert [graphs.bucket(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert graphs.tables.shape == (8, 64 // 4)  # every row can span the whole context


def test_the_pad_block_is_storage_the_allocator_never_hands_out():
    pool = PagedKVPool(get_preset("tiny"), 6, 4, torch.device("cpu"), torch.float32)
    allocator = BlockAllocator(6, 4)
    taken = [allocator.take_free_block() for _ in range(6)]
    assert pool.k.shape[1] == 7 and pool.pad_block == 6
    assert sorted(taken) == list(range(6))


def test_one_slot_formula_and_one_padded_gather_serve_every_path():
    """Slots by position, on ints and on tensors alike; tables padded with the pad block; and
    the gather the eager and the captured decode share, with the pool's scratch or without,
    equal to reading each row's own slots one row at a time."""
    cfg = get_preset("tiny")
    pool = PagedKVPool(cfg, 8, 4, torch.device("cpu"), torch.float32)
    pool.k.normal_(), pool.v.normal_()
    table = [5, 2, 7]
    assert [slot_of(table, p, 4) for p in range(11)] == [20, 21, 22, 23, 8, 9, 10, 11, 28, 29, 30]
    assert slot_of(torch.tensor(table), torch.arange(11), 4).tolist() == [slot_of(table, p, 4) for p in range(11)]
    tables = torch.tensor([pool.table_row(table, 4), pool.table_row([1], 4)])
    assert tables[1].tolist() == [1, pool.pad_block, pool.pad_block, pool.pad_block]
    q = torch.randn(2, cfg.n_heads, cfg.head_dim)
    args = (q, pool.k[1], pool.v[1], tables, torch.tensor([11, 3]))
    expected = loop_decode_attention(*args)
    torch.testing.assert_close(gather_decode_attention(*args), expected)
    torch.testing.assert_close(gather_decode_attention(*args, scratch=pool.scratch(tables.numel())), expected)


def test_compiled_decode_gives_the_eager_tokens_through_preemption_and_prefix_hits():
    model = _model()
    prompts, params = _workload()
    options = dict(num_blocks=14, block_size=4, max_num_seqs=4)
    eager = LLM(model, **options, enforce_eager=True)
    compiled = LLM(model, **options, enforce_eager=False)
    expected = _generate(eager, prompts, params)
    assert _generate(compiled, prompts, params) == expected
    stats, graphs = compiled.engine.stats(), compiled.engine.graphs
    assert stats.preemptions > 0 and stats.prefix_cache_hit_rate > 0
    assert graphs is not None and graphs.mode == "compile"
    assert len(graphs.prepare_seconds) >= 3  # the steps went through several buckets' programs
    assert eager.engine.graphs is None


def test_padding_rows_write_only_the_pad_block():
    model = _model()
    engine = build_engine(model, EngineConfig(num_blocks=8, block_size=4, max_num_seqs=4, enforce_eager=False,
                                              async_scheduling=False))  # each step done when step() returns
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    engine.step()  # the three prefills
    used = sorted({b for seq in engine.scheduler.running for b in seq.block_table})
    before = engine.pool.k.clone()
    engine.step()  # three decodes in the bucket of 4: one padding row
    assert engine.graphs is not None and set(engine.graphs.prepare_seconds) == {4}
    changed = (engine.pool.k != before).flatten(2).any(-1).any(0)  # per block
    assert set(changed.nonzero().flatten().tolist()) <= {*used, engine.pool.pad_block}
    assert changed[engine.pool.pad_block]
    assert engine.graphs.lengths[3] == 1 and engine.graphs.slots[3] == engine.pool.pad_block * 4


class _GraphRecorder(TorchDispatchMode):
    """A CUDA graph's contract, on a CPU: record every operator the step runs, with the very
    tensors it read and wrote, then replay them on those same tensors. Anything the real graph
    would get wrong (an input not in a static buffer, an output allocated afresh, the host
    reading a device value mid-capture) goes wrong here too."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("the step read a device value on the host during capture")
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs or {}, out))
        return out

    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            fresh = func(*args, **kwargs)
            for old, new in zip(tree_flatten(out)[0], tree_flatten(fresh)[0]):
                if isinstance(old, torch.Tensor) and old.untyped_storage().data_ptr() != new.untyped_storage().data_ptr():
                    old.copy_(new)


def _fake_capture(replays: list[int]):
    def capture(fn, pool):
        recorder = _GraphRecorder()
        with torch.inference_mode(), recorder:
            outputs = fn()

        def replay():
            replays.append(1)
            recorder.replay()
            return outputs

        return replay, pool

    return capture


def test_the_cuda_graph_path_replays_the_eager_tokens(monkeypatch):
    replays: list[int] = []
    monkeypatch.setattr(decode_graphs, "capture_cuda_graph", _fake_capture(replays))
    model = _model()
    prompts, params = _workload()
    options = dict(num_blocks=14, block_size=4, max_num_seqs=4)
    expected = _generate(LLM(model, **options, enforce_eager=True), prompts, params)
    llm = LLM(model, **options, enforce_eager=True)
    engine = llm.engine
    engine.graphs = engine.runner.graphs = DecodeGraphs(model, engine.pool, 8, mode="cuda-graph")
    engine.graphs.prepare()  # recorded up front with padding rows only, as at start-up
    assert _generate(llm, prompts, params) == expected
    assert len(replays) > 10 and engine.stats().preemptions > 0


def test_models_the_captured_step_does_not_cover_run_eagerly():
    model = _model()
    quantize_model(model, "int4")
    assert "quantized" in capture_unsupported(model)
    engine = build_engine(model, EngineConfig(num_blocks=8, block_size=4, enforce_eager=False))
    assert engine.graphs is None and "quantized" in engine.eager_reason
    assert build_engine(_model(), EngineConfig(num_blocks=8, block_size=4)).graphs is None  # a CPU compiles when asked


def test_an_int8_model_is_captured_on_a_cpu_and_gives_the_eager_tokens(kernel, monkeypatch):
    """Its few-row products call the int8 kernel inside the compiled program; wider ones
    PyTorch's own, and the greedy tokens are the eager engine's (a sampled token may differ:
    the compiled step sums in another order, and a seeded draw near a boundary moves with it)."""
    monkeypatch.setattr(quant, "small_kernel_rows", lambda layers, dtype: frozenset({1, 2, 4}))
    prompts, params = _workload()
    params = [replace(p, temperature=0, seed=None) for p in params]
    options = dict(num_blocks=32, block_size=4, max_num_seqs=8, quantize="int8", dtype="float32")
    expected = _generate(LLM(_model(), **options), prompts, params)
    llm = LLM(_model(), **options, enforce_eager=False)
    assert llm.engine.graphs is not None
    assert _generate(llm, prompts, params) == expected
    assert "minillm::small_linear_int8" in _operators_run(llm.engine.graphs.program(4))
    assert "minillm::small_linear_int8" not in _operators_run(llm.engine.graphs.program(8))


def test_the_plain_engine_runs_eagerly_and_refuses_what_needs_a_plug_in():
    engine = LLMEngine(_model(), EngineConfig(num_blocks=8, block_size=4))
    assert engine.graphs is None and "plain" in engine.eager_reason
    for option in (dict(enforce_eager=False), dict(pack_weights=True), dict(attention="triton")):
        with pytest.raises(ValueError, match="build_engine"):
            LLMEngine(_model(), EngineConfig(num_blocks=8, block_size=4, **option))


def test_the_server_prepares_every_bucket_before_it_listens_and_says_so():
    from server.__main__ import prepare_decode

    engine = build_engine(_model(), EngineConfig(num_blocks=8, block_size=4, max_num_seqs=2, enforce_eager=False))
    line = prepare_decode(engine)
    assert sorted(engine.graphs.prepare_seconds) == [1, 2]
    assert line.startswith("decode steps compiled with torch.compile for batches of 1..2 in ")
    eager = build_engine(_model(), EngineConfig(num_blocks=8, block_size=4, enforce_eager=True))
    assert prepare_decode(eager) == "decode steps run eagerly (enforce_eager)"


def test_an_unknown_capture_mode_is_refused():
    pool = PagedKVPool(get_preset("tiny"), 8, 4, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="mode must be"):
        DecodeGraphs(_model(), pool, 4, mode="jit")


def _operators_run(program) -> set[str]:
    with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        program()
    return {event.key for event in prof.key_averages()}


def test_a_compiled_cpu_steps_few_row_products_go_through_the_small_batch_kernel(monkeypatch):
    assert gemv.load()  # a CI machine has a compiler; if this fails, the kernel did not build
    # whatever this machine would time (packed.kernel_rows), the kernel is the faster up to FEW_ROWS
    monkeypatch.setattr(packed, "kernel_rows", lambda weights: {
        tuple(w.shape): frozenset(1 << i for i in range(FEW_ROWS.bit_length())) for w in weights})
    engine = build_engine(_model(), EngineConfig(num_blocks=16, block_size=4, max_num_seqs=32, enforce_eager=False))
    graphs = engine.graphs
    assert "minillm::small_linear" in _operators_run(graphs.program(FEW_ROWS))
    past = _operators_run(graphs.program(2 * FEW_ROWS))  # more rows: the library's products, as autotuned
    assert "minillm::small_linear" not in past and any("mm" in name or "linear" in name for name in past)
    monkeypatch.setattr(gemv, "supports", lambda weight: False)  # a machine where the kernel did not build
    model = _model()
    pool = PagedKVPool(model.cfg, 8, 4, torch.device("cpu"), torch.float32)
    assert DecodeGraphs(model, pool, 4).step.model is model
