"""Speculative decoding measured: acceptance and speedup against ``k``, two drafters, two kinds of text.

For each kind of text (openings of held-out stories, and out-of-domain openings: business,
code, history, science, none of it like the children's stories the models learned) and each drafter (the ``draft`` model and n-gram prompt lookup), greedy generation
runs with ``k = 1 .. 8`` draft tokens and without speculation, interleaved round by round so
that a busy neighbour slows every variant alike; speedups are ratios of medians. Greedy
output with speculation must equal the output without it, and the report says whether it did.

The per-step costs explain the speedups: a target step over one token, over ``k + 1`` tokens
(verification), and a draft step. With per-position acceptance ``alpha`` (the probability that a
drafted token is accepted given that the earlier ones in its round were) and cost ratio ``c`` (a
draft step over a target step), Leviathan et al. (2023) expect ``(1 - alpha^(k+1)) / (1 - alpha)``
tokens per target pass and a speedup of ``(1 - alpha^(k+1)) / ((1 - alpha) * (k * c + 1))`` when
verification costs one target step. ``alpha`` is estimated from the counts as accepted tokens
over judged ones (:attr:`~minillm.speedups.speculative.rule.SpeculativeStats.per_position_acceptance`), not as
accepted over drafted: that ratio also counts the tokens after a round's first rejection, which
the target never judged, so it falls with ``k`` and would count the truncation twice.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from minillm.bench import add_options, interleaved_times, pyplot, save_figure, save_report
from minillm.cli import UsageError
from minillm.data.corpus import prepare_corpus
from minillm.speedups.speculative.drafters import ModelDrafter, NgramDrafter
from minillm.decoding.generate import ContiguousKVCache, generate_kv_cache
from minillm.decoding.sampling import SamplingParams
from minillm.engine.model_runner import ModelRunner
from minillm.engine.scheduler import ScheduledChunk, SchedulerOutput
from minillm.machine.hardware import Timing, device_name, median_seconds
from minillm.model.gpt import GPT
from minillm.speedups.speculative.batch_drafters import Drafting, PagedDrafter, SequenceView
from minillm.speedups.speculative.rule import SpeculativeStats, generate_speculative
from minillm.data.tokenizer import get_tokenizer
from minillm.settings import quick
from minillm.model.checkpoint import preset_dir
from minillm.train.trainer import load_or_train

KS = list(range(1, 9))


def story_prompts(n: int, length: int) -> list[list[int]]:
    """``<|endoftext|>`` and the first ``length`` tokens of ``n`` held-out stories."""
    eot = get_tokenizer().eot
    val = np.asarray(prepare_corpus("auto", verbose=False).tokens("validation"))
    starts = np.flatnonzero(val == eot)[:n]
    return [val[s : s + 1 + length].tolist() for s in starts]


OUT_OF_DOMAIN = (
    "The quarterly report shows that revenue from cloud services grew by twelve percent, driven by strong "
    "demand from retailers and banks, while hardware sales fell for the third quarter in a row.",
    "def parse_args(argv):\n    parser = argparse.ArgumentParser(description='Train a model')\n    "
    "parser.add_argument('--steps', type=int, default=100)\n    return parser.parse_args(argv)",
    "In 1848 revolutions swept across Europe as liberal and nationalist movements challenged the old "
    "monarchies, and within two years most of them had been put down by force.",
    "Photosynthesis converts light energy into chemical energy stored in glucose, releasing oxygen as a "
    "by-product; the reactions take place in the chloroplasts of plant cells.",
    "To reset the router, hold the button on the back panel for ten seconds until the status light blinks "
    "amber, then wait two minutes before reconnecting your devices.",
    "The court held that the contract was void because one of the parties lacked the capacity to consent, "
    "and ordered that the deposit be returned with interest.",
)


def out_of_domain_prompts(n: int, length: int) -> list[list[int]]:
    """``<|endoftext|>`` and the first ``length`` tokens of ``n`` texts unlike any story in the
    corpus: the models have to continue text they cannot predict well."""
    if n > len(OUT_OF_DOMAIN):
        raise ValueError(f"there are {len(OUT_OF_DOMAIN)} out-of-domain openings, not {n}")
    tok = get_tokenizer()
    return [[tok.eot, *tok.encode(text)[:length]] for text in OUT_OF_DOMAIN[:n]]


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    """Leviathan et al.'s expected tokens per target pass, ``1 + alpha + ... + alpha^k``, when a
    round drafts ``k`` tokens and each is accepted with probability ``alpha`` given that the
    earlier ones were (``alpha`` per position, not accepted over drafted)."""
    return k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass(frozen=True)
class StepCosts:
    """Median seconds, at ``batch`` sequences, of a plain decode step, of a verification of
    ``k + 1`` tokens per sequence, and of one draft step (0 for a drafter with no model)."""

    batch: int
    k: int
    step_s: float
    verify_s: float
    draft_s: float

    @property
    def ratio(self) -> float:
        """``r(B)``: a speculative round's cost in plain steps."""
        return (self.verify_s + self.k * self.draft_s) / self.step_s


