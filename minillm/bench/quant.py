"""The quantization lab: one trained checkpoint in every number format, measured side by side.

For each format (fp32, bf16, fp16 weights; int8 and int4 weight-only from ``minillm.speedups.quant``)
it measures what the format costs and what it buys:

- load time and memory, each in a fresh process (a peak is a high-water mark, so formats
  measured in one process would hide each other's): the weights' bytes, the process's
  resident memory once loaded and its peak while loading;
- time to first token and decode rates at batch 1 and at a wide batch, on the paged engine;
- validation perplexity and bits per byte (``minillm.train.trainer.evaluate``), and how often greedy
  decoding picks the same tokens as fp32 over the same prompts;
- the batch-1 decode rate against its own bandwidth roofline (weight and KV bytes per step
  over measured bandwidth): fewer bytes raise the bound, and the table says how much of that
  raised bound each format reaches.

``python -m minillm.bench quant`` runs it and writes ``benchmarks/results/quant-<device>.json``
and ``.png``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from minillm.bench import add_options, pyplot, save_figure, save_report
from minillm.bench.engine import prefilled
from minillm.cli import UsageError
from minillm.model.checkpoint import CHECKPOINT_NAME, load_model, load_state, preset_dir
from minillm.data.corpus import Corpus, prepare_corpus
from minillm.engine import LLM, LLMEngine, SamplingParams, build_engine
from minillm.engine.config import EngineConfig
from minillm.machine.hardware import DTYPES, Timing, default_device, device_name, measure_bandwidth, median_seconds
from minillm.model.gpt import GPT
from minillm.speedups.quant import SCHEMES, cast_and_quantize, kernels_used, model_bytes
from minillm.settings import quick
from minillm.train.trainer import evaluate, load_or_train

FORMATS = ("fp32", "bf16", "fp16", "int8", "int4")


@dataclass
class LabSettings:
    """How much work each measurement does (``smoke()``: a few seconds, for tests and QUICK)."""

    prompt_len: int = 128  # TTFT's prompt, and the context the decode steps attend over
    wide_batch: int = 64
    rounds: int = 20  # speed: every format timed once per round, in turn
    b1_steps_per_round: int = 3
    eval_batches: int = 8
    eval_batch_size: int = 8
    eval_seq_len: int = 256
    agree_prompts: int = 16
    agree_prompt_len: int = 16
    agree_tokens: int = 32

    @classmethod
    def smoke(cls) -> "LabSettings":
        return cls(prompt_len=16, wide_batch=8, rounds=3, eval_batches=1, eval_batch_size=2, eval_seq_len=64,
                   agree_prompts=4, agree_prompt_len=8, agree_tokens=8)


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt


def load_format(path: str | Path, fmt: str, device: str | torch.device = "cpu") -> GPT:
    """The checkpoint as ``fmt``: floats cast to that dtype, or int8/int4 weights with bf16 activations."""
    model = load_model(path, device)
    if check_format(fmt) in SCHEMES:
        return cast_and_quantize(model, None, fmt)
    return cast_and_quantize(model, DTYPES[fmt], None)


# ----------------------------------------------------------------------------- load, in a fresh process


def rss() -> tuple[int, int]:
    """The process's resident memory now and its high-water mark, in bytes. On Linux from
    ``/proc``, because ``getrusage``'s ``ru_maxrss`` survives ``exec``: a child started by a big
    parent inherits the parent's peak."""
    status = Path("/proc/self/status")
    if status.is_file():
        fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    import psutil
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return psutil.Process().memory_info().rss, peak


def probe_load(path: str, fmt: str, device: str) -> dict:
    """Run in a fresh process: seconds to load ``fmt`` and the process's memory around it."""
    before = rss()[0]
    start = time.perf_counter()
    model = load_format(path, fmt, device)
    gc.collect()
    seconds = time.perf_counter() - start
    loaded, peak = rss()
    return {"load_s": seconds, "weight_bytes": model_bytes(model), "rss_before": before, "rss_loaded": loaded,
            "rss_peak": peak}


