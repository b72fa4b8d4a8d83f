import json
import math

import pytest
import torch

from minillm.machine import hardware
from minillm.cli import run
from minillm.machine.hardware import (
    DEVICE_SPECS,
    DTYPES,
    MachineProfile,
    Timing,
    dtype_bytes,
    dtype_name,
    first_order_batch,
    format_rate,
    get_spec,
    measure_bandwidth,
    measure_machine,
    measure_matmul_flops,
    median_seconds,
    time_repeats,
)


def test_rtx4050_ridge_is_47_flop_per_byte():
    spec = get_spec("rtx4050-laptop")
    assert spec.bandwidth == 192e9 and spec.flops["fp16"] == 8.986e12
    assert spec.ridge("fp16") == pytest.approx(46.8, abs=0.1)
    # fp16 weights: 2 FLOPs per 2-byte weight per sequence, so the ridge batch equals the ridge
    assert first_order_batch(spec.ridge("fp16"), "fp16") == pytest.approx(46.8, abs=0.1)
    assert first_order_batch(spec.ridge("fp16"), "fp32") == pytest.approx(93.6, abs=0.2)


def test_rtx4050_tensor_ridge_is_what_the_datasheets_imply():
    spec = get_spec("rtx4050-laptop")
    # the Ada whitepaper's RTX 4090: 165.2 TFLOP/s dense fp16 with fp32 accumulate, 128 SMs at 2,520 MHz
    per_sm_per_clock = 165.2e12 / (128 * 2.520e9)
    assert per_sm_per_clock == pytest.approx(512, rel=1e-3)
    tensor = spec.flops["fp16-tensor"]
    assert tensor == pytest.approx(20 * per_sm_per_clock * 1.755e9, rel=1e-3)  # 20 SMs at 1,755 MHz
    assert tensor == pytest.approx(17.97e12, rel=1e-3)
    assert spec.ridge("fp16-tensor") == pytest.approx(tensor / 192e9) == pytest.approx(93.6, abs=0.1)
    # the CUDA-core figures keep their meaning: 2,560 cores x 2 FLOP x 1,755 MHz, ridge 46.8
    assert spec.flops["fp16"] == spec.flops["fp32"] == pytest.approx(2560 * 2 * 1.755e9, rel=1e-3)
    assert spec.ridge("fp16-tensor") == pytest.approx(2 * spec.ridge("fp16"), rel=1e-3)
    assert "whitepaper" in spec.source and "fp32 accumulate" in spec.note


def test_every_datasheet_names_its_source_and_dtypes():
    for key, spec in DEVICE_SPECS.items():
        assert "https://" in spec.source, key
        assert spec.flops and set(spec.flops) <= set(DTYPES) | {"fp16-tensor"}, key
        assert 5e10 <= spec.bandwidth <= 1e13, key  # 50 GB/s .. 10 TB/s
        for dtype, peak in spec.flops.items():
            assert 1e12 <= peak <= 1e16, (key, dtype)
            assert 1 < spec.ridge(dtype) < 1000, (key, dtype)
    with pytest.raises(ValueError, match="no bf16 figure"):
        get_spec("apple-m2").ridge("bf16")
    with pytest.raises(ValueError, match="unknown device 'tpu9'.*rtx4050-laptop"):
        get_spec("tpu9")


def test_dtype_names_and_sizes():
    assert dtype_name(torch.bfloat16) == "bf16" and dtype_name(torch.float32) == "fp32"
    assert [dtype_bytes(d) for d in ("fp32", "bf16", "fp16")] == [4, 2, 2]
    with pytest.raises(ValueError, match="no short name"):
        dtype_name(torch.int8)