@torch.inference_mode()
def time_costs(runner: ModelRunner, drafter: PagedDrafter | None, batches: list[int], k: int, context: int = 64,
               repeats: int = 3) -> list[StepCosts]:
    """:class:`StepCosts` at each batch size, in order, measured through the engine's own
    ``runner`` and ``drafter`` (the paged attention, the LM head over every verified row and
    the read-back included) on random sequences of ``context`` tokens laid in the pool's first
    blocks, so it must run on an engine that has served nothing yet. Batches the pool cannot
    hold are left out."""
    device, vocab, bs = runner.device, runner.model.cfg.vocab_size, runner.pool.block_size
    context = min(context, runner.model.cfg.context_length - k - 1)  # every position inside the model's context
    if context < 1:
        return []
    blocks = -(-(context + k + 1) // bs)
    greedy = SamplingParams(temperature=0)
    rows = []
    for b in batches:
        if b * blocks > runner.pool.num_blocks:
            break
        views = [SequenceView(i, torch.randint(vocab, (context + k + 1,)).tolist(), list(range(i * blocks, (i + 1) * blocks)),
                              1, greedy, 0) for i in range(b)]
        plain = SchedulerOutput([ScheduledChunk(replace(v, token_ids=v.token_ids[: context + 1]), context, 1)
                                 for v in views])  # type: ignore[arg-type]
        verify = SchedulerOutput([ScheduledChunk(v, context, k + 1) for v in views])  # type: ignore[arg-type]

        def verifying() -> None:
            hidden = runner.forward(runner.prepare(verify, captured=False))
            runner.model.logits(hidden).float().argmax(dim=-1).tolist()

        step = median_seconds(lambda: runner.execute_prepared(runner.prepare(plain, captured=False)), device,
                              repeats=repeats)
        verify_s = median_seconds(verifying, device, repeats=repeats)
        drafting = 0.0
        if drafter is not None:
            drafts = [ScheduledChunk(Drafting(**vars(v)), context, 1) for v in views]  # type: ignore[arg-type]
            drafting = median_seconds(lambda: drafter.draft_one(drafts), device, repeats=repeats)
        rows.append(StepCosts(b, k, step, verify_s, drafting))
    return rows


def expected_speedup(alpha: float, k: int, c: float) -> float:
    """Leviathan et al.'s expected speedup: :func:`expected_tokens_per_pass` over the round's
    cost in target steps, ``k * c + 1``, when verification costs one target step."""
    return expected_tokens_per_pass(alpha, k) / (k * c + 1)


def predicted_speedup(row: dict, costs: dict, drafter_step_s: float) -> float:
    """The speedup the measured parts predict for one benchmark row: the tokens a target pass
    yields, times a plain step's time, over what a pass really costs (the drafter's steps plus
    a verification over that many tokens, read off the measured verification times). Unlike
    :func:`expected_speedup` it charges verification what it costs on this machine."""
    verify_s = {int(k): t for k, t in costs["verify_s"].items()}  # (JSON makes the keys strings)
    ks = sorted(verify_s)
    verify = np.interp(row["drafted_per_pass"], [0, *ks], [costs["target_step_s"], *(verify_s[k] for k in ks)])
    pass_cost = row["drafted_per_pass"] * drafter_step_s + float(verify)
    return row["tokens_per_pass"] * costs["target_step_s"] / pass_cost


def cached_step(model: GPT, batch: int, n: int, context: int,
                cache: ContiguousKVCache | None = None) -> Callable[[], None]:
    """A forward over ``n`` new tokens of ``batch`` sequences after ``context`` cached positions
    (in ``cache``, else a fresh one prefilled with random tokens), rolled back after every run."""
    device, vocab = model.device, model.cfg.vocab_size
    if cache is None:
        cache = ContiguousKVCache(model, batch, context + n)
        model(torch.randint(vocab, (batch, context), device=device), cache=cache)
    tokens = torch.randint(vocab, (batch, n), device=device)
    positions = torch.arange(context, context + n, device=device).expand(batch, n)

    def step() -> None:
        model(tokens, positions, cache)
        cache.length = context

    return step


@torch.no_grad()
def step_costs(target: GPT, draft: GPT, ks: list[int], context: int = 64, repeats: int = 20) -> dict:
    """Median seconds of one target step over 1 and over ``k + 1`` tokens, and of one draft
    step, each after ``context`` cached positions (rolled back after every run). Every variant
    runs once per round, so a busy neighbour slows them alike."""
    variants = {"target": cached_step(target, 1, 1, context), "draft": cached_step(draft, 1, 1, context),
                **{k: cached_step(target, 1, k + 1, context) for k in ks}}
    t = {name: Timing.of(s) for name, s in interleaved_times(variants, target.device, repeats).items()}
    return {"context": context, "target_step_s": t["target"].median, "draft_step_s": t["draft"].median,
            "verify_s": {k: t[k].median for k in ks}, "quartiles_s": {name: list(t[name].quartiles) for name in t}}


@torch.no_grad()
def batched_verify_cost(target: GPT, batch_sizes: list[int], k: int, context: int = 64, repeats: int = 10) -> list[dict]:
    """For each batch size ``B``: the median seconds of a decode step over ``B`` sequences with
    one new token each, and with ``k + 1`` (a speculative verification for every sequence).
    The ratio is what verification costs in plain steps: near 1 while the step is memory-bound,
    heading for ``k + 1`` once ``B * (k + 1)`` tokens make it compute-bound (chapter 1)."""
    rows = []
    for b in batch_sizes:
        cache = ContiguousKVCache(target, b, context + k + 1)
        target(torch.randint(target.cfg.vocab_size, (b, context), device=target.device), cache=cache)
        steps = {"one": cached_step(target, b, 1, context, cache),
                 "verify": cached_step(target, b, k + 1, context, cache)}
        t = {name: Timing.of(s) for name, s in interleaved_times(steps, target.device, repeats).items()}
        one, verify = t["one"].median, t["verify"].median
        rows.append({"batch": b, "step_s": one, "verify_s": verify, "ratio": verify / one,
                     "step_quartiles_s": list(t["one"].quartiles),
                     "verify_quartiles_s": list(t["verify"].quartiles)})
    return rows


def measure(
    target: GPT, draft: GPT, workloads: dict[str, list[list[int]]], *, ks: list[int] = KS,
    max_new: int = 64, rounds: int = 3, progress: bool = True,
) -> dict:
    """Acceptance rate, tokens per target pass and speedup for every (text, drafter, k).

    Each round runs every variant (the plain target first, then each drafter and ``k``) on one
    prompt before moving to the next prompt, so variants that are compared ran seconds apart.
    A variant's time is the sum over prompts of its median over rounds.
    """
    drafters = {"draft model": lambda: ModelDrafter(draft), "n-gram lookup": lambda: NgramDrafter(3)}
    variants: dict = {None: lambda p: (generate_kv_cache(target, p, max_new), None)}
    for name, make in drafters.items():
        for k in ks:
            variants[name, k] = lambda p, make=make, k=k: _speculate(target, make(), p, max_new, k)
    results = []
    for text, prompts in workloads.items():
        times = {v: [[] for _ in prompts] for v in variants}
        outputs: dict = {v: [None] * len(prompts) for v in variants}
        stats = {v: SpeculativeStats() for v in variants if v is not None}
        for round_ in range(rounds):
            for i, prompt in enumerate(prompts):
                for v, fn in variants.items():
                    start = time.perf_counter()
                    tokens, run_stats = fn(prompt)
                    times[v][i].append(time.perf_counter() - start)
                    outputs[v][i] = tokens
                    if round_ == 0 and run_stats is not None:
                        stats[v].merge(run_stats)
        seconds = {v: sum(statistics.median(t) for t in per_prompt) for v, per_prompt in times.items()}
        for (name, k), s in stats.items():
            results.append({"text": text, "drafter": name, "k": k, "acceptance_rate": s.acceptance_rate,
                            "per_position_acceptance": s.per_position_acceptance,
                            "tokens_per_pass": s.tokens_per_pass, "drafted_per_pass": s.drafted / s.target_passes,
                            "seconds": seconds[name, k], "plain_seconds": seconds[None],
                            "speedup": seconds[None] / seconds[name, k],
                            "identical": outputs[name, k] == outputs[None]})
            if progress:
                r = results[-1]
                print(f"  {text:<13} {name:<14} k={k}  accept {r['acceptance_rate']:.2f} (alpha {r['per_position_acceptance']:.2f})  "
                      f"{r['tokens_per_pass']:.2f} tok/pass  speedup {r['speedup']:.2f}x", flush=True)
    return {"results": results}


BATCHES = [1, 2, 4, 8, 16, 32, 64]


def batch_sweep(target: GPT, draft: GPT | str | Path, batches: list[int], *, k: int = 4, prompt_len: int = 32,
                max_new: int = 48, rounds: int = 3, progress: bool = True,
                prompts: list[list[int]] | None = None) -> dict:
    """Speculation for the whole batch, through the engine: at each batch size, greedy
    tokens/s of plain decoding, of speculation at every batch size (the curve) and of
    speculation left to the engine's own choice, over held-out story openings.

    The three engines run one after another in every round, so a busy neighbour slows them
    alike; each time includes the prompts' prefill, which is the same for all three. Beside
    the measured speedup, the crossover's prediction: tokens per verification pass (measured
    here) over the cost of a speculative round in plain steps (``r(B)``, :func:`time_costs`,
    through the speculating engine before it serves). ``prompts`` (default: held-out story openings of
    ``prompt_len`` tokens) must number at least the largest batch."""
    from minillm.engine.llm import LLM

    most = max(batches)
    prompts = story_prompts(most, prompt_len) if prompts is None else prompts
    if len(prompts) < most:
        raise ValueError(f"{len(prompts)} prompts cannot fill a batch of {most}")
    params = SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True)
    engines = {"plain": LLM(target, max_num_seqs=most),
               "speculative": LLM(target, max_num_seqs=most, speculative_draft=draft, num_speculative_tokens=k,
                                  speculative_disable_by_batch_size=most),
               "automatic": LLM(target, max_num_seqs=most, speculative_draft=draft, num_speculative_tokens=k)}
    fresh = engines["speculative"].engine  # nothing served yet: its pool is free for timing
    drafter = fresh.speculator.drafter  # a lookup drafter runs no model: its drafting is left out of the cost
    costs = {c.batch: c for c in time_costs(fresh.runner.runner, drafter if isinstance(drafter, PagedDrafter) else None,
                                            batches, k, repeats=10)}
    rows = []
    for b in batches:
        times: dict[str, list[float]] = {name: [] for name in engines}
        outputs, stats = {}, {}
        for round_ in range(rounds + 1):  # round 0 warms up, untimed
            for name, llm in engines.items():
                spec = getattr(llm.engine, "speculator", None)
                if spec is not None:
                    spec.stats = SpeculativeStats()
                start = time.perf_counter()
                outs = llm.generate(prompts[:b], params, use_tqdm=False)
                if round_:
                    times[name].append(time.perf_counter() - start)
                outputs[name] = [o.token_ids for o in outs]
                if spec is not None:
                    stats[name] = spec.stats
        tok_s = {name: [b * max_new / t for t in ts] for name, ts in times.items()}
        s = stats["speculative"]
        ratio = costs[b].ratio if b in costs else None
        row = {"batch": b,
               **{f"{name}_tok_s": statistics.median(v) for name, v in tok_s.items()},
               **{f"{name}_tok_s_range": [min(v), max(v)] for name, v in tok_s.items()},
               "speedup": statistics.median(times["plain"]) / statistics.median(times["speculative"]),
               "automatic_speedup": statistics.median(times["plain"]) / statistics.median(times["automatic"]),
               "tokens_per_pass": s.tokens_per_pass, "drafted_per_pass": s.drafted / max(s.target_passes, 1),
               "per_position_acceptance": s.per_position_acceptance,
               "acceptance_by_position": s.acceptance_by_position,
               "automatic_speculated": stats["automatic"].drafted > 0,
               "round_cost_in_steps": ratio,
               "predicted_speedup": s.tokens_per_pass / ratio if ratio else None,
               "identical": outputs["speculative"] == outputs["plain"] == outputs["automatic"]}
        rows.append(row)
        if progress:
            print(f"  batch {b:>3}  plain {row['plain_tok_s']:7.1f} tok/s  speculative {row['speculative_tok_s']:7.1f} "
                  f"({row['speedup']:.2f}x, predicted {row['predicted_speedup'] or float('nan'):.2f}x)  automatic "
                  f"{row['automatic_tok_s']:7.1f} ({row['automatic_speedup']:.2f}x)  "
                  f"{row['tokens_per_pass']:.2f} tok/pass  identical {row['identical']}", flush=True)
    for llm in engines.values():
        llm.close()
    losing = [r["batch"] for r in rows if r["speedup"] < 1]
    predicted_losing = [r["batch"] for r in rows if r["predicted_speedup"] is not None and r["predicted_speedup"] < 1]
    return {"k": k, "max_new_tokens": max_new, "prompt_len": prompt_len, "rounds": rounds, "rows": rows,
            "crossover_measured": min(losing) if losing else None,
            "crossover_predicted": min(predicted_losing) if predicted_losing else None,
            "automatic_timings": {f"{2 ** (b - 1)}+": {"plain_s_per_token": t.plain, "speculative_s_per_token": t.speculative}
                                  for b, t in sorted(engines["automatic"].engine.speculator.measured.buckets.items())},
            "costs": [vars(c) | {"ratio": c.ratio} for c in costs.values()]}


