"""The GPU check's first steps (:mod:`minillm.bench.gpu_check` runs them): the machine and its
roof, the CUDA tests, the attention kernels. Each is a function of a ``Context``: it measures
with what the package already has, records with ``ctx.save`` as it goes, and writes its plot
into ``ctx.out``. ``ctx.dry_run`` shrinks every shape so that a CPU runs it in seconds.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict
from pathlib import Path

import torch

from minillm.bench.engine import load_weights
from minillm.machine.hardware import DTYPES, device_name, first_order_batch, measure_machine
from minillm.machine.roofline import decode_roof, measure_decode, nearly_free_batch, plot_roofline
from minillm.settings import project_root

GPU_PRESET = "tinystories-50m"
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def shape(ctx) -> tuple[str, str]:
    """The preset and dtype a step measures: the book's GPU model in bf16, or tiny in fp32 for
    a dry run (a CPU without bf16 units emulates it, which says nothing)."""
    return ("tiny", "fp32") if ctx.dry_run else (GPU_PRESET, "bf16")


def versions() -> dict:
    """What the machine runs: the GPU, its memory and driver, and the libraries' versions."""
    info = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(), "device": device_name(), "threads": torch.get_num_threads()}
    for name in ("triton", "transformers", "numpy", "tiktoken"):
        try:
            info[name] = __import__(name).__version__
        except Exception as err:  # noqa: BLE001 - recorded, not fatal
            info[name] = f"missing ({type(err).__name__})"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {"gpu": props.name, "gpu_memory_bytes": props.total_memory, "multiprocessors": props.multi_processor_count,
                 "capability": f"{props.major}.{props.minor}", "cudnn": torch.backends.cudnn.version()}
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        except (OSError, subprocess.SubprocessError) as err:
            info["nvidia_smi"] = f"unavailable ({err})"
    return info


def machine(ctx) -> None:
    """Step 1: versions; the offline tokenizer; measured bandwidth, matmul FLOP/s per dtype and
    ridge (:func:`minillm.machine.hardware.measure_machine`); chapter 1's decode points of the GPU model
    at batch 1..256, measured under the roof that bounds them (:mod:`minillm.machine.roofline`)."""
    ctx.save(versions=versions())
    from minillm.data.tokenizer import get_tokenizer

    ids = get_tokenizer().encode("hello world")
    ctx.save(tokenizer={"hello world": ids, "ok": ids == [31373, 995]})
    device = ctx.device
    profile = measure_machine(device, small=ctx.dry_run)
    ctx.save(profile=profile.to_dict(),
             first_order_batch={d: first_order_batch(profile.ridge(d), d) for d in profile.flops})
    print(profile.table(), flush=True)
    preset, dtype = shape(ctx)
    model, source = load_weights(preset, device)
    model.to(DTYPES[dtype])
    spec = decode_roof(profile, model.cfg, dtype)
    context = model.cfg.context_length // 2  # as chapter 1: half the window already cached
    batches = (1, 2) if ctx.dry_run else DECODE_BATCHES
    points = measure_decode(model, spec, batches, context, repeats=3 if ctx.dry_run else 10)
    rows = [p.as_row() for p in points]
    for row in rows:
        print(f"  decode B={row['batch']:<4} {row['measured ms']:8.3f} ms, {row['of roof']:.0%} of the roof", flush=True)
    ctx.save(decode={"preset": preset, "dtype": dtype, "weights": source, "context": context,
                     "roof": asdict(spec), "points": rows, "nearly_free_batch": nearly_free_batch(points)})
    fig = plot_roofline(spec, [dtype], points, title=f"{preset} decode ({dtype}, context {context}), measured roof")
    fig.savefig(ctx.out / "roofline.png", dpi=120)


def cuda_test_files(root: Path) -> list[str]:
    """The test files that hold tests marked ``cuda``."""
    return sorted(str(p.relative_to(root)) for p in (root / "tests").glob("test_*.py")
                  if "pytest.mark.cuda" in p.read_text())


def parse_junit(path: Path, keep: int = 4000) -> dict:
    """Counts of a JUnit XML report, and each test that did not pass with (the start of) why."""
    root = ET.parse(path).getroot()
    cases, counts = [], {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for case in root.iter("testcase"):
        outcome, why = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                why = (child.get("message") or "") + "\n" + (child.text or "")
        counts[outcome] += 1
        if outcome != "passed":
            cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                          "why": why.strip()[:keep]})
    return {"counts": counts, "not_passed": cases}


def cuda_tests(ctx) -> None:
    """Step 2: ``pytest -m cuda`` over the files that hold such tests, with a JUnit report
    folded into the results. On a CPU (a dry run) the Triton tests run in the interpreter and
    the CUDA-only ones skip, which checks that they are collected and reported."""
    root = project_root() or Path.cwd()
    junit = ctx.work / "cuda-tests.xml"
    files = cuda_test_files(root)
    if not files:
        raise RuntimeError("no test file under tests/ holds a test marked pytest.mark.cuda")
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
               *files]
    env = dict(os.environ, MINILLM_REQUIRE_TRITON="1")  # no Triton is a failure here, not a skip
    proc = subprocess.run(command, cwd=root, capture_output=True, text=True, env=env, timeout=max(ctx.left - 5, 5))
    ctx.save(files=files, command=" ".join(command[1:]), returncode=proc.returncode, output_tail=proc.stdout[-3000:])
    print(proc.stdout[-1500:], flush=True)
    ctx.save(**parse_junit(junit))
    counts = ctx.result["counts"]
    if proc.returncode != 0 or counts["passed"] + counts["skipped"] == 0:
        raise RuntimeError(f"pytest -m cuda exited {proc.returncode}: {counts}")


def attention(ctx) -> None:
    """Step 3: ``python -m minillm.bench attention`` on this device (on CUDA: naive, Triton and
    SDPA at T = 128..8192, then the engine's decode with each backend); ``--smoke`` when dry."""
    from minillm.bench import attention as attention_bench
    from minillm.bench.__main__ import build_parser

    argv = ["attention", "--device", str(ctx.device), "--out", str(ctx.work), *(["--smoke"] if ctx.dry_run else [])]
    report = attention_bench.run_attention_bench(build_parser().parse_args(argv))
    ctx.save(command="python -m minillm.bench " + " ".join(argv), **report)
    attention_bench.plot(report, ctx.out / "attention.png")
