"""The engine benchmark: every way of generating in this book, on one workload, in one run.

A workload is N requests whose prompt and output lengths are drawn uniformly from ranges,
with a fixed seed and ``ignore_eos`` so every method produces exactly the tokens asked for.
Each method gets the same prompts and the same weights; throughput counts only the output
tokens a request asked for (the padding rows of static batching compute tokens nobody wanted,
and that is the point). The slow loops (naive, one request at a time) run on the first few
requests only, since their rate per token does not depend on how many there are.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from minillm.model.checkpoint import CHECKPOINT_NAME, load_model, preset_dir
from minillm.model.config import get_preset
from minillm.engine import LLM, SamplingParams
from minillm.decoding.generate import generate_kv_cache, generate_naive, generate_static_batch
from minillm.machine.hardware import measure_bandwidth, median_seconds
from minillm.model.gpt import GPT


def load_weights(preset: str, device: torch.device, dtype: torch.dtype | None = None) -> tuple[GPT, str]:
    """The preset's trained weights if there are any, else random ones (seeded): speed does not
    care. Returns the model (in ``dtype``, given one) and where its weights came from."""
    path = preset_dir(preset) / CHECKPOINT_NAME
    if path.is_file():
        model, source = load_model(path, device), str(path)
    else:
        torch.manual_seed(0)
        model, source = GPT(get_preset(preset)).to(device).eval(), "random weights"
    return model.to(dtype), source


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @classmethod
    def uniform(cls, n: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int = 0) -> "Workload":
        """``n`` requests with lengths uniform in the (inclusive) ranges and random token ids:
        the speed of a forward pass does not depend on which tokens it sees."""
        rng = random.Random(seed)
        lens = [rng.randint(*input_len) for _ in range(n)]
        return cls([[rng.randrange(vocab) for _ in range(k)] for k in lens], [rng.randint(*output_len) for _ in range(n)])

    def head(self, n: int) -> "Workload":
        return Workload(self.prompts[:n], self.output_lens[:n])

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class Result:
    method: str
    requests: int
    output_tokens: int
    seconds: float
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def median_run(runs: list[Result]) -> Result:
    """One method's repeated runs as one result: their median seconds, every run's seconds kept
    in ``extra["seconds_runs"]`` for the spread. (The extras, such as the engine's step count,
    are the same from run to run: the workload and greedy decoding are.)"""
    seconds = [r.seconds for r in runs]
    return replace(runs[0], seconds=statistics.median(seconds), extra={**runs[0].extra, "seconds_runs": seconds})


def _timed(method: str, workload: Workload, fn, **extra) -> Result:
    start = time.perf_counter()
    fn()
    return Result(method, len(workload.prompts), workload.output_tokens, time.perf_counter() - start, extra)


@torch.inference_mode()
def run_naive(model: GPT, w: Workload) -> Result:
    return _timed("naive loop", w, lambda: [generate_naive(model, p, n) for p, n in zip(w.prompts, w.output_lens)])


@torch.inference_mode()
def run_kv_cache(model: GPT, w: Workload) -> Result:
    return _timed("KV cache, one at a time", w, lambda: [generate_kv_cache(model, p, n) for p, n in zip(w.prompts, w.output_lens)])


@torch.inference_mode()
def run_static(model: GPT, w: Workload, batch_size: int) -> Result:
    def go() -> None:
        for i in range(0, len(w.prompts), batch_size):
            generate_static_batch(model, w.prompts[i : i + batch_size], w.output_lens[i : i + batch_size])

    return _timed(f"static batches of {batch_size}", w, go, batch_size=batch_size)


def run_engine(model: GPT, w: Workload, **engine_options) -> tuple[Result, dict]:
    """The paged engine on the whole workload, all requests queued at once; also returns how
    much reserved KV memory held no token, averaged over the steps."""
    llm = LLM(model, **engine_options)
    engine = llm.engine
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in w.output_lens]
    wasted: list[float] = []
    start = time.perf_counter()
    for i, (p, sp) in enumerate(zip(w.prompts, params)):
        engine.add_request(f"bench-{i}", p, sp)
    while engine.has_unfinished:
        engine.step()
        stats = engine.stats()
        if stats.kv_blocks_used:
            wasted.append(1 - stats.kv_tokens / (stats.kv_blocks_used * engine.config.block_size))
    seconds = time.perf_counter() - start
    stats = engine.stats()
    result = Result("paged engine", len(w.prompts), w.output_tokens, seconds,
                    {"steps": stats.steps, "preemptions": stats.preemptions, "kv_blocks": stats.kv_blocks_total})
    return result, {"paged": statistics.mean(wasted) if wasted else 0.0}


def contiguous_waste(w: Workload, context_length: int, batch_size: int) -> dict:
    """Reserved-but-empty KV slots when each request holds a contiguous region: reserved for
    the model's whole context (as a server must when it does not know the output length), and
    for static batches (every row reserves the batch's longest prompt plus its longest output)."""
    used = [len(p) + n for p, n in zip(w.prompts, w.output_lens)]
    static_reserved = 0
    for i in range(0, len(used), batch_size):
        rows = slice(i, i + batch_size)
        longest = max(map(len, w.prompts[rows])) + max(w.output_lens[rows])
        static_reserved += longest * len(used[rows])
    return {"max_context": 1 - sum(used) / (context_length * len(used)), "static_batch": 1 - sum(used) / static_reserved}


def as_transformers(model: GPT):
    """The same weights as a ``transformers`` GPT-2, or None without ``transformers`` (it is a
    dev dependency only)."""
    try:
        from transformers import GPT2LMHeadModel
    except ImportError:
        return None
    from minillm.export.hf import export_hf

    from transformers.utils import logging as hf_logging

    with tempfile.TemporaryDirectory() as tmp:
        shown = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a bar for loading local weights: in a notebook, a widget left frozen at 0%
        try:
            hf = GPT2LMHeadModel.from_pretrained(export_hf(model, tmp), dtype=model.dtype)
        finally:
            if shown:
                hf_logging.enable_progress_bar()
    return hf.to(model.device).eval()


@torch.inference_mode()
def run_hf(model: GPT, w: Workload, batch_size: int) -> Result | None:
    """Hugging Face ``generate`` with static batches, on the same weights through our export;
    None without ``transformers``."""
    if (hf := as_transformers(model)) is None:
        return None
    pad = model.cfg.vocab_size - 1

    def go() -> None:
        for i in range(0, len(w.prompts), batch_size):
            prompts, steps = w.prompts[i : i + batch_size], max(w.output_lens[i : i + batch_size])
            longest = max(map(len, prompts))
            ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts], device=hf.device)
            mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=hf.device)
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                        do_sample=False, pad_token_id=pad)

    return _timed(f"transformers generate, static batches of {batch_size}", w, go, batch_size=batch_size)


