import math
from dataclasses import replace

import pytest
import torch
from matplotlib.figure import Figure
from torch.utils.flop_counter import FlopCounterMode

from minillm.model.config import ModelConfig, get_preset
from minillm.decoding.generate import ContiguousKVCache
from minillm.machine.hardware import DeviceSpec, get_spec, measure_machine
from minillm.model.gpt import GPT, explicit_attention
from minillm.machine.roofline import (
    decode_roof,
    decode_step_cost,
    max_intensity,
    measure_decode,
    nearly_free_batch,
    plot_intensity_vs_batch,
    plot_roofline,
    predict_decode,
    ridge_batch,
)

RTX4050 = get_spec("rtx4050-laptop")
TINY = get_preset("tiny")
# A 7B-parameter model's shape (Llama-2-7B's sizes in our GPT-2 layout): weights dwarf logits.
BIG = ModelConfig(vocab_size=32000, context_length=4096, d_model=4096, n_layers=32, n_heads=32)


@pytest.mark.parametrize("cfg", [get_preset("cpu"), get_preset("tinystories-50m"), BIG], ids=["cpu", "50m", "7b"])
def test_one_sequence_without_cache_does_one_flop_per_fp16_byte(cfg):
    assert decode_step_cost(cfg, 1, 0, weight_bytes=2, kv_bytes=0).intensity == pytest.approx(1.0, abs=0.02)
    assert decode_step_cost(cfg, 1, 0, weight_bytes=4, kv_bytes=0).intensity == pytest.approx(0.5, abs=0.01)


def test_without_cache_intensity_is_about_the_batch():
    for batch in (1, 2, 4, 8, 16, 32):
        assert decode_step_cost(BIG, batch, 0, kv_bytes=0).intensity / batch == pytest.approx(1.0, abs=0.01)
    # so the ridge batch of a big model on the RTX 4050 is the ridge point itself
    assert ridge_batch(BIG, 0, RTX4050, "fp16", kv_bytes=0) == pytest.approx(46.8, abs=0.5)


def test_intensity_grows_with_batch_and_falls_with_context():
    for cfg in (get_preset("cpu"), BIG):
        by_batch = [decode_step_cost(cfg, b, 128).intensity for b in (1, 2, 4, 8, 16, 64, 256)]
        assert by_batch == sorted(by_batch) and by_batch[-1] > 10 * by_batch[0]
        by_context = [decode_step_cost(cfg, 16, c).intensity for c in (0, 64, 256, 1024, 4000)]
        assert by_context == sorted(by_context, reverse=True) and by_context[-1] < by_context[0]


def test_ridge_batch_is_where_intensity_crosses_the_ridge():
    ridge = RTX4050.ridge("fp16")
    for context in (0, 64, 256):
        batch = ridge_batch(BIG, context, RTX4050, "fp16")
        assert math.isfinite(batch) and batch > 46.8  # the cache only ever pushes it out
        below, above = (decode_step_cost(BIG, b, context).intensity for b in (math.floor(batch), math.ceil(batch)))
        assert below <= ridge <= above


def test_long_contexts_can_push_the_ridge_out_of_reach():
    context = 2048
    assert max_intensity(BIG, context) < RTX4050.ridge("fp16")
    assert ridge_batch(BIG, context, RTX4050, "fp16") == math.inf
    assert decode_step_cost(BIG, 100_000, context).intensity < RTX4050.ridge("fp16")


def test_step_flops_match_what_pytorch_counts():
    torch.manual_seed(0)
    model, batch, context = GPT(TINY).eval(), 3, 10
    cache = ContiguousKVCache(model, batch, context + 1)
    cache.length = context
    with torch.no_grad(), FlopCounterMode(display=False) as matmuls:
        model(torch.zeros(batch, 1, dtype=torch.long), torch.full((batch, 1), context), cache)
    # the fused attention kernel is invisible to the counter, so count the spelled-out one
    q = torch.randn(batch, TINY.n_heads, 1, TINY.head_dim)
    kv = torch.randn(batch, TINY.n_heads, context + 1, TINY.head_dim)
    with FlopCounterMode(display=False) as attention:
        explicit_attention(q, kv, kv)
    counted = matmuls.get_total_flops() + TINY.n_layers * attention.get_total_flops()
    assert decode_step_cost(TINY, batch, context).flops == counted