def measure_load(path: str | Path, fmt: str, device: torch.device) -> dict:
    code = "import json, sys; from minillm.bench.quant import probe_load; print(json.dumps(probe_load(*sys.argv[1:])))"
    out = subprocess.run([sys.executable, "-c", code, str(path), fmt, str(device)],
                         capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- speed


def _engine(model: GPT, sequences: int, tokens: int) -> LLMEngine:
    """An engine with just enough KV blocks, and no prefix cache (repeated prompts must recompute)."""
    block = 16
    blocks = sequences * (-(-tokens // block) + 1)
    return build_engine(model, EngineConfig(num_blocks=blocks, block_size=block, enable_prefix_caching=False,
                                            max_num_seqs=max(sequences, 1)))


def _prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (n, length), generator=g).tolist()


class SpeedProbe:
    """One format's three timings, a sample at a time, so that the lab can take turns between
    formats: on a shared machine, load that comes and goes then falls on every format alike,
    where timing one format after another would hand it to whichever ran at the wrong moment.

    - ``ttft()``: queue a ``prompt_len``-token prompt and run the step that computes it and
      picks its first token;
    - ``decode(batch)``: one decode step of ``batch`` sequences that already hold ``prompt_len``
      tokens (prefilled, untimed, when the probe is built).
    """

    def __init__(self, model: GPT, prompt_len: int, wide_batch: int, steps: int) -> None:
        self.device = model.pos_emb.weight.device
        self.prompt = _prompts(1, prompt_len, model.cfg.vocab_size, seed=1)[0]
        self.first = _engine(model, 1, prompt_len + 2)
        self.count = 0
        params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
        self.engines = {b: prefilled(_engine(model, b, prompt_len + steps + 4),
                                     _prompts(b, prompt_len, model.cfg.vocab_size), params) for b in (1, wide_batch)}
        for engine in self.engines.values():
            engine.step()  # warm: the first pure decode step

    @torch.inference_mode()
    def ttft(self) -> float:
        self.count += 1
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        self.first.add_request(f"ttft-{self.count}", self.prompt, params)
        return median_seconds(self.first.step, self.device, 1, warmup=0)

    @torch.inference_mode()
    def decode(self, batch: int) -> float:
        return median_seconds(self.engines[batch].step, self.device, 1, warmup=0)


def measure_speed(models: dict[str, GPT], settings: LabSettings) -> dict[str, dict]:
    """Median TTFT and decode rates (batch 1 and wide) per format, over ``settings.rounds`` rounds
    that each time every format once in turn."""
    steps = settings.rounds * settings.b1_steps_per_round
    probes = {fmt: SpeedProbe(m, settings.prompt_len, settings.wide_batch, steps) for fmt, m in models.items()}
    samples: dict[str, dict[str, list[float]]] = {fmt: {"ttft": [], "b1": [], "wide": []} for fmt in models}
    for _ in range(settings.rounds):
        for fmt, probe in probes.items():
            samples[fmt]["ttft"].append(probe.ttft())
            samples[fmt]["b1"] += [probe.decode(1) for _ in range(settings.b1_steps_per_round)]
            samples[fmt]["wide"].append(probe.decode(settings.wide_batch))
    return {fmt: _medians_and_quartiles(s, settings.wide_batch) for fmt, s in samples.items()}


def _medians_and_quartiles(samples: dict[str, list[float]], wide_batch: int) -> dict[str, float | list[float]]:
    """One format's figures: the median TTFT and decode rates, each with its quartiles (``*_iqr``,
    low to high), so a table can show how far the rounds spread. A rate's low quartile comes from
    the step time's high one."""
    ttft, b1, wide = (Timing.of(samples[k]) for k in ("ttft", "b1", "wide"))
    return {"ttft_s": ttft.median, "ttft_s_iqr": [ttft.q1, ttft.q3],
            "decode_b1": 1 / b1.median, "decode_b1_iqr": [1 / b1.q3, 1 / b1.q1],
            "decode_wide": wide_batch / wide.median, "decode_wide_iqr": [wide_batch / wide.q3, wide_batch / wide.q1]}


def kv_bytes_per_step(model: GPT, context: int) -> int:
    """Keys and values one sequence's decode step reads: two vectors per layer per position."""
    cfg = model.cfg
    return 2 * cfg.n_layers * context * cfg.d_model * model.pos_emb.weight.element_size()


# ----------------------------------------------------------------------------- quality


def corpus_of(path: str | Path) -> Corpus:
    """The corpus a checkpoint was trained on (its held-out split is what we score)."""
    cfg = load_state(path)["train_config"]
    return prepare_corpus(cfg["data"], max_stories=cfg["max_stories"], seed=cfg["seed"], verbose=False)


def agreement_prompts(corpus: Corpus, settings: LabSettings) -> list[list[int]]:
    """Real story openings from the validation split, evenly spaced."""
    tokens = corpus.tokens("validation")
    starts = np.linspace(0, len(tokens) - settings.agree_prompt_len - 1, settings.agree_prompts).astype(np.int64)
    return [tokens[s : s + settings.agree_prompt_len].astype(np.int64).tolist() for s in starts]


def greedy_outputs(model: GPT, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    llm = LLM(model, num_blocks=len(prompts) * (-(-(len(prompts[0]) + max_tokens) // 16) + 1),
              enable_prefix_caching=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    return [o.token_ids for o in outs]


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """The fraction of positions where two sets of greedy outputs hold the same token."""
    same = sum(a == b for out, ref in zip(outputs, reference) for a, b in zip(out, ref))
    return same / sum(len(ref) for ref in reference)


# ----------------------------------------------------------------------------- the lab


def run_lab(path: str | Path, formats: list[str], device: torch.device, settings: LabSettings,
            log=print) -> dict:
    """Every measurement for every format: load and memory in a fresh process each; speed with
    all formats loaded here, taking turns; quality one format after another on the same prompts."""
    corpus, bandwidth = corpus_of(path), measure_bandwidth(device, "reduce")
    models = {fmt: load_format(path, fmt, device) for fmt in formats}
    rows = {fmt: {"format": fmt, "kernels": kernels_used(m), **measure_load(path, fmt, device)}
            for fmt, m in models.items()}
    log(f"  loaded {', '.join(formats)}; timing them in turns, {settings.rounds} rounds")
    for fmt, speed in measure_speed(models, settings).items():
        step_bytes = model_bytes(models[fmt]) + kv_bytes_per_step(models[fmt], settings.prompt_len)
        rows[fmt] |= speed | {"roofline_b1": bandwidth / step_bytes}
        rows[fmt]["fraction_of_roofline"] = rows[fmt]["decode_b1"] / rows[fmt]["roofline_b1"]
    prompts, reference = agreement_prompts(corpus, settings), None
    for fmt, model in models.items():
        rows[fmt] |= evaluate(model, corpus, settings.eval_seq_len, settings.eval_batch_size, settings.eval_batches,
                              contextlib.nullcontext())
        outputs = greedy_outputs(model, prompts, settings.agree_tokens)
        reference = reference or outputs  # the first format listed is the reference (fp32)
        rows[fmt]["agreement"] = agreement(outputs, reference)
        log(format_row(rows[fmt]))
    base = rows[formats[0]]
    for row in rows.values():  # the gain the roofline promises, and the gain realised
        row["bound_gain"] = row["roofline_b1"] / base["roofline_b1"]
        row["realised_gain"] = row["decode_b1"] / base["decode_b1"]
    return {"checkpoint": str(path), "device": device_name(device), "bandwidth": bandwidth,
            "settings": asdict(settings), "rows": rows}


COLUMNS = ("format", "weights MB", "loaded MB", "peak MB", "load s", "TTFT ms", "tok/s b=1", "tok/s wide",
           "val ppl", "bits/byte", "agree", "roofline b=1", "of roofline", "bound gain", "realised gain")


def table_rows(report: dict) -> list[list[str]]:
    """The lab table as strings, one list per format, in ``COLUMNS`` order. Memory is the
    process's growth over its own start (Python and PyTorch themselves are not the model)."""
    out = []
    for r in report["rows"].values():
        mb = 1e6
        out.append([r["format"], f"{r['weight_bytes'] / mb:.1f}", f"{(r['rss_loaded'] - r['rss_before']) / mb:.0f}",
                    f"{(r['rss_peak'] - r['rss_before']) / mb:.0f}", f"{r['load_s']:.2f}", f"{r['ttft_s'] * 1e3:.1f}",
                    f"{r['decode_b1']:.0f}", f"{r['decode_wide']:.0f}", f"{r['val_ppl']:.3f}", f"{r['val_bpb']:.4f}",
                    f"{r['agreement']:.1%}", f"{r['roofline_b1']:.0f}", f"{r['fraction_of_roofline']:.0%}",
                    f"{r['bound_gain']:.2f}x", f"{r['realised_gain']:.2f}x"])
    return out


def _spread(row: dict, key: str, scale: float, fmt: str) -> str:
    """A figure's quartiles as 'q1..q3'."""
    low, high = row[f"{key}_iqr"]
    return f"{low * scale:{fmt}}..{high * scale:{fmt}}"


def format_row(row: dict) -> str:
    return (f"  {row['format']:<5} {row['weight_bytes'] / 1e6:6.1f} MB  load {row['load_s']:.2f} s  "
            f"TTFT {row['ttft_s'] * 1e3:6.1f} ms ({_spread(row, 'ttft_s', 1e3, '.1f')})  "
            f"decode {row['decode_b1']:6.0f} tok/s ({_spread(row, 'decode_b1', 1, '.0f')}, b=1) "
            f"{row['decode_wide']:7.0f} tok/s ({_spread(row, 'decode_wide', 1, '.0f')}, wide)  ppl {row['val_ppl']:.3f}  agree {row['agreement']:.0%}  "
            f"[{', '.join(row['kernels']) or 'dense matmul'}]")


def markdown_table(report: dict) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in table_rows(report)])


def plot(report: dict, path: Path | None = None):
    """Four panels: bytes, decode rates, the batch-1 roofline, quality. Returns the figure."""
    import matplotlib.pyplot as plt

    rows = list(report["rows"].values())
    names = [r["format"] for r in rows]
    x = np.arange(len(rows))
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    axes[0].bar(names, [r["weight_bytes"] / 1e6 for r in rows], color="C0")
    axes[0].set(ylabel="MB", title="weight bytes")
    axes[1].bar(x - 0.2, [r["decode_b1"] for r in rows], 0.4, label="batch 1")
    axes[1].bar(x + 0.2, [r["decode_wide"] for r in rows], 0.4, label=f"batch {report['settings']['wide_batch']}")
    axes[1].set(xticks=x, xticklabels=names, yscale="log", ylabel="output tokens/s", title="decode rate")
    axes[1].legend(fontsize=8)
    axes[2].bar(x - 0.2, [r["roofline_b1"] for r in rows], 0.4, color="C7", label="bandwidth bound")
    axes[2].bar(x + 0.2, [r["decode_b1"] for r in rows], 0.4, color="C0", label="measured")
    axes[2].set(xticks=x, xticklabels=names, yscale="log", ylabel="tokens/s", title="batch-1 decode vs its roofline")
    axes[2].legend(fontsize=8)
    axes[3].bar(names, [r["val_ppl"] for r in rows], color="C2")
    low = min(r["val_ppl"] for r in rows)
    axes[3].set(ylim=(low * 0.95, max(r["val_ppl"] for r in rows) * 1.02), ylabel="perplexity",
                title="validation perplexity")
    for i, r in enumerate(rows):
        axes[3].text(i, r["val_ppl"], f"{r['agreement']:.0%}", ha="center", va="bottom", fontsize=8)
    fig.suptitle(f"{Path(report['checkpoint']).parent.name} checkpoint on {report['device']} "
                 "(labels on the perplexity bars: greedy agreement with fp32)", fontsize=10)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


# ----------------------------------------------------------------------------- the command


def add_arguments(p) -> None:
    """``python -m minillm.bench quant``'s options."""
    p.add_argument("--checkpoint", default=None, help="a checkpoint file (default: the cpu preset's, trained on first use)")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated from {', '.join(FORMATS)}; "
                                                                 "the first is the reference for greedy agreement")
    p.add_argument("--prompt-len", type=int, default=LabSettings.prompt_len, help="TTFT prompt and decode context")
    p.add_argument("--wide-batch", type=int, default=LabSettings.wide_batch, help="sequences in the wide decode steps")
    p.add_argument("--rounds", type=int, default=LabSettings.rounds, help="timing rounds (every format once per "
                                                                        "round, in turn); rates are medians")
    add_options(p, "--device", "--out", "--smoke")


def run_from_args(args, out: Path) -> Path:
    """Check the options, run the lab on the checkpoint, print the table, save JSON and a plot."""
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    try:
        [check_format(f) for f in formats]
    except ValueError as err:
        raise UsageError(f"--formats: {err}") from None
    if not formats or len(set(formats)) != len(formats):
        raise UsageError(f"--formats must list each format once, got {args.formats!r}")
    if min(args.prompt_len, args.wide_batch, args.rounds) < 1:
        raise UsageError("--prompt-len, --wide-batch and --rounds must be at least 1")
    path = Path(args.checkpoint) if args.checkpoint else preset_dir("cpu") / CHECKPOINT_NAME
    if args.checkpoint is None and not path.is_file():
        load_or_train("cpu")
    if not path.is_file():
        raise UsageError(f"--checkpoint: no checkpoint at {path}")
    settings = LabSettings.smoke() if args.smoke or quick() else LabSettings(
        prompt_len=args.prompt_len, wide_batch=args.wide_batch, rounds=args.rounds)
    context = load_state(path)["model_config"]["context_length"]
    if settings.prompt_len + settings.rounds * settings.b1_steps_per_round + 8 > context:
        raise UsageError(f"--prompt-len + 3 x --rounds + 8 must fit the model's context of {context} tokens")
    device = torch.device(args.device) if args.device else default_device()
    print(f"quantization lab: {path} on {device}, formats {', '.join(formats)}", flush=True)
    report = run_lab(path, formats, device, settings)
    print("\n" + markdown_table(report))
    pyplot()  # Agg before the figure: it goes to a file
    return save_report(report, out / f"quant-{device.type}.json", lambda r, png: save_figure(plot(r), png))
