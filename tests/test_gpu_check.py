"""The GPU check's driver: every step guarded, sliced from one budget, recorded.

The steps here are fakes, so what is checked is the driver: a step that raises, crashes or
hangs is recorded with why and the next step still runs; a spent budget skips steps; without
CUDA a real run skips everything. One real step runs its dry run end to end in a child process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from minillm.bench.gpu_check import RESULTS, ROOT, STEPS, Step, child_env, run_steps

HERE = "tests.test_gpu_check"  # the child processes import the fake steps from here


def boom(ctx) -> None:
    ctx.save(before="saved")
    raise ValueError("planted failure")


def fine(ctx) -> None:
    ctx.save(answer=42, slice_s=ctx.slice_s)


def hang(ctx) -> None:
    ctx.save(started=True)
    time.sleep(60)


def crash(ctx) -> None:
    os._exit(3)


def test_a_failing_step_is_recorded_and_the_next_still_runs(tmp_path) -> None:
    steps = [Step("boom", "raises", 1, boom), Step("fine", "works", 1, fine)]
    report = run_steps(steps, tmp_path / "out", budget_s=100, dry_run=True, isolate=False, work=tmp_path)
    boom_, fine_ = report["steps"]["boom"], report["steps"]["fine"]
    assert boom_["status"] == "failed" and boom_["error"] == "ValueError: planted failure"
    assert "planted failure" in boom_["traceback"] and boom_["result"] == {"before": "saved"}
    assert fine_["status"] == "ok" and fine_["result"]["answer"] == 42
    assert json.loads((tmp_path / "out" / RESULTS).read_text())["steps"] == report["steps"]


def test_the_budget_is_shared_out_and_a_spent_one_skips_steps(tmp_path) -> None:
    now = [0.0]

    def slow(ctx) -> None:
        now[0] += 120  # past the whole budget

    steps = [Step("a", "", 1, fine), Step("slow", "", 1, slow), Step("b", "", 2, fine), Step("c", "", 1, fine)]
    report = run_steps(steps, tmp_path / "out", budget_s=100, dry_run=True, isolate=False, work=tmp_path,
                       clock=lambda: now[0])
    s = report["steps"]
    assert s["a"]["result"]["slice_s"] == (100 - 5) * 1 / 5  # its share of the budget less the reserve
    assert s["slow"]["status"] == "ok"
    assert s["b"]["status"].startswith("skipped: budget spent") and s["c"]["status"].startswith("skipped: budget")
    assert "result" not in s["b"]


def test_without_cuda_a_real_run_skips_every_step(tmp_path) -> None:
    report = run_steps(STEPS, tmp_path / "out", budget_s=480, dry_run=False, has_cuda=False, work=tmp_path)
    assert list(report["steps"]) == [s.name for s in STEPS]
    assert all(e["status"].startswith("skipped: no CUDA") for e in report["steps"].values())


def test_isolated_steps_survive_a_crash_and_a_hang(tmp_path) -> None:
    steps = [Step("crash", "", 1, f"{HERE}:crash"), Step("hang", "", 1, f"{HERE}:hang"),
             Step("boom", "", 1, f"{HERE}:boom"), Step("fine", "", 1, f"{HERE}:fine")]
    began = time.monotonic()
    report = run_steps(steps, tmp_path / "out", budget_s=5 + 4 * 4, dry_run=True, work=tmp_path)
    s = report["steps"]
    assert time.monotonic() - began < 40  # the hang was killed at the end of its slice (about 5 s), not waited for
    assert s["crash"]["status"] == "crashed" and "status 3" in s["crash"]["error"]
    assert s["hang"]["status"] == "timeout" and s["hang"]["result"] == {"started": True}
    assert s["boom"]["status"] == "failed" and "planted failure" in s["boom"]["traceback"]
    assert s["fine"]["status"] == "ok" and s["fine"]["result"]["answer"] == 42


def test_the_dry_run_of_a_real_step_writes_its_result_and_plot(tmp_path) -> None:
    out = tmp_path / "gpu"
    proc = subprocess.run([sys.executable, "-m", "minillm.bench.gpu_check", str(out), "--dry-run", "--only", "machine"],
                          cwd=ROOT, env=child_env() | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((out / RESULTS).read_text())
    machine = report["steps"]["machine"]
    assert machine["status"] == "ok", machine.get("traceback")
    assert machine["result"]["tokenizer"]["ok"] and machine["result"]["decode"]["points"]
    assert report["dry_run"] and report["weights"].startswith("random") and not report["files"]["problems"]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "roofline.png"]


def test_the_chapters_read_the_newest_committed_gpu_check(tmp_path):
    from minillm.bench.gpu_check import committed_results

    assert committed_results(tmp_path) is None
    for folder, commit in (("2026-12-04-h200", "old"), ("2027-01-10-h100", "new")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "gpu_check.json").write_text(json.dumps({"commit": commit}))
    (tmp_path / "notes").mkdir()  # a folder without a report is not a run
    assert committed_results(tmp_path) == {"commit": "new", "folder": "2027-01-10-h100"}
    committed = committed_results()  # this checkout's own: every step of it passed
    assert committed is not None and all(s["status"] == "ok" for s in committed["steps"].values())