def test_step_bytes_match_the_real_tensors():
    model, batch, context = GPT(TINY).eval(), 3, 10
    cost = decode_step_cost(TINY, batch, context, weight_bytes=4)
    all_weights = sum(p.nbytes for p in model.parameters())
    assert cost.weight_bytes == all_weights - model.pos_emb.weight.nbytes + batch * model.pos_emb.weight[0].nbytes
    cache = ContiguousKVCache(model, batch, context + 1)
    read = 2 * cache.k[:, :, :, : context + 1].nbytes  # keys and values of every position so far
    written = 2 * cache.k[:, :, :, :1].nbytes  # the new token's
    assert cost.kv_bytes == read + written
    logits = batch * TINY.vocab_size * 4
    assert logits < cost.activation_bytes < 1.1 * logits  # the logits dominate what leaves the layers
    assert decode_step_cost(TINY, batch, context, weight_bytes=4, kv_bytes=0).kv_bytes == 0


def test_prediction_is_the_slower_of_compute_and_memory():
    slow_compute = DeviceSpec("toy", bandwidth=1e9, flops={"fp16": 1e10})  # ridge 10
    small = predict_decode(BIG, slow_compute, "fp16", batch=1, context=0)
    assert small.predicted_seconds == pytest.approx(small.cost.bytes / 1e9)  # memory-bound
    large = predict_decode(BIG, slow_compute, "fp16", batch=64, context=0)
    assert large.predicted_seconds == pytest.approx(large.cost.flops / 1e10)  # compute-bound
    assert large.predicted_flops == pytest.approx(1e10)
    # batching is nearly free below the ridge: 4 sequences cost far less than 4 single steps
    four = predict_decode(BIG, slow_compute, "fp16", batch=4, context=0)
    assert four.predicted_seconds < 1.1 * small.predicted_seconds


def test_nearly_free_batch_reads_the_measured_times():
    times = {16: 1.1, 1: 1.0, 2: 1.05, 4: 1.2, 8: 1.6}  # a lucky 16 after a slow 8 does not count
    points = [replace(predict_decode(TINY, RTX4050, "fp16", b, 8), measured_seconds=t) for b, t in times.items()]
    assert nearly_free_batch(points) == 4
    assert nearly_free_batch(points, slack=1.1) == 2
    assert nearly_free_batch(points, slack=2.0) == 16


@pytest.fixture
def one_thread():
    """Two threads on a busy shared CPU time the scheduler's wake-ups, not memory; the byte
    count under test does not depend on the thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_measured_decode_stays_under_the_roof(one_thread):
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    roof = decode_roof(measure_machine("cpu", small=True), TINY, "fp32")
    points = measure_decode(model, roof, batches=[1, 8], context=16, repeats=3)
    for p in points:
        assert p.dtype == "fp32" and p.measured_seconds > 0
        q1, q3 = p.measured_quartiles
        assert q1 <= p.measured_seconds <= q3 and p.as_row()["quartiles ms"] == f"{q1 * 1e3:.2f}..{q3 * 1e3:.2f}"
        # the bytes a step moves cannot arrive faster than memory delivers them (1.5x: timing noise)
        assert p.cost.bytes / p.measured_seconds < 1.5 * roof.bandwidth, p.as_row()
        assert p.as_row()["batch"] == p.batch


def test_plots_are_figures_with_the_lines_asked_for():
    points = [predict_decode(TINY, RTX4050, "fp16", b, 32) for b in (1, 4)]
    fig = plot_roofline(RTX4050, ["fp16"], points, slopes={"other memory": 50e9})
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and "RTX 4050" in ax.get_title()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["other memory", "fp16 roof: 8.99 TFLOP/s, 192 GB/s", "predicted (roofline)"]
    fig = plot_intensity_vs_batch(TINY, RTX4050, "fp16", contexts=[16, 64], batches=[1, 2, 4, 8])
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["no KV cache", "context 16", "context 64"]
