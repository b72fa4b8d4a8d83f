"""``python -m minillm.bench engine [options]``: run a benchmark, print its table, save JSON and a plot."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from minillm.bench import add_options, parse_batches, pyplot, results_dir, save_figure, save_report
from minillm.bench import attention as attention_bench
from minillm.bench import decode as decode_bench
from minillm.bench import profile as profile_bench
from minillm.bench import engine as eb
from minillm.bench import extras as extras_bench
from minillm.bench import gpu_check
from minillm.bench import host as host_bench
from minillm.bench import products as products_bench
from minillm.bench import quant as quant_bench
from minillm.bench import speculative as speculative_bench
from minillm.bench import training as training_bench
from minillm.bench.engine import load_weights
from minillm.cli import ArgumentParser, UsageError, run
from minillm.model.config import get_preset
from minillm.machine.hardware import default_device, device_name, resolve_dtype
from minillm.model.gpt import GPT
from minillm.settings import quick
from minillm.train.trainer import cpu_has_bf16_matmul


def parse_range(text: str) -> tuple[int, int]:
    """``"16:256"`` -> (16, 256); ``"64"`` -> (64, 64)."""
    try:
        lo, _, hi = text.partition(":")
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise UsageError(f"a length range looks like 16:256, not {text!r}") from None
    if not 1 <= low <= high:
        raise UsageError(f"a length range needs 1 <= low <= high, got {text!r}")
    return low, high


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m minillm.bench", description="Benchmarks of the minillm engine.")
    sub = p.add_subparsers(dest="bench", required=True)
    e = sub.add_parser("engine", help="every generation method on one workload")
    add_options(e, "--preset", "--dtypes", "--repeats", "--no-hf", "--device", "--out", "--smoke")
    e.add_argument("--num-requests", type=int, default=64)
    e.add_argument("--input-len", default="16:256", help="prompt lengths, uniform in LOW:HIGH")
    e.add_argument("--output-len", default="16:256", help="output lengths, uniform in LOW:HIGH")
    e.add_argument("--baseline-requests", type=int, default=6, help="requests for the slow one-at-a-time loops")
    e.add_argument("--static-batch", type=int, default=32)
    e.add_argument("--repeat-under", type=float, default=60.0,
                   help="seconds: a method whose first run took longer runs once (the slow baselines)")
    e.add_argument("--seed", type=int, default=0)
    d = sub.add_parser("decode", help="decode tokens/s at batch 1..64: ours captured and eager, transformers, llama.cpp")
    add_options(d, "--preset", "--dtypes", "--repeats", "--no-hf", "--device", "--out")
    d.add_argument("--batches", default=",".join(map(str, decode_bench.BATCHES)))
    d.add_argument("--new-tokens", type=int, default=decode_bench.NEW_TOKENS)
    d.add_argument("--no-llamacpp", action="store_true", help="skip llama.cpp even if `make llamacpp` built it")
    d.add_argument("--int8", action="store_true",
                   help="also int8 weights (a scale per row, fp32 activations) against llama.cpp's q8_0")
    pr = sub.add_parser("profile", help="where one decode step's time goes, eager and captured")
    add_options(pr, "--dtypes", "--out")
    pr.add_argument("--presets", default="tinystories-50m,cpu")
    pr.add_argument("--batches", default="1,8,32")
    pr.add_argument("--steps", type=int, default=10)
    attention_bench.add_arguments(sub.add_parser("attention", help="naive vs tiled vs fused attention; engine backends"))
    speculative_bench.add_arguments(sub.add_parser("speculative", help="speculative decoding: acceptance and speedup vs k"))
    quant_bench.add_arguments(sub.add_parser("quant", help="fp32, bf16, fp16, int8, int4: bytes, speed, quality"))
    extras_bench.add_arguments(sub.add_parser("extras", help="what penalties, logprobs and a JSON Schema cost a batch of 32"))
    host_bench.add_arguments(sub.add_parser("host", help="a decode step's host work, by phase, around a probe model"))
    products_bench.add_arguments(sub.add_parser("products", help="a decode step's matrix products on every road, by rows"))
    gpu_check.add_arguments(sub.add_parser("gpu-check", help="every CUDA path run and measured, in a bounded run"))
    t = sub.add_parser("training", help="a training step profiled; plain vs fused loss vs fused AdamW")
    add_options(t, "--preset", "--dtypes", "--repeats", "--out", preset="cpu", repeats=5)
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's context)")
    return p


def bench_training(args, out: Path) -> Path:
    cfg = get_preset(args.preset)
    if args.batch_size < 1 or args.repeats < 1:
        raise UsageError("--batch-size and --repeats must be at least 1")
    if args.seq_len is not None and not 1 <= args.seq_len <= cfg.context_length:
        raise UsageError(f"--seq-len must be 1..{cfg.context_length} for the {args.preset} preset")
    dtypes = tuple(str(d).removeprefix("torch.") for d in parse_dtypes(args.dtypes, default_device()))
    report = training_bench.run(args.preset, batch_size=args.batch_size, seq_len=args.seq_len, dtypes=dtypes,
                                repeats=args.repeats)
    return save_report(report, out / f"training-{args.preset}.json", training_bench.plot)


def parse_dtypes(text: str, device: torch.device) -> list[torch.dtype]:
    """The dtypes asked for, less bf16 where this machine only emulates it (said aloud)."""
    dtypes = [resolve_dtype(d.strip()) for d in text.split(",") if d.strip()]
    if device.type == "cpu" and not cpu_has_bf16_matmul() and torch.bfloat16 in dtypes and len(dtypes) > 1:
        print("skipping bfloat16: this CPU has no native bf16 matrix instructions (AVX-512 BF16 or AMX): PyTorch "
              "emulates them (ask for --dtypes bfloat16 alone to measure it anyway)")
        dtypes.remove(torch.bfloat16)
    return dtypes


def bench_decode(args, out: Path) -> Path:
    device = torch.device(args.device) if args.device else default_device()
    batches = parse_batches(args.batches)
    if quick():
        args.preset, batches, args.new_tokens, args.repeats = "tiny", [1, 2], 8, 1
    if args.new_tokens < 2 or args.repeats < 1:
        raise UsageError("--new-tokens must be at least 2 and --repeats at least 1")
    cfg = get_preset(args.preset)
    if decode_bench.PROMPT_LEN + args.new_tokens + 1 > cfg.context_length:
        raise UsageError(f"--new-tokens {args.new_tokens} does not fit the {args.preset} context of {cfg.context_length}")
    report = {"device": device_name(device), "preset": args.preset, "prompt_len": decode_bench.PROMPT_LEN,
              "new_tokens": args.new_tokens, "threads": torch.get_num_threads(), "runs": {}}
    for dtype in parse_dtypes(args.dtypes, device):
        model, report["weights"] = load_weights(args.preset, device, dtype)
        print(f"\n== decode, {args.preset} ({report['weights']}), {dtype}, {device_name(device)} ==", flush=True)
        run_ = decode_bench.run_decode_bench(model, batches, args.new_tokens, not args.no_hf, not args.no_llamacpp,
                                             args.repeats)
        report["runs"][str(dtype).removeprefix("torch.")] = run_
        print(f"  tok/s (fraction of roof) at batch {', '.join(map(str, batches))}:")
        print("\n".join(decode_bench.summary(run_)), flush=True)
    if args.int8:
        model, _ = load_weights(args.preset, device, torch.float32)
        print(f"\n== decode, {args.preset} ({report['weights']}), int8 weights, {device_name(device)} ==", flush=True)
        run_ = decode_bench.run_decode_bench(model, batches, args.new_tokens, False, not args.no_llamacpp, args.repeats,
                                             int8=True)
        report["runs"]["int8"] = run_
        print("\n".join(decode_bench.summary(run_)), flush=True)
    return decode_bench.save(report, out)


def bench_profile(args, out: Path) -> Path:
    rows = []
    device = default_device()
    for preset in args.presets.split(","):
        for dtype in parse_dtypes(args.dtypes, device):
            model, source = load_weights(preset.strip(), device, dtype)
            print(f"\n== profile, {preset} ({source}), {dtype} ==", flush=True)
            for b in parse_batches(args.batches):
                for method in decode_bench.ENGINES:
                    row = profile_bench.profile_decode(model, b, method, args.steps)
                    row |= {"preset": preset, "dtype": str(dtype).removeprefix("torch.")}
                    profile_bench.print_profile(row)
                    rows.append(row)
    return save_report({"device": device_name(device), "rows": rows}, out / "profile.json")


def bench_engine(args, out: Path) -> Path:
    if args.smoke or quick():
        args.preset, args.num_requests, args.baseline_requests, args.static_batch = "tiny", 6, 2, 3
        args.input_len, args.output_len, args.repeats = "4:24", "4:24", min(args.repeats, 2)
    if min(args.num_requests, args.baseline_requests, args.static_batch, args.repeats) < 1:
        raise UsageError("--num-requests, --baseline-requests, --static-batch and --repeats must be at least 1")
    dtypes = [resolve_dtype(d.strip()) for d in args.dtypes.split(",")] if args.dtypes else []
    device = torch.device(args.device) if args.device else default_device()
    cfg = get_preset(args.preset)
    lo_in, hi_in = parse_range(args.input_len)
    lo_out, hi_out = parse_range(args.output_len)
    if hi_in + hi_out > cfg.context_length:
        raise UsageError(f"longest prompt + output ({hi_in + hi_out}) exceeds the {args.preset} context of {cfg.context_length}")
    workload = eb.Workload.uniform(args.num_requests, (lo_in, hi_in), (lo_out, hi_out), cfg.vocab_size, args.seed)
    report = {"device": device_name(device), "preset": args.preset, "num_requests": args.num_requests,
              "input_len": [lo_in, hi_in], "output_len": [lo_out, hi_out], "runs": {}}
    for dtype in dtypes:
        model, report["weights"] = load_weights(args.preset, device, dtype)
        print(f"\n== {args.preset} ({report['weights']}), {dtype}, {device_name(device)} ==", flush=True)
        report["runs"][str(dtype).removeprefix("torch.")] = run_all(model, workload, args)
    return save_report(report, out / f"engine-{report['preset']}.json", plot)


def run_all(model: GPT, workload: eb.Workload, args) -> dict:
    """Every method ``args.repeats`` times, in rounds (each method once a round, so a slow
    spell of the machine hits them alike), except one whose first run took over
    ``args.repeat_under`` seconds (the naive loop; ``transformers`` where it runs bf16 emulated):
    each method's median run, with the runs' range."""
    few = workload.head(args.baseline_requests)
    methods = [lambda: eb.run_naive(model, few), lambda: eb.run_kv_cache(model, few),
               lambda: eb.run_static(model, workload, args.static_batch), lambda: eb.run_engine(model, workload)]
    if not args.no_hf:
        methods.append(lambda: eb.run_hf(model, workload, args.static_batch))
    runs: list[list[eb.Result]] = [[] for _ in methods]
    for round_ in range(args.repeats):
        for i, method in enumerate(methods):
            if runs[i] and runs[i][0].seconds > args.repeat_under:
                continue  # a slow baseline: one run says enough, and more would take many minutes
            result = method()
            if isinstance(result, tuple):  # the engine also returns its KV waste, the same every round
                result, waste = result
            if result is not None:  # None: transformers is not installed
                runs[i].append(result)
                print(f"  round {round_ + 1}/{args.repeats}  {result.method:<44} {result.tokens_per_s:>9,.1f} tok/s",
                      flush=True)
    results = [eb.median_run(r) for r in runs if r]
    paged = next(r for r in results if r.method == "paged engine")
    for r in results:
        times = r.extra["seconds_runs"]
        print(f"  {r.method:<44} {r.tokens_per_s:>9,.1f} tok/s (median of {len(times)}; "
              f"{r.output_tokens / max(times):,.1f}..{r.output_tokens / min(times):,.1f})")
    batch1 = eb.batch1_decode(model)
    waste |= eb.contiguous_waste(workload, model.cfg.context_length, args.static_batch)
    ratios = {r.method: paged.tokens_per_s / r.tokens_per_s for r in results if r is not paged}
    print(f"  paged engine vs: " + ", ".join(f"{m} {x:.1f}x" for m, x in ratios.items()))
    print(f"  batch-1 decode {batch1['tokens_per_s']:.1f} tok/s = {batch1['fraction_of_roofline']:.0%} of the "
          f"bandwidth roofline ({batch1['roofline_tokens_per_s']:.1f} tok/s)")
    print("  reserved KV memory holding no token: " + ", ".join(f"{k} {v:.0%}" for k, v in waste.items()))
    return {"results": eb.as_dict(results), "speedup_of_paged_engine": ratios, "batch1": batch1, "kv_waste": waste}


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    runs = report["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 3.6), squeeze=False)
    for ax, (dtype, run_) in zip(axes[0], runs.items()):
        names = [r["method"] for r in run_["results"]]
        rates = [r["tokens_per_s"] for r in run_["results"]]
        seconds = [r["extra"].get("seconds_runs", [r["seconds"]]) for r in run_["results"]]
        slowest = [r["output_tokens"] / max(t) for r, t in zip(run_["results"], seconds)]
        fastest = [r["output_tokens"] / min(t) for r, t in zip(run_["results"], seconds)]
        spread = [[rate - lo for rate, lo in zip(rates, slowest)], [hi - rate for rate, hi in zip(rates, fastest)]]
        ax.barh(names, rates, xerr=spread, capsize=3, color=["C7" if n != "paged engine" else "C0" for n in names])
        ax.invert_yaxis()
        ax.margins(x=0.15)  # room for the labels right of the longest bar
        ax.set(xlabel="output tokens/s", title=f"{report['preset']}, {dtype}")
        for y, (rate, hi) in enumerate(zip(rates, fastest)):
            ax.text(hi, y, f"  {rate:,.0f}", va="center")  # past the range bar's end, not on it
    fig.suptitle(f"{report['num_requests']} requests on {report['device']} (median run; bars: fastest..slowest)",
                 fontsize=10)
    save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.bench == "gpu-check":
        return gpu_check.run_from_args(args)
    print(f"\nsaved {RUNNERS[args.bench](args, results_dir(args.out))}")
    return 0


def bench_attention(args, out: Path) -> Path:
    report = attention_bench.run_attention_bench(args)
    return save_report(report, out / f"attention-{report['device_type']}.json", attention_bench.plot)


RUNNERS = {"engine": bench_engine, "decode": bench_decode, "profile": bench_profile, "training": bench_training,
           "attention": bench_attention, "speculative": speculative_bench.run_from_args,
           "quant": quant_bench.run_from_args, "extras": extras_bench.run_from_args,
           "host": host_bench.run_from_args, "products": products_bench.run_from_args}


if __name__ == "__main__":
    run(main, prog="python -m minillm.bench")
