"""Checking and timing pipeline parallelism on this machine: the functions chapter 17 calls."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from minillm.engine.llm import LLM
from minillm.model.gpt import GPT
from minillm.decoding.sampling import SamplingParams
from minillm.distributed.tensor_measure import max_logit_diff, prompt_ids


@dataclass
class PipelineEquivalence:
    """Greedy tokens of the engine over ``stages`` processes against one process."""

    stages: int
    max_abs_logit_diff: float  # a full forward over each prompt
    reference_tokens: list[list[int]]
    pipelined_tokens: dict[int, list[list[int]]]  # by micro-batches in flight
    preemptions: dict[int, int]  # by micro-batches in flight
    bytes_per_token: float  # counted over the full forwards: every stage's sends, per token

    @property
    def tokens_identical(self) -> bool:
        return all(tokens == self.reference_tokens for tokens in self.pipelined_tokens.values())


def check_pipeline_equivalence(model: GPT, prompts: list[str] | list[list[int]], stages: int = 2,
                               max_new_tokens: int = 20, micro_batches: tuple[int, ...] = (1, 2),
                               num_blocks: int | None = None) -> PipelineEquivalence:
    """Generate greedily from ``prompts`` in one process, then through the engine over
    ``stages`` processes with each number of ``micro_batches`` in flight; a small
    ``num_blocks`` forces preemption. Also the largest logit difference of a full forward."""
    ids = prompt_ids(prompts)
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    reference = [o.token_ids for o in LLM(model.eval(), pack_weights=False).generate(ids, params, use_tqdm=False)]
    tokens, preemptions, diff = {}, {}, 0.0
    for m in micro_batches:
        with LLM(model, pipeline_parallel_size=stages, pipeline_micro_batches=m, num_blocks=num_blocks) as llm:
            tokens[m] = [o.token_ids for o in llm.generate(ids, params, use_tqdm=False)]
            preemptions[m] = llm.engine.stats().preemptions
            pipeline = llm.engine.model
            pipeline.reset_stats()
            diff = max(diff, max_logit_diff(pipeline, model, ids))
            sent = sum(s.bytes_sent for s in pipeline.stage_stats()) / sum(map(len, ids))
    return PipelineEquivalence(stages, diff, reference, tokens, preemptions, sent)


def _decode_rounds(llm: LLM, batch: int, prompt_len: int, rounds: int, steps_per_round: int) -> tuple[float, int]:
    """Queue ``batch`` random prompts, step until each has two tokens (the prefills and a
    warm-up), then time ``rounds`` rounds of ``steps_per_round`` engine steps. Returns the
    seconds and the tokens generated in them."""
    engine = llm.engine
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=4 + 2 * rounds, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(f"bubble-{i}", torch.randint(0, 50000, (prompt_len,), generator=generator).tolist(),
                               params) for i in range(batch)]
    while min(s.num_output_tokens for s in seqs) < 2:
        engine.step()
    if hasattr(engine.model, "reset_stats"):
        engine.model.reset_stats()
    before, start = sum(s.num_output_tokens for s in seqs), time.perf_counter()
    for _ in range(rounds * steps_per_round):
        engine.step()
    seconds = time.perf_counter() - start
    generated = sum(s.num_output_tokens for s in seqs) - before
    for s in seqs:
        engine.abort(s.request_id)
    while engine.has_unfinished:  # collect what is still in flight
        engine.step()
    return seconds, generated


def measure_bubble(model: GPT, stages: int = 2, micro_batches: tuple[int, ...] = (1, 2, 4), batch: int = 16,
                   micro_batch_size: int | None = None, prompt_len: int = 32, rounds: int = 8, threads: int = 1,
                   repeats: int = 3) -> list[dict]:
    """Decoding requests through ``stages`` processes of ``threads`` threads, with each number
    of ``micro_batches`` in flight, beside one process on ``stages * threads`` threads (the
    same cores; weights unpacked, as the stages run them) decoding as many requests. The
    requests are ``batch`` in all, split evenly among the micro-batches, or with
    ``micro_batch_size``, that many per micro-batch. Each setup is timed over ``rounds`` rounds
    (every request one token further), ``repeats`` times; medians, and the rounds' spread.

    Row fields: ``setup``, ``micro_batches``, ``batch``, ``round_ms`` (``_min``, ``_max``),
    ``tokens_per_s``; for the pipelines also, per stage ``s``, ``busy_ms_{s}`` (computing its
    blocks, per round) and ``utilisation_{s}`` (that over the round), and
    ``rank0_not_waiting``: the share of the round rank 0 spent on anything but waiting for the
    pipeline (stage 0, the head, sampling, scheduling)."""
    previous = torch.get_num_threads()
    rows, baselines = [], {}
    try:
        for m in micro_batches:
            total = batch if micro_batch_size is None else m * micro_batch_size
            blocks = total * (-(-(prompt_len + 4 + 2 * rounds) // 16) + 1)
            if total not in baselines:
                torch.set_num_threads(stages * threads)
                with LLM(model, num_blocks=blocks, pack_weights=False) as llm:
                    runs = [_decode_rounds(llm, total, prompt_len, rounds, 1) for _ in range(repeats)]
                baselines[total] = _row(f"1 process, {stages * threads} threads", 1, total, runs, rounds)
                rows.append(baselines[total])
            torch.set_num_threads(threads)
            with LLM(model, pipeline_parallel_size=stages, pipeline_micro_batches=m, num_blocks=blocks) as llm:
                runs, stats = [], []
                for _ in range(repeats):
                    runs.append(_decode_rounds(llm, total, prompt_len, rounds, m))
                    stats.append(llm.engine.model.stage_stats())
            row = _row(f"{stages} stages, {m} in flight", m, total, runs, rounds)
            wall = statistics.median(s for s, _ in runs)
            for s in range(stages):
                busy = statistics.median(st[s].busy_seconds for st in stats)
                row[f"busy_ms_{s}"] = 1e3 * busy / rounds
                row[f"utilisation_{s}"] = busy / wall
            row["rank0_not_waiting"] = 1 - statistics.median(st[0].wait_seconds for st in stats) / wall
            rows.append(row)
    finally:
        torch.set_num_threads(previous)
    return rows


def _row(setup: str, micro_batches: int, batch: int, runs: list[tuple[float, int]], rounds: int) -> dict:
    seconds = [s for s, _ in runs]
    rates = [n / s for s, n in runs]
    return {"setup": setup, "micro_batches": micro_batches, "batch": batch, "round_ms": 1e3 * statistics.median(seconds) / rounds,
            "round_ms_min": 1e3 * min(seconds) / rounds, "round_ms_max": 1e3 * max(seconds) / rounds,
            "tokens_per_s": statistics.median(rates)}


def predict_utilisation(stage_ms: float, hop_ms: float, stages: int, micro_batches: int) -> float:
    """A stage's busy share in steady decoding, for ``stages`` equal stages of ``stage_ms``
    each per micro-batch, ``hop_ms`` of overhead per hand-over, and ``micro_batches`` in
    flight. One micro-batch's trip takes ``stages * (stage_ms + hop_ms)``; in that time a
    stage can serve every micro-batch once, so it is busy ``micro_batches * stage_ms`` of it,
    or all of it once the micro-batches queue up. (GPipe's bubble, ``(N - 1) / (m + N - 1)``,
    is the same idea for one batch that must drain: a decode pipeline never drains, since a
    finished micro-batch is launched again at once.)"""
    trip = stages * (stage_ms + hop_ms)
    return min(1.0, micro_batches * stage_ms / trip)
