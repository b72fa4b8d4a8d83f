"""The GPU check's steps (:mod:`minillm.bench.gpu_check` runs them in this order): the machine
and its roof, the CUDA tests, the attention kernels, decode throughput, training throughput and
the server under load. Each is a function of a ``Context``: it measures with the package's own
benchmarks, records with ``ctx.save`` as it goes (a step stopped at its deadline keeps what it
finished), and writes its plot into ``ctx.out``. ``ctx.dry_run`` shrinks every shape so that a
CPU runs it in seconds.

The server step runs ``python -m server`` and ``python -m server.loadgen`` as programs: the
package never imports ``server`` (DESIGN.md's one direction of dependence).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict
from pathlib import Path

import torch

from minillm.bench import decode as decode_bench
from minillm.bench import free_port, local_server
from minillm.bench.engine import load_weights
from minillm.machine.hardware import DTYPES, device_name, first_order_batch, measure_machine, measure_matmul_flops
from minillm.machine.roofline import decode_roof, measure_decode, nearly_free_batch, plot_roofline
from minillm.model.checkpoint import CHECKPOINT_NAME, save_checkpoint
from minillm.model.config import get_preset
from minillm.model.gpt import training_flops_per_token
from minillm.settings import project_root
from minillm.train.trainer import measure_throughput

GPU_PRESET = "tinystories-50m"
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
EPOCH_TOKENS = 470e6  # TinyStories' training split, about, in GPT-2 tokens
GPU_BATCH_GROUPS = ((1, 8, 32), (64, 128, 256))  # measured and saved group by group


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
    model, source = load_weights(preset, device, DTYPES[dtype])
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


def host(ctx) -> None:
    """Step 3: the host's work per decode step around a model of negligible arithmetic
    (:mod:`minillm.bench.host`), eager and captured, serial and overlapped, batch 1..256: on a
    GPU the overlapped engine should hide it behind the device's."""
    from minillm.bench.host import BATCHES, METHODS, run_host_bench

    methods = ["eager", "eager-overlap"] if ctx.dry_run else list(METHODS)  # dry: no CPU compiles
    batches, steps = ([1, 2], 4) if ctx.dry_run else (list(BATCHES), 40)
    report = run_host_bench(batches, methods, steps, torch.get_num_threads(), ctx.device)
    ctx.save(command=f"python -m minillm.bench host --device {ctx.device} --methods {','.join(methods)}", **report)


def attention(ctx) -> None:
    """Step 4: ``python -m minillm.bench attention`` on this device (on CUDA: naive, Triton and
    SDPA at T = 128..8192, then the engine's decode with each backend); ``--smoke`` when dry."""
    from minillm.bench import attention as attention_bench
    from minillm.bench.__main__ import build_parser

    argv = ["attention", "--device", str(ctx.device), "--out", str(ctx.work), *(["--smoke"] if ctx.dry_run else [])]
    report = attention_bench.run_attention_bench(build_parser().parse_args(argv))
    ctx.save(command="python -m minillm.bench " + " ".join(argv), **report)
    attention_bench.plot(report, ctx.out / "attention.png")


def decode(ctx) -> None:
    """Step 5: our engine's decode tokens/s at batch 1..256, eager and captured (CUDA graphs on
    a GPU; overlapped and serial; the paged Triton kernel and the torch gather), beside
    ``transformers`` ``generate``, each as a fraction of the roof (reading every
    weight once per step at the measured bandwidth): :func:`minillm.bench.decode.run_decode_bench`."""
    preset, dtype = shape(ctx)
    device = ctx.device
    engines = {m: o for m, o in decode_bench.ENGINES.items() if not o.get("pack_weights")}  # oneDNN: CPUs only
    if ctx.dry_run:  # a CPU's captured step is an Inductor compile: minutes on two cores, and not the GPU's path
        engines = {m: o for m, o in engines.items() if o.get("enforce_eager")}
    else:  # the captured step's defaults on a GPU (overlapped, the paged Triton kernel), each against its alternative
        engines |= {"ours, captured, serial": dict(enforce_eager=False, async_scheduling=False),
                    "ours, captured, torch attention": dict(enforce_eager=False, attention="torch")}
    groups, new_tokens = (((1, 2),), 8) if ctx.dry_run else (GPU_BATCH_GROUPS, decode_bench.NEW_TOKENS)
    model, source = load_weights(preset, device, DTYPES[dtype])
    report = {"device": device_name(device), "preset": preset, "weights": source, "prompt_len": decode_bench.PROMPT_LEN,
              "new_tokens": new_tokens, "threads": torch.get_num_threads(), "methods": list(engines), "runs": {}}
    merged: dict = {}
    for group in groups:
        if merged and ctx.left < 0.4 * ctx.slice_s:
            report["skipped_batches"] = report.get("skipped_batches", []) + list(group)
            continue
        run_ = decode_bench.run_decode_bench(model, list(group), new_tokens, with_hf=True, with_llamacpp=False,
                                             repeats=1, engines=engines)
        merged = merge_runs(merged, run_)
        report["runs"][dtype] = merged
        ctx.save(**report, fraction_of_roof=fractions(merged))
        print("\n".join(decode_bench.summary(merged)), flush=True)
    decode_bench.plot(report, ctx.out / "decode.png")


