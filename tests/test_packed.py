"""Prepacked oneDNN weights: the same numbers as the plain model, the same parameters, and
nothing left packed once the model that used them is gone."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn

from minillm.speedups import gemv, packed
from minillm.model.config import get_preset
from minillm.engine import LLM
from minillm.model.gpt import GPT
from minillm.speedups.packed import PackedLinear, PackedTokenEmbedding, pack_weights, packing_unsupported
from minillm.decoding.sampling import SamplingParams


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(get_preset("tiny")).eval()


@torch.inference_mode()
def test_a_packed_model_computes_what_the_plain_one_does_and_shares_its_parameters():
    model = _model()
    fast = pack_weights(model)
    tokens = torch.randint(0, 50257, (3, 9))
    torch.testing.assert_close(fast(tokens), model(tokens), rtol=1e-5, atol=1e-5)
    assert {id(p) for p in fast.parameters()} == {id(p) for p in model.parameters()}
    assert isinstance(fast.blocks[0].mlp.fc, PackedLinear) and isinstance(fast.tok_emb, PackedTokenEmbedding)
    assert type(model.blocks[0].mlp.fc) is nn.Linear  # the original is untouched


def test_packed_copies_live_as_long_as_the_modules_that_use_them():
    model = _model()
    gc.collect()  # engines other tests left in reference cycles take their packed copies with them now, not below
    before = len(packed._PACKED)
    first, second = pack_weights(model), pack_weights(model)
    linears = sum(isinstance(m, nn.Linear) for m in model.modules()) + 1  # and the tied head
    assert len(packed._PACKED) == before + linears
    del first
    gc.collect()
    assert len(packed._PACKED) == before + linears  # the second copy still uses them
    del second
    gc.collect()
    assert len(packed._PACKED) == before


@torch.inference_mode()
def test_a_weight_changed_after_packing_falls_back_to_the_plain_product():
    fast = pack_weights(_model())
    layer = fast.blocks[0].attn.qkv
    x = torch.randn(2, layer.weight.shape[1])
    layer.weight.data = layer.weight.data * 2  # a new tensor: its address has no packed copy
    torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias))


def test_the_engine_packs_by_default_on_a_cpu_and_not_for_the_reference_path():
    model = _model()
    prompts = [[5, 6, 7], [100, 200, 300, 400, 500]]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    fast, plain = LLM(model, num_blocks=16, block_size=4), LLM(model, num_blocks=16, block_size=4, enforce_eager=True)
    assert isinstance(fast.engine.model.tok_emb, PackedTokenEmbedding)
    assert plain.engine.model is model
    assert [o.token_ids for o in fast.generate(prompts, greedy, use_tqdm=False)] == \
        [o.token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]


def test_what_cannot_be_packed_says_why():
    assert "float32 or bfloat16" in packing_unsupported(_model().to(torch.float16))
    assert packing_unsupported(_model()) is None
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        LLM(_model().to(torch.float16), num_blocks=8, pack_weights=True)
    assert LLM(_model().to(torch.float16), num_blocks=8).engine.model.dtype == torch.float16  # unpacked


@torch.inference_mode()
def test_bfloat16_weights_pack_where_onednn_multiplies_bfloat16_and_compute_the_same_numbers():
    model = _model().to(torch.bfloat16)
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert "AVX-512" in packing_unsupported(model)
        return
    fast = pack_weights(model)
    assert isinstance(fast.tok_emb, PackedTokenEmbedding)
    tokens = torch.randint(0, 50257, (3, 9))
    for rows in (tokens[:1, :1], tokens[:, -1:], tokens):  # one row, a few, a prefill's many
        ours, plain = fast(rows).float(), model(rows).float()
        # each road sums in fp32 but in its own order: bf16 rounding of the layers' outputs differs
        torch.testing.assert_close(ours, plain, rtol=0.05, atol=0.05)
        assert (ours.argmax(-1) == plain.argmax(-1)).float().mean() > 0.9


def test_slabs_share_the_rows_evenly_between_threads():
    assert packed.slabs_for(1536, 2) == 2
    assert packed.slabs_for(50257, 2) == 29  # 29 x 1,733: 15 slabs to one thread, 14 to the other
    assert packed.slabs_for(50257, 4) == 1  # 29 slabs over 4 threads leaves one 10% over: no split
    assert packed.slabs_for(7, 2) == 1 and packed.slabs_for(1024, 1) == 1


# Each road under test at one row, with another at two to four rows and a third at five to FEW_ROWS.
FEW = {"slabs": "gemv", "packed": "plain", "plain": "gemv", "gemv": "packed"}
LATER = {"slabs": "plain", "packed": "gemv", "plain": "packed", "gemv": "plain"}


@pytest.mark.parametrize("road", list(FEW))
@torch.inference_mode()
def test_each_row_count_takes_the_road_timed_at_its_bucket_and_many_rows_the_packed_kernel(monkeypatch, road):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    few, later = FEW[road], LATER[road]
    if "gemv" in (road, few, later) and not gemv.load():
        pytest.skip("the small-batch kernel did not build here")

    def fastest(rows: int) -> str:
        return road if rows == 1 else few if rows <= 4 else later

    # whatever this machine would time, the roads under test are the fastest at their buckets
    monkeypatch.setattr(packed, "time_roads", lambda weights: {tuple(w.shape): {
        rows: {"slabs": 4.0, "packed": 3.0, "plain": 2.0, "gemv": 1.0, fastest(rows): 0.0} for rows in packed.BUCKETS}
        for w in weights})
    torch.manual_seed(0)
    layer = nn.Linear(64, 58)  # 58 = 2 x 29 rows
    head = nn.Linear(64, 29 * 3, bias=False)  # an odd row count, cut in 29 slabs of 3
    for plain in (layer, head):
        fast = PackedLinear(plain)
        entry = packed._PACKED[packed._key(plain.weight)]
        assert entry.slabs == packed.slabs_for(plain.out_features, torch.get_num_threads())
        assert entry.roads == {rows: fastest(rows) for rows in packed.BUCKETS}
        for rows in (1, 2, 3, 5, packed.FEW_ROWS, packed.FEW_ROWS + 1):
            x = torch.randn(rows, 64)
            with Ops() as seen:
                y = fast(x)
            torch.testing.assert_close(y, plain(x), rtol=1e-5, atol=1e-5)
            taken = fastest(rows) if rows <= packed.FEW_ROWS else "packed"
            assert bool(seen.names & {"bmm", "baddbmm"}) == (taken == "slabs")
            assert ("_linear_pointwise" in seen.names) == (taken == "packed")
            assert bool(seen.names & {"addmm", "mm", "linear"}) == (taken == "plain")
            assert ("small_linear" in seen.names) == (taken == "gemv")


def test_a_product_counts_as_the_next_power_of_two_rows():
    assert [packed.bucket_of(n) for n in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]
    assert packed.BUCKETS == (1, 2, 4, 8, 16) and packed.BUCKETS[-1] == packed.FEW_ROWS


@torch.inference_mode()
def test_roads_are_timed_over_all_weights_in_step_order_once_per_process(monkeypatch):
    """Each road is timed over all the weights in order, each call's time added to its shape's;
    packing takes the fastest road at each bucket, a compiled step the kernel where it beats
    both library roads."""
    if not gemv.load():
        pytest.skip("the small-batch kernel did not build here")
    monkeypatch.setattr(packed, "_TIMINGS", {})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # so both shapes split into 2 slabs
    clock, calls = iter(range(10**6)), []

    def multiply(road, rows, weight, copy, slabs, bias=None):
        calls.append((road, rows.shape[0], tuple(weight.shape)))
        next(clock)  # each call takes one tick of the fake clock, plus its road's and shape's cost:
        square = weight.shape[0] == 8
        extra = {"gemv": 0 if square else 1 if rows.shape[0] <= 2 else 3, "packed": 2, "plain": 4,
                 "slabs": 5 if square else 0}[road]
        for _ in range(extra):
            next(clock)

    monkeypatch.setattr(packed, "multiply", multiply)
    monkeypatch.setattr(packed.time, "perf_counter", lambda: next(clock))
    torch.manual_seed(0)
    weights = [torch.randn(8, 16), torch.randn(12, 16), torch.randn(8, 16)]
    timings = packed.time_roads(weights, rounds=3)
    # every road at every bucket, the slabs at one row only, (1 untimed + 3) passes over all three weights in order
    assert len(calls) == (5 * 3 + 1) * 4 * 3
    assert calls[:6] == [(road, 1, shape) for road in ("gemv", "packed") for shape in ((8, 16), (12, 16), (8, 16))]
    assert set(timings[(12, 16)][1]) == {"gemv", "packed", "plain", "slabs"} and "slabs" not in timings[(12, 16)][2]
    assert timings[(8, 16)][4] == {"gemv": 2 * 2, "packed": 2 * 4, "plain": 2 * 6}  # two weights of that shape: summed
    assert packed.fastest_roads(weights) == {(8, 16): dict.fromkeys(packed.BUCKETS, "gemv"),
                                             (12, 16): {1: "slabs", 2: "gemv", 4: "packed", 8: "packed", 16: "packed"}}
    assert packed.kernel_rows(weights) == {(8, 16): frozenset(packed.BUCKETS), (12, 16): frozenset({1, 2})}
    assert len(calls) == (5 * 3 + 1) * 4 * 3  # timed once per process


@torch.inference_mode()
def test_packing_a_model_times_its_weights_together_in_step_order(monkeypatch):
    timed = []
    monkeypatch.setattr(packed, "time_roads", lambda weights: timed.append([tuple(w.shape) for w in weights]) or {
        tuple(w.shape): {rows: {"packed": 0.0, "plain": 1.0} for rows in packed.BUCKETS} for w in weights})
    model = _model()
    fast = pack_weights(model)
    d, vocab = model.cfg.d_model, model.cfg.vocab_size
    assert timed == [[(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * model.cfg.n_layers + [(vocab, d)]]
    assert all(packed._PACKED[packed._key(w)].roads == dict.fromkeys(packed.BUCKETS, "packed")
               for w in packed.step_weights(fast))