def _speculate(target: GPT, drafter, prompt: list[int], max_new: int, k: int) -> tuple[list[int], SpeculativeStats]:
    out = generate_speculative(target, drafter, prompt, max_new, num_speculative_tokens=k)
    return out.tokens, out.stats


def run(target: GPT, draft: GPT, *, num_prompts: int, prompt_len: int, max_new: int, rounds: int,
        ks: list[int] = KS, batches: list[int] = BATCHES, progress: bool = True,
        engine_draft: GPT | str | Path | None = None) -> dict:
    """The whole benchmark: step costs, then :func:`measure` on stories and out-of-domain text,
    then :func:`batch_sweep` over ``batches`` (none if empty). ``engine_draft`` is what the
    batched engines speculate with (default ``draft``): the draft's checkpoint, as a server is
    given it, drafts among its training text's tokens alone."""
    workloads = {"stories": story_prompts(num_prompts, prompt_len),
                 "out-of-domain": out_of_domain_prompts(num_prompts, prompt_len)}
    device = target.device
    report = {"device": device_name(device), "threads": torch.get_num_threads(), "num_prompts": num_prompts,
              "prompt_len": prompt_len, "max_new_tokens": max_new, "rounds": rounds, "ks": ks,
              "target_params": sum(p.numel() for p in target.parameters()),
              "draft_params": sum(p.numel() for p in draft.parameters())}
    report["costs"] = step_costs(target, draft, ks, repeats=50)
    report |= measure(target, draft, workloads, ks=ks, max_new=max_new, rounds=rounds, progress=progress)
    c = report["costs"]["draft_step_s"] / report["costs"]["target_step_s"]
    report["cost_ratio"] = c
    for r in report["results"]:
        model_drafter = r["drafter"] == "draft model"
        alpha = r["per_position_acceptance"]  # Leviathan et al.'s alpha, not accepted / drafted
        r["expected_tokens_per_pass"] = expected_tokens_per_pass(alpha, r["k"])
        r["expected_speedup"] = expected_speedup(alpha, r["k"], c if model_drafter else 0.0)
        r["predicted_speedup"] = predicted_speedup(r, report["costs"], report["costs"]["draft_step_s"] if model_drafter else 0.0)
    if batches:
        if progress:
            print("Batched speculation (greedy stories, draft model):", flush=True)
        report["batched"] = batch_sweep(target, draft if engine_draft is None else engine_draft, batches,
                                        prompt_len=prompt_len, max_new=max_new,
                                        rounds=rounds, progress=progress)
    return report