def merge_runs(a: dict, b: dict) -> dict:
    """Two ``run_decode_bench`` reports over different batches as one."""
    if not a:
        return b
    merged = dict(a, roof={**a["roof"], **b["roof"]})
    for key in ("rates", "startup_s"):
        merged[key] = {m: {**a[key].get(m, {}), **b[key].get(m, {})} for m in {*a[key], *b[key]}}
    return merged


def fractions(run_: dict) -> dict:
    """Each method's median rate at each batch as a fraction of that batch's roof."""
    return {m: {b: statistics.median(v) / run_["roof"][b] for b, v in by_batch.items()}
            for m, by_batch in run_["rates"].items()}


def training(ctx) -> None:
    """Step 6: training tokens/s of the GPU model (bf16 autocast), ``torch.compile`` off and on;
    MFU against the measured bf16 matmul peak; how long an epoch of TinyStories would take."""
    preset, _ = shape(ctx)
    dtype = "float32" if ctx.dry_run else "bfloat16"
    batch_size, steps = (2, 2) if ctx.dry_run else (32, 5)
    device = ctx.device
    seq_len = get_preset(preset).context_length
    peak = measure_matmul_flops(device, getattr(torch, dtype), n=1024 if ctx.dry_run else 8192)
    flops_per_token = training_flops_per_token(get_preset(preset), seq_len)
    ctx.save(preset=preset, autocast=dtype, batch_size=batch_size, seq_len=seq_len, steps=steps,
             weights="random: speed does not depend on the data or the weights", matmul_peak_flops=peak,
             flops_per_token=flops_per_token, epoch_tokens=EPOCH_TOKENS, runs=[])
    compile_options = (False,) if ctx.dry_run else (False, True)  # Inductor on two CPU cores: minutes
    for compiled in compile_options:
        if compiled and ctx.left < 0.3 * ctx.slice_s:
            ctx.save(compile_skipped=f"{ctx.left:.0f} s left of the slice")
            break
        began = time.perf_counter()
        rate = measure_throughput(preset, dtype, batch_size=batch_size, seq_len=seq_len, steps=steps, device=device,
                                  compile=compiled)
        row = {"compile": compiled, "tokens_per_s": rate, "mfu": rate * flops_per_token / peak,
               "epoch_hours": EPOCH_TOKENS / rate / 3600, "wall_s": time.perf_counter() - began}
        ctx.result["runs"].append(row)
        ctx.save()
        print(f"  compile={compiled}: {rate:,.0f} tok/s, MFU {row['mfu']:.1%}, epoch {row['epoch_hours']:.2f} h", flush=True)


def server(ctx) -> None:
    """Step 7: ``python -m server`` on random weights of the GPU model, then a short
    ``python -m server.loadgen`` sweep against it: TTFT/TPOT percentiles, sustained tokens/s."""
    from minillm.bench.gpu_check import child_env

    preset, dtype = shape(ctx)
    model, source = load_weights(preset, torch.device("cpu"))
    ckpt = save_checkpoint(ctx.work / "server-model" / CHECKPOINT_NAME,
                           {"model": model.state_dict(), "model_config": model.cfg.to_dict(), "history": []})
    torch_dtype = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    port = free_port()
    serve = [sys.executable, "-m", "server", "--checkpoint", str(ckpt), "--port", str(port), "--device",
             str(ctx.device), "--dtype", torch_dtype, "--log-level", "warning"]
    if ctx.dry_run:
        sweep = ["--sweep", "4,inf", "--num-prompts", "4", "--input-len", "16", "--output-len", "16"]
    else:
        sweep = ["--sweep", "8,32,128,inf", "--num-prompts", "64", "--input-len", "128", "--output-len", "128"]
    ctx.save(preset=preset, dtype=torch_dtype, weights=source, server_command=" ".join(serve[1:]))
    began = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        try:
            with local_server(serve, port, log, name="the server", timeout=max(ctx.left * 0.5, 5),
                              env=child_env()) as url:
                ctx.save(url=url, startup_s=time.perf_counter() - began)
                out = ctx.work / "loadgen"
                loadgen = [sys.executable, "-m", "server.loadgen", "--url", url, *sweep,
                           "--slo", "ttft=500ms,tpot=50ms", "--out", str(out)]
                ctx.save(loadgen_command=" ".join(loadgen[1:]))
                done = subprocess.run(loadgen, capture_output=True, text=True, env=child_env(),
                                      timeout=max(ctx.left - 10, 5))
                print(done.stdout[-3000:], flush=True)
                if done.returncode != 0:
                    why = (done.stdout + done.stderr)[-2000:]
                    raise RuntimeError(f"server.loadgen exited {done.returncode}: {why}")
                report = json.loads((out / "loadtest-sweep.json").read_text())
                ctx.save(loadtest=report, summary=[
                    {"request_rate": r["request_rate"], "output_tok_s": r["output_throughput"],
                     "ttft_ms": r["ttft_ms"], "tpot_ms": r["tpot_ms"], "goodput": r["goodput"]} for r in report["runs"]])
                shutil.copy(out / "loadtest-sweep.png", ctx.out / "loadtest.png")
        finally:
            log.seek(0)
            ctx.save(server_log_tail="".join(log.readlines()[-30:]))