def prefilled(engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]):
    """``engine`` holding ``prompts`` (with ``params``, one for all or one each), stepped until
    each has its first token: every step after is a decode step."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    while engine.scheduler.num_waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
        engine.step()
    return engine


@torch.inference_mode()
def batch1_decode(model: GPT, context: int = 128, repeats: int = 20, bandwidth: float | None = None) -> dict:
    """One sequence's decode step against its memory roofline: every weight is read once per
    step, so the step cannot be faster than ``weight bytes / bandwidth``."""
    from minillm.engine.build import build_engine

    context = min(context, model.cfg.context_length - repeats - 4)
    params = SamplingParams(max_tokens=repeats + 4, temperature=0, ignore_eos=True)
    engine = prefilled(build_engine(model), [list(range(1, context + 1))], params)
    device = model.device
    seconds = median_seconds(engine.step, device, repeats, warmup=3)
    engine.abort("r0")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = bandwidth or measure_bandwidth(device, "reduce")
    bound = bandwidth / weight_bytes
    return {"tokens_per_s": 1 / seconds, "roofline_tokens_per_s": bound, "fraction_of_roofline": 1 / seconds / bound,
            "weight_bytes": weight_bytes, "bandwidth": bandwidth, "context": context}


def as_dict(results: list[Result]) -> list[dict]:
    return [{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in results]