def plot(report: dict, path) -> None:
    """Speedup and per-position acceptance against k: one line per (drafter, text)."""
    save_figure(figure(report, pyplot()), path)


def figure(report: dict, plt):
    """The benchmark's figure (also shown inline by chapter 15)."""
    batched = report.get("batched")
    fig, axes = plt.subplots(1, 3 if batched else 2, figsize=(16 if batched else 11, 3.8))
    left, right = axes[:2]
    styles = {"stories": "-", "out-of-domain": "--"}
    colors = {"draft model": "C0", "n-gram lookup": "C1"}
    for text in styles:
        for drafter in colors:
            rows = [r for r in report["results"] if r["text"] == text and r["drafter"] == drafter]
            ks = [r["k"] for r in rows]
            label = f"{drafter}, {text}"
            left.plot(ks, [r["speedup"] for r in rows], styles[text], color=colors[drafter], marker="o", label=label)
            right.plot(ks, [r["per_position_acceptance"] for r in rows], styles[text], color=colors[drafter], marker="o", label=label)
    left.axhline(1.0, color="gray", lw=0.8)
    left.set(xlabel="draft tokens per step k", ylabel="speedup vs target alone", title="speedup (greedy, batch 1)")
    right.set(xlabel="draft tokens per step k", ylabel="alpha", title="per-position acceptance alpha", ylim=(0, 1.05))
    right.legend(fontsize=8)
    if batched:
        batch_panel(axes[2], batched)
    fig.suptitle(report["device"], fontsize=9)
    fig.tight_layout()
    return fig