class FakeClock:
    """A clock that moves only when told to: timings on it are exact on any machine."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_median_skips_warmup_and_outliers():
    clock = FakeClock()
    durations = iter([0.5, 0.25, 0.125, 0.0625, 0.125, 0.375])  # warm-up first, then two slow outliers

    def run() -> None:
        clock.now += next(durations)

    seconds = median_seconds(run, torch.device("cpu"), repeats=5, clock=clock)
    assert seconds == 0.125  # the median of 0.25, 0.125, 0.0625, 0.125, 0.375; the 0.5 warm-up is untimed
    assert next(durations, None) is None  # one warm-up run and five timed ones, no more


def test_timing_keeps_the_quartiles_of_the_timed_runs():
    clock = FakeClock()
    durations = iter([9.0, 0.5, 0.1, 0.3, 0.2, 0.4])  # a slow warm-up, then five runs

    def run() -> None:
        clock.now += next(durations)

    timing = time_repeats(run, torch.device("cpu"), repeats=5, clock=clock)
    assert (timing.median, timing.q1, timing.q3) == pytest.approx((0.3, 0.2, 0.4))  # the warm-up is untimed
    assert Timing.of([0.7]) == Timing(0.7, 0.7, 0.7)
    spread = Timing.of([1.0, 5.0])
    assert spread.q1 >= 1.0 and spread.q3 <= 5.0 and spread.median == 3.0  # inside the runs' range


def test_bandwidth_counts_copy_as_read_plus_write(monkeypatch):
    monkeypatch.setattr(hardware, "median_seconds", lambda fn, device, repeats: (fn(), 1.0)[1])
    assert measure_bandwidth("cpu", "copy", nbytes=4096) == 2 * 4096
    assert measure_bandwidth("cpu", "reduce", nbytes=4096) == 4096
    with pytest.raises(ValueError, match="method"):
        measure_bandwidth("cpu", "triad", nbytes=4096)


def test_matmul_counts_two_flops_per_multiply_add(monkeypatch):
    monkeypatch.setattr(hardware, "median_seconds", lambda fn, device, repeats: (fn(), 0.5)[1])
    assert measure_matmul_flops("cpu", torch.float32, n=16) == 2 * 16**3 / 0.5


def test_measured_profile_is_finite_positive_and_plausible():
    profile = measure_machine("cpu", small=True)
    assert set(profile.bandwidths) == {"copy", "reduce"}
    for rate in profile.bandwidths.values():
        assert math.isfinite(rate) and 1e8 < rate < 1e13  # 0.1 GB/s .. 10 TB/s
    assert profile.bandwidth == max(profile.bandwidths.values())
    assert "fp32" in profile.flops
    for dtype, rate in profile.flops.items():
        assert math.isfinite(rate) and 1e8 < rate < 1e16, dtype
        assert profile.ridge(dtype) == pytest.approx(rate / profile.bandwidth)
    assert profile.as_spec().ridge("fp32") == pytest.approx(profile.ridge("fp32"))


def test_profile_table_and_json_agree():
    profile = MachineProfile("cpu", "test CPU", {"copy": 10e9, "reduce": 20e9}, {"fp32": 100e9, "bf16": 800e9},
                             2**30, (1024, 2048), 5)
    assert profile.ridge("bf16") == 40.0
    table = profile.table()
    assert "20 GB/s" in table and "800 GFLOP/s" in table and "40.0" in table
    data = json.loads(json.dumps(profile.to_dict()))
    assert data["bandwidth"] == 20e9 and data["ridge"] == {"fp32": 5.0, "bf16": 40.0}


def test_format_rate():
    assert format_rate(8.986e12, "FLOP/s") == "8.99 TFLOP/s"
    assert format_rate(192e9, "B/s") == "192 GB/s"
    assert format_rate(512, "B/s") == "512 B/s"


def test_cli_json(capsys):
    with pytest.raises(SystemExit) as exit:
        run(hardware.main, ["--quick", "--json", "--device", "cpu"])
    assert exit.value.code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["device"] == "cpu" and data["ridge"]["fp32"] == pytest.approx(data["flops"]["fp32"] / data["bandwidth"])


@pytest.mark.parametrize("argv, message", [(["--bogus"], "unrecognized arguments: --bogus"),
                                           (["--device", "tpu"], "--device tpu: ")])
def test_cli_errors_are_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exit:
        run(hardware.main, argv, prog="python -m minillm.machine.hardware")
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_matmul_peak_skips_a_size_an_emulated_dtype_would_take_minutes_on(monkeypatch):
    """A fast dtype is timed at every size and keeps the best; a slow one (a reference loop at
    1 GFLOP/s) stops before the product that would take 17 s."""
    timed = []

    def fake(device, dtype, n, repeats):
        timed.append((dtype, n))
        return {torch.float32: {1024: 80e9, 2048: 100e9}, torch.bfloat16: {1024: 1e9, 2048: 1e9}}[dtype][n]

    monkeypatch.setattr(hardware, "measure_matmul_flops", fake)
    assert hardware.matmul_peak(torch.device("cpu"), torch.float32, (1024, 2048), 5) == 100e9
    assert hardware.matmul_peak(torch.device("cpu"), torch.bfloat16, (1024, 2048), 5) == 1e9
    assert timed == [(torch.float32, 1024), (torch.float32, 2048), (torch.bfloat16, 1024)]
