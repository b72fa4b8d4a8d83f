"""The attention benchmark (chapter 16): naive vs tiled vs PyTorch's fused kernel, and the engine
with each attention backend.

On a CUDA GPU it times the naive three-kernel attention, the Triton FlashAttention kernel and
``scaled_dot_product_attention`` for sequence lengths up to 8,192, and converts each time into
an achieved bandwidth using the traffic model's bytes (``minillm.speedups.kernels.traffic``); then it
measures the engine's decode throughput with ``attention="torch"`` and ``"triton"``.

Without a GPU, Triton kernels only run in the interpreter, whose speed says nothing about the
kernel, so they are not timed. What is timed instead is what a CPU can say honestly: the naive,
tiled-PyTorch and SDPA implementations side by side at short lengths. The traffic model needs
no device at all.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from minillm.cli import UsageError
from minillm.model.config import PRESETS
from minillm.bench import add_options, pyplot, save_figure
from minillm.bench.engine import load_weights
from minillm.engine.llm import LLM
from minillm.machine.hardware import default_device, device_name, resolve_dtype, time_repeats
from minillm.speedups.kernels import naive_attention, naive_bytes, tiled_attention, tiled_bytes
from minillm.model.gpt import GPT
from minillm.decoding.sampling import SamplingParams
from minillm.settings import quick

GPU_SEQ_LENS = (128, 256, 512, 1024, 2048, 4096, 8192)
CPU_SEQ_LENS = (128, 256, 512, 1024)
TRITON_BLOCK = 64  # flash_attention's default block_m and block_n, for the traffic model
TILED_BLOCK = 64  # the tiled PyTorch version's blocks on a CPU
ENGINE_KV_MEMORY = "2GiB"  # far more than the decode comparison's requests need


@dataclass
class KernelTiming:
    """One implementation at one length: median seconds and their quartiles, model bytes, and
    what they imply."""

    method: str
    seq_len: int
    seconds: float | None  # None: it ran out of memory
    quartiles: tuple[float, float] | None  # the first and third, as the spread around ``seconds``
    model_bytes: int | None  # None where the traffic model does not describe the implementation
    flops: int
    max_abs_error: float | None

    @property
    def bandwidth(self) -> float | None:
        """Bytes per second the traffic model says it moved, over the time it took."""
        return self.model_bytes / self.seconds if self.seconds and self.model_bytes else None

    @property
    def flop_rate(self) -> float | None:
        return self.flops / self.seconds if self.seconds else None

    def as_dict(self) -> dict:
        return {**asdict(self), "bandwidth": self.bandwidth, "flop_rate": self.flop_rate}


def attention_flops(seq_len: int, head_dim: int, heads: int, batch: int, causal: bool) -> int:
    """Two matmuls of ``2 T^2 d`` FLOPs each per head; causal does half the pairs."""
    pairs = seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len
    return 4 * pairs * head_dim * heads * batch


def implementations(device: torch.device) -> dict[str, tuple]:
    """``name -> (fn(q, k, v), model bytes(T, d, heads, batch, dtype_bytes) or None)``: what this
    device can time meaningfully. Every call is causal, the case an LLM runs."""
    sdpa = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    naive = (lambda q, k, v: naive_attention(q, k, v, causal=True),
             lambda t, d, h, b, e: naive_bytes(t, t, d, heads=h, batch=b, dtype_bytes=e).total)
    if device.type != "cuda":
        tiled = (lambda q, k, v: tiled_attention(q, k, v, causal=True, block_q=TILED_BLOCK, block_k=TILED_BLOCK),
                 lambda t, d, h, b, e: tiled_bytes(t, t, d, block_q=TILED_BLOCK, block_k=TILED_BLOCK, causal=True,
                                                   heads=h, batch=b, dtype_bytes=e).total)
        return {"naive": naive, "tiled (PyTorch)": tiled, "sdpa": (sdpa, None)}
    from minillm.speedups.kernels.flash_triton import flash_attention

    triton = (lambda q, k, v: flash_attention(q, k, v, causal=True, block_m=TRITON_BLOCK, block_n=TRITON_BLOCK),
              lambda t, d, h, b, e: tiled_bytes(t, t, d, block_q=TRITON_BLOCK, block_k=TRITON_BLOCK, causal=True,
                                                heads=h, batch=b, dtype_bytes=e).total)
    return {"naive": naive, "triton": triton, "sdpa": (sdpa, None)}


def time_kernels(
    device: torch.device, dtype: torch.dtype, seq_lens: tuple[int, ...], *, heads: int, head_dim: int, batch: int,
    repeats: int,
) -> list[KernelTiming]:
    """Every implementation at every length, on the same inputs, checked against SDPA in fp32."""
    rows = []
    impls = implementations(device)
    for t in seq_lens:
        g = torch.Generator(device=device).manual_seed(t)
        q, k, v = (torch.randn(batch, heads, t, head_dim, device=device, generator=g).to(dtype) for _ in range(3))
        expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        flops = attention_flops(t, head_dim, heads, batch, causal=True)
        for name, (fn, bytes_of) in impls.items():
            model = bytes_of(t, head_dim, heads, batch, dtype.itemsize) if bytes_of else None
            try:
                error = (fn(q, k, v).float() - expected).abs().max().item()
                timing = time_repeats(lambda: fn(q, k, v), device, repeats=repeats)
                seconds, quartiles = timing.median, timing.quartiles
            except torch.OutOfMemoryError:
                error = seconds = quartiles = None
                torch.cuda.empty_cache()
            rows.append(KernelTiming(name, t, seconds, quartiles, model, flops, error))
    return rows


def traffic_curves(seq_lens: list[int], *, head_dim: int, heads: int, block: int, dtype_bytes: int) -> dict:
    """The model's bytes for naive and tiled causal attention at each length (no device needed)."""
    return {
        "seq_lens": seq_lens,
        "naive_bytes": [naive_bytes(t, t, head_dim, heads=heads, dtype_bytes=dtype_bytes).total for t in seq_lens],
        "tiled_bytes": [tiled_bytes(t, t, head_dim, block_q=block, block_k=block, causal=True, heads=heads,
                                    dtype_bytes=dtype_bytes).total for t in seq_lens],
    }


