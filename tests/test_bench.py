"""The engine benchmark in its smoke size: it runs every method and its accounting adds up.
(It does not judge speed: CI machines are too noisy for that. The figures live in the book.)"""

import json

import pytest
import torch

from minillm.bench import engine as eb
from minillm.bench.__main__ import main, parse_range
from minillm.cli import UsageError
from minillm.model.config import get_preset
from minillm.model.gpt import count_parameters


def test_smoke_run_reports_every_method(tmp_path, home) -> None:
    assert main(["engine", "--smoke", "--dtypes", "float32", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "engine-tiny.json").read_text())
    assert (tmp_path / "engine-tiny.png").stat().st_size > 1000
    run = report["runs"]["float32"]
    methods = [r["method"] for r in run["results"]]
    assert methods[:4] == ["naive loop", "KV cache, one at a time", "static batches of 3", "paged engine"]
    assert any(m.startswith("transformers generate") for m in methods)
    workload = eb.Workload.uniform(6, (4, 24), (4, 24), 50257, seed=0)
    by_method = {r["method"]: r for r in run["results"]}
    assert by_method["paged engine"]["output_tokens"] == workload.output_tokens
    assert by_method["naive loop"]["output_tokens"] == workload.head(2).output_tokens
    for r in run["results"]:  # the smoke size runs every method twice: the median of the two, and both runs
        assert len(r["extra"]["seconds_runs"]) == 2 and r["seconds"] == pytest.approx(sum(r["extra"]["seconds_runs"]) / 2)
    paged = by_method["paged engine"]["tokens_per_s"]
    for method, ratio in run["speedup_of_paged_engine"].items():
        assert ratio == pytest.approx(paged / by_method[method]["tokens_per_s"])
    waste = run["kv_waste"]
    assert all(0 <= v < 1 for v in waste.values())
    assert waste["paged"] < waste["max_context"]  # blocks waste less than whole-context reservations
    b1 = run["batch1"]  # the roof is every weight read once per token at the measured bandwidth
    assert b1["roofline_tokens_per_s"] == pytest.approx(b1["bandwidth"] / b1["weight_bytes"])
    assert b1["fraction_of_roofline"] == pytest.approx(b1["tokens_per_s"] / b1["roofline_tokens_per_s"])
    assert b1["weight_bytes"] == 4 * count_parameters(get_preset("tiny"))  # float32: four bytes a parameter