def batch_panel(ax, batched: dict) -> None:
    """Speedup against batch size: speculating at every size, with the automatic limit, and
    the crossover's prediction, on a log batch axis."""
    rows = batched["rows"]
    sizes = [r["batch"] for r in rows]
    ax.plot(sizes, [r["speedup"] for r in rows], "o-", color="C0", label="speculating at every batch")
    ax.plot(sizes, [r["automatic_speedup"] for r in rows], "s--", color="C2", label="automatic limit")
    predicted = [(r["batch"], r["predicted_speedup"]) for r in rows if r["predicted_speedup"] is not None]
    if predicted:
        ax.plot(*zip(*predicted), ":", color="gray", marker="x", label="predicted (tok/pass / r(B))")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="batch size (sequences)", ylabel="speedup vs plain decoding",
           title=f"speculation for the whole batch (k={batched['k']})")
    ax.legend(fontsize=8)


def add_arguments(p) -> None:
    """``python -m minillm.bench speculative``'s options."""
    p.add_argument("--num-prompts", type=int, default=4, help=f"openings per kind of text (at most {len(OUT_OF_DOMAIN)})")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens of each opening")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds; speedups are ratios of medians")
    p.add_argument("--max-k", type=int, default=8, help="measure k = 1 .. MAX_K draft tokens")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)),
                   help="batch sizes for speculation through the engine, comma-separated ('' for none)")
    p.add_argument("--threads", type=int, default=None, help="PyTorch CPU threads (default: PyTorch's choice)")
    add_options(p, "--device", "--out")