def engine_decode_rate(model: GPT, backend: str, *, num_requests: int, prompt_len: int, output_len: int) -> dict:
    """Generated tokens per second of ``LLM(model, attention=backend)`` on random prompts, after
    one short warm-up run (Triton compiles each kernel variant on first use). The KV pool has a
    fixed size, so both backends get the same one whatever the first left in PyTorch's cache."""
    llm = LLM(model, attention=backend, kv_cache_memory=ENGINE_KV_MEMORY)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(model.cfg.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(num_requests)]
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return {"backend": backend, "requests": num_requests, "prompt_len": prompt_len, "output_len": output_len,
            "seconds": seconds, "tokens_per_s": tokens / seconds,
            "token_ids": [o.token_ids for o in outs]}


# ----------------------------------------------------------------------------- the command


def add_arguments(p) -> None:
    """The ``python -m minillm.bench attention`` flags."""
    p.add_argument("--device", default=None, help="cuda (the real benchmark) or cpu (PyTorch-only timings)")
    p.add_argument("--dtype", default=None, help="float16 | bfloat16 | float32 (default: float16 on CUDA, float32 on a CPU)")
    p.add_argument("--seq-lens", default=None, help="comma-separated lengths (default: 128..8192 on CUDA, 128..1024 on a CPU)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=None, help="timed runs per point (default: 20 on CUDA, 3 on a CPU)")
    p.add_argument("--engine-preset", default="tinystories-50m", choices=sorted(PRESETS),
                   help="the model the engine decode comparison serves")
    p.add_argument("--engine-requests", type=int, default=64)
    add_options(p, "--out", "--smoke")


def run_attention_bench(args) -> dict:
    """Everything this device can measure honestly, as a JSON-ready report; prints as it goes."""
    device = torch.device(args.device) if args.device else default_device()
    cuda = device.type == "cuda"
    try:
        dtype = resolve_dtype(args.dtype) or (torch.float16 if cuda else torch.float32)
        lens = tuple(int(x) for x in args.seq_lens.split(",")) if args.seq_lens else (GPU_SEQ_LENS if cuda else CPU_SEQ_LENS)
    except ValueError as err:
        raise UsageError(f"--dtype or --seq-lens: {err}") from None
    heads, batch, repeats = args.heads, args.batch, args.repeats or (20 if cuda else 3)
    if args.smoke or quick():
        lens, heads, repeats = tuple(t for t in lens if t <= 256)[:2] or (128,), min(heads, 4), min(repeats, 2)
    if min(lens) < 1 or min(heads, args.head_dim, batch, repeats, args.engine_requests) < 1:
        raise UsageError("--seq-lens, --heads, --head-dim, --batch, --repeats and --engine-requests must be >= 1")
    if not cuda:
        print(f"no CUDA device ({device_name(device)}): Triton kernels would only run in the interpreter, whose "
              "speed means nothing, so they are not timed. Timing naive vs tiled PyTorch vs SDPA instead; "
              "run this on a CUDA GPU for the kernel and engine figures.", flush=True)
    print(f"causal attention, batch {batch} x {heads} heads x head_dim {args.head_dim}, {dtype}, {device_name(device)}")
    rows = time_kernels(device, dtype, lens, heads=heads, head_dim=args.head_dim, batch=batch, repeats=repeats)
    for r in rows:
        ms = ("out of memory" if r.seconds is None else
              f"{r.seconds * 1e3:10.3f} ms ({r.quartiles[0] * 1e3:.3f}..{r.quartiles[1] * 1e3:.3f})")
        gbs = f"{r.bandwidth / 1e9:8.1f} GB/s (model)" if r.bandwidth else ""
        print(f"  T={r.seq_len:<5} {r.method:<16} {ms}  {(r.flop_rate or 0) / 1e12:7.3f} TFLOP/s  {gbs}", flush=True)
    report = {"device": device_name(device), "device_type": device.type, "dtype": str(dtype).removeprefix("torch."),
              "heads": heads, "head_dim": args.head_dim, "batch": batch, "repeats": repeats,
              "kernels": [r.as_dict() for r in rows],
              "traffic": traffic_curves(list(lens), head_dim=args.head_dim, heads=heads, block=TRITON_BLOCK,
                                        dtype_bytes=dtype.itemsize),
              "engine": []}
    if cuda:
        preset = "tiny" if args.smoke or quick() else args.engine_preset
        model, source = load_weights(preset, device, dtype)
        output_len = min(128, model.cfg.context_length - 32)
        runs = [engine_decode_rate(model, backend, num_requests=args.engine_requests, prompt_len=32, output_len=output_len)
                for backend in ("torch", "triton")]
        same = sum(a == b for a, b in zip(runs[0].pop("token_ids"), runs[1].pop("token_ids")))
        for r in runs:
            r.update(preset=preset, weights=source, identical_outputs=same)
            print(f"  engine {preset} attention={r['backend']:<7} {r['tokens_per_s']:10,.0f} tok/s", flush=True)
        report["engine"] = runs
    return report


def plot(report: dict, path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    for method in dict.fromkeys(r["method"] for r in report["kernels"]):
        points = [(r["seq_len"], r["seconds"] * 1e3) for r in report["kernels"] if r["method"] == method and r["seconds"]]
        left.plot(*zip(*points), marker="o", label=method)
    left.set(xscale="log", yscale="log", xlabel="sequence length T", ylabel="ms (median)",
             title=f"causal attention on {report['device']}")
    left.legend()
    t = report["traffic"]
    right.plot(t["seq_lens"], [b / 1e6 for b in t["naive_bytes"]], marker="o", label="naive (model)")
    right.plot(t["seq_lens"], [b / 1e6 for b in t["tiled_bytes"]], marker="o", label=f"tiled, blocks {TRITON_BLOCK} (model)")
    right.set(xscale="log", yscale="log", xlabel="sequence length T", ylabel="MB moved per call",
              title=f"traffic model, {report['heads']} heads x d={report['head_dim']}, {report['dtype']}")
    right.legend()
    save_figure(fig, path)