def test_a_method_slower_than_repeat_under_runs_once(tmp_path, home) -> None:
    assert main(["engine", "--smoke", "--dtypes", "float32", "--no-hf", "--repeat-under", "0",
                 "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "engine-tiny.json").read_text())
    assert all(len(r["extra"]["seconds_runs"]) == 1 for r in report["runs"]["float32"]["results"])


def test_a_methods_runs_become_their_median_with_every_run_kept() -> None:
    runs = [eb.Result("paged engine", 4, 100, s, {"steps": 9}) for s in (3.0, 1.0, 2.0)]
    result = eb.median_run(runs)
    assert result.seconds == 2.0 and result.tokens_per_s == 50.0
    assert result.extra == {"steps": 9, "seconds_runs": [3.0, 1.0, 2.0]}


def test_contiguous_waste_arithmetic() -> None:
    w = eb.Workload([[1] * 10, [1] * 30], [10, 30])  # uses 20 and 60 slots
    waste = eb.contiguous_waste(w, context_length=100, batch_size=2)
    assert waste["max_context"] == pytest.approx(1 - 80 / 200)
    assert waste["static_batch"] == pytest.approx(1 - 80 / (2 * (30 + 30)))


def test_bad_ranges_are_one_line_errors() -> None:
    assert parse_range("16:256") == (16, 256) and parse_range("7") == (7, 7)
    for bad in ("a:b", "0:5", "9:3"):
        with pytest.raises(UsageError):
            parse_range(bad)


def test_the_decode_roof_is_the_slower_of_bytes_and_flops() -> None:
    from minillm.bench.decode import roof
    from minillm.model.config import get_preset
    from minillm.model.gpt import GPT, matmul_parameters

    model = GPT(get_preset("tiny"))
    cfg = model.cfg
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth, flops = 10e9, 1e11  # a ridge of 10 FLOP/byte, which the cache at context 100 still lets a batch reach
    compute_bound = flops / (2 * matmul_parameters(cfg))
    assert roof(model, 1, bandwidth, flops, context=0) < bandwidth / weight_bytes  # the cache's bytes count too

    def memory_bound(batch: int, context: int) -> float:  # keys and values of every layer, fp32, context + 2 positions
        return batch * bandwidth / (weight_bytes + batch * cfg.n_layers * 2 * cfg.d_model * (context + 2) * 4)

    for context in (0, 100):
        assert roof(model, 1, bandwidth, flops, context) == pytest.approx(min(memory_bound(1, context), compute_bound))
        ridge = next(b for b in range(1, 10**4) if memory_bound(b, context) >= compute_bound)
        assert roof(model, ridge, bandwidth, flops, context) == pytest.approx(compute_bound)
        assert roof(model, ridge - 1, bandwidth, flops, context) == pytest.approx(memory_bound(ridge - 1, context))
    # a longer context leaves fewer tokens/s at the same batch, and more so at a larger batch
    assert roof(model, 8, bandwidth, flops, 100) / roof(model, 8, bandwidth, flops, 0) < \
        roof(model, 1, bandwidth, flops, 100) / roof(model, 1, bandwidth, flops, 0)


def test_decode_summary_quotes_medians_and_the_target_ratios() -> None:
    from minillm.bench.decode import summary

    rates = {"ours, captured": {1: [10.0, 30.0, 20.0]}, "ours, eager + packed weights": {1: [40.0]},
             "ours, plain eager": {1: [5.0]}, "llama.cpp (llama-bench)": {1: [50.0, 50.0]},
             "ours, captured, library products": {1: [8.0]}}
    lines = summary({"rates": rates, "roof": {1: 100.0}})
    assert "20.0 [10-30] (20%)" in lines[0]
    assert "captured with the small-batch kernel vs captured, library products: batch 1 2.50x" in [
        line.strip() for line in lines]
    assert any(line.strip() == "captured vs llama.cpp (llama-bench): batch 1 0.40x" for line in lines)
    assert any(line.strip() == "eager + packed weights vs llama.cpp (llama-bench): batch 1 0.80x" for line in lines)


def test_the_decode_summary_gives_each_methods_step_time_against_batch_ones() -> None:
    from minillm.bench.decode import summary

    # batch 8 at 4x batch 1's tokens/s: its step takes 8 / 4 = 2x as long; batch 4 at 4x: free
    rates = {"ours, eager + packed weights": {1: [100.0], 4: [400.0], 8: [400.0]}, "ours, plain eager": {4: [9.0]}}
    lines = summary({"rates": rates, "roof": {1: 1e3, 4: 1e3, 8: 1e3}})
    assert "step(B)/step(1), ours, eager + packed weights: batch 4 1.00, batch 8 2.00" in [line.strip() for line in lines]
    assert not any("plain eager" in line and "step(B)" in line for line in lines)  # no batch 1 to compare with


def test_bf16_is_skipped_aloud_where_the_cpu_only_emulates_it(monkeypatch, capsys) -> None:
    import torch

    from minillm.bench import __main__ as bench_main

    monkeypatch.setattr(bench_main, "cpu_has_bf16_matmul", lambda: False)
    assert bench_main.parse_dtypes("float32,bfloat16", torch.device("cpu")) == [torch.float32]
    assert "skipping bfloat16" in capsys.readouterr().out
    assert bench_main.parse_dtypes("bfloat16", torch.device("cpu")) == [torch.bfloat16]  # asked alone: measured
    monkeypatch.setattr(bench_main, "cpu_has_bf16_matmul", lambda: True)
    assert bench_main.parse_dtypes("float32,bfloat16", torch.device("cpu")) == [torch.float32, torch.bfloat16]


def test_the_training_benchmark_reports_each_part_and_each_version(tmp_path, capsys) -> None:
    from minillm.bench import training as TB

    assert main(["training", "--preset", "tiny", "--dtypes", "float32", "--repeats", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "training-tiny.json").read_text())
    run_ = report["runs"]["float32"]
    assert list(run_["steps"]) == list(TB.VARIANTS)
    assert set(run_["profile_ms"]["plain"]) == set(run_["profile_ms"]["fused"]) == {
        "blocks forward", "output layer + loss forward", "backward", "clip + AdamW"}
    for r in run_["steps"].values():  # one timed round: median, min and max are that round
        assert r["tok_s_min"] == r["tok_s"] == r["tok_s_max"] == pytest.approx(8 * 64 / r["seconds"][0])
    assert (tmp_path / "training-tiny.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert all(name in printed for name in TB.VARIANTS) and "vs plain" in printed
    with pytest.raises(UsageError, match="--repeats"):
        main(["training", "--preset", "tiny", "--repeats", "0"])


def test_the_decode_profile_times_every_phase_it_names() -> None:
    """Chapter 12's profile wraps the engine's phases by name: a renamed one must fail here."""
    from minillm.bench.profile import profile_decode
    from minillm.model.config import get_preset
    from minillm.model.gpt import GPT

    torch.manual_seed(0)
    phases = profile_decode(GPT(get_preset("tiny")).eval(), 2, "ours, plain eager", 2)["phases"]
    assert {"schedule", "step tensors", "forward", "LM head", "sampling", "bookkeeping"} <= set(phases)
    assert all(phases[p] > 0 for p in ("forward", "LM head", "sampling"))


def test_the_extras_benchmark_times_each_extra_on_the_rows_it_says(tmp_path, capsys) -> None:
    """Every variant's engine holds 32 decoding requests of which exactly the named count ask
    for the extra (a schema-held row has a grammar, and its long answer keeps it masked to the
    end), and the report has one row per variant with plain as the unit."""
    from minillm.bench import extras as XB
    from minillm.model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(get_preset("tiny")).eval()
    engine = XB._engine(model, 1, XB.EXTRAS["json_schema"], max_tokens=8)
    running = engine.scheduler.running
    assert len(running) == XB.BATCH and all(s.num_output_tokens == 1 for s in running)
    assert sum(s.grammar is not None for s in running) == 1
    for _ in range(6):
        engine.step()
    assert all(not s.is_finished for s in running)  # still inside the 4,000-character string
    assert main(["extras", "--preset", "tiny", "--rounds", "1", "--steps", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "extras-tiny.json").read_text())
    names = [r["variant"] for r in report["rows"]]
    assert names == ["plain"] + [f"{e}, {k}/32" for e in XB.EXTRAS for k in (1, 32)]
    assert report["rows"][0]["vs_plain"] == 1 and (tmp_path / "extras-tiny.png").stat().st_size > 1000
    assert "json_schema, 32/32" in capsys.readouterr().out
    with pytest.raises(UsageError, match="--rounds"):
        main(["extras", "--preset", "tiny", "--rounds", "0"])


def test_the_host_fit_recovers_a_line_per_method() -> None:
    from minillm.bench.host import fit

    rows = [{"method": m, "batch": b, "step_us": fixed + per * b}
            for m, fixed, per in (("eager", 300.0, 15.0), ("captured", 100.0, 5.0)) for b in (1, 8, 64)]
    fits = fit(rows)
    assert fits["eager"] == pytest.approx({"fixed_us": 300.0, "per_sequence_us": 15.0})
    assert fits["captured"] == pytest.approx({"fixed_us": 100.0, "per_sequence_us": 5.0})


def test_the_host_benchmark_accounts_for_each_step_and_saves_its_report(tmp_path, capsys) -> None:
    """Each point's phases (other Python included) add up to the timed steps, so none is lost,
    and a step's wall time is about that sum; the served probe streams every token it was asked
    for (a time per token is measured from them); the report and its figure are saved."""
    threads = torch.get_num_threads()
    assert main(["host", "--batches", "1,4", "--methods", "eager,eager-overlap", "--steps", "4", "--server", "2",
                 "--tokens", "6", "--threads", "1", "--out", str(tmp_path)]) == 0
    assert torch.get_num_threads() == threads  # the probe's one thread was this run's only
    report = json.loads((tmp_path / "host-cpu.json").read_text())
    assert (tmp_path / "host-cpu.png").stat().st_size > 0
    assert [(r["method"], r["batch"]) for r in report["rows"]] == [
        ("eager", 1), ("eager", 4), ("eager-overlap", 1), ("eager-overlap", 4)]
    overlapped = report["rows"][2:]
    assert all(r["phases_us"] == {} and r["step_us"] > 0 for r in overlapped)  # timed whole: its phases overlap
    for row in report["rows"][:2]:
        phases = row["phases_us"]
        assert {"schedule", "step tensors", "forward", "sampling", "bookkeeping", "other Python"} <= set(phases)
        assert all(v >= 0 for v in phases.values()) and phases["forward"] > 0
        assert 0.2 < sum(phases.values()) / row["step_us"] < 5  # the same steps, timed two ways
    assert set(report["fits"]) == {"eager", "eager-overlap"} and "fit, eager-overlap" in capsys.readouterr().out
    assert [(r["batch"], r["overlap"]) for r in report["server"]] == [(2, False), (2, True)]
    assert all(0 < r["tpot_us"] < 1e6 for r in report["server"]) and report["server_tokens"] == 6


def test_the_host_benchmark_names_a_bad_flag() -> None:
    with pytest.raises(UsageError, match="--methods"):
        main(["host", "--methods", "eager,fast"])


def test_the_quiet_profiler_counts_operators_and_leaves_no_native_lines_behind(capfd):
    import os

    from torch.profiler import ProfilerActivity

    from minillm.bench.profile import quiet_profile

    with quiet_profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(4) + 1
    assert any(event.key == "aten::add" for event in prof.key_averages())
    os.write(2, b"still heard\n")  # the error stream is put back afterwards
    err = capfd.readouterr().err
    assert "still heard" in err and "profiler_start" not in err and "profiler_stop" not in err


def test_pyplot_leaves_a_notebooks_backend_alone_and_switches_a_terminals_to_agg(monkeypatch) -> None:
    import sys
    import types

    import matplotlib

    from minillm.bench import pyplot

    before = matplotlib.get_backend()
    try:
        matplotlib.use("svg")
        monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
        pyplot()
        assert matplotlib.get_backend() == "svg"  # a kernel's own figures keep showing
        monkeypatch.delitem(sys.modules, "ipykernel")
        pyplot()
        assert matplotlib.get_backend().lower() == "agg"
    finally:
        matplotlib.use(before)


def test_a_report_saved_from_a_terminal_records_the_command_that_made_it(tmp_path, monkeypatch) -> None:
    import sys

    from minillm.bench import command_line, save_report
    from minillm.settings import project_root

    main_py = str(project_root() / "minillm" / "bench" / "__main__.py")
    assert command_line([main_py, "decode", "--batches", "1,8"]) == "python -m minillm.bench decode --batches 1,8"
    router = str(project_root() / "server" / "router" / "bench.py")
    assert command_line([router, "--out", "x"]) == "python -m server.router.bench --out x"
    assert command_line([str(tmp_path / "elsewhere.py")]) is None  # not this project's module
    assert command_line(["-c"]) is None  # a notebook's kernel or python -c
    venv_pytest = str(project_root() / ".venv" / "lib" / "site-packages" / "pytest" / "__main__.py")
    assert command_line([venv_pytest, "tests/"]) is None  # a test runner installed inside the checkout

    monkeypatch.setattr(sys, "argv", [main_py, "extras", "--rounds", "3"])
    saved = json.loads(save_report({"rows": []}, tmp_path / "r.json").read_text())
    assert saved == {"rows": [], "command": "python -m minillm.bench extras --rounds 3"}
    monkeypatch.setattr(sys, "argv", ["-c"])
    assert "command" not in json.loads(save_report({"rows": []}, tmp_path / "s.json").read_text())