def run_from_args(args, out: Path) -> Path:
    """Load (or train) the ``cpu`` target and the ``draft`` model, measure, save JSON and a plot."""
    if min(args.num_prompts, args.prompt_len, args.max_new_tokens, args.rounds, args.max_k) < 1:
        raise UsageError("--num-prompts, --prompt-len, --max-new-tokens, --rounds and --max-k must be at least 1")
    if args.threads is not None:
        if args.threads < 1:
            raise UsageError("--threads must be at least 1")
        torch.set_num_threads(args.threads)
    if args.num_prompts > len(OUT_OF_DOMAIN):
        raise UsageError(f"--num-prompts can be at most {len(OUT_OF_DOMAIN)} (the out-of-domain openings there are)")
    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        raise UsageError(f"--batches must be comma-separated integers, got {args.batches!r}") from None
    if any(b < 1 for b in batches):
        raise UsageError("--batches must all be at least 1")
    if quick():
        args.num_prompts, args.max_new_tokens, args.rounds, args.max_k = 2, 12, 1, 3
        batches = [b for b in batches if b <= 4]
    target, draft = load_or_train("cpu", args.device), load_or_train("draft", args.device)
    if 1 + args.prompt_len + args.max_new_tokens > target.cfg.context_length:
        raise UsageError(f"--prompt-len + --max-new-tokens must fit the context of {target.cfg.context_length} tokens")
    report = run(target, draft, num_prompts=args.num_prompts, prompt_len=args.prompt_len,
                 max_new=args.max_new_tokens, rounds=args.rounds, ks=list(range(1, args.max_k + 1)), batches=batches,
                 engine_draft=preset_dir("draft"))
    return save_report(report, out / "speculative-cpu.json", plot)
