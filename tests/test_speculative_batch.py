"""Speculation for the whole batch: every decoding request of a step drafts, one forward
verifies them all, and the output stays the target's: token for token greedy, through
preemption, prefix caching, new arrivals and aborts; in distribution sampled."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from minillm.data.tokenizer import get_tokenizer
from minillm.decoding.sampling import SamplingParams
from minillm.engine.config import EngineConfig
from minillm.engine.llm import LLM
from minillm.engine.llm_engine import LLMEngine
from minillm.model.config import ModelConfig
from minillm.model.gpt import GPT
from minillm.speedups.speculative.speculator import SpeculativeEngine, Speculator
from test_speculative import peaky
from test_speculative_engine import draft, target  # noqa: F401 (the same two models, as fixtures)

from server.app import create_app
from server.config import ServerConfig

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 2, 3], list(range(100, 140)), [9, 9, 9, 4, 4]]
GREEDY = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(target) -> list[list[int]]:
    return [out.token_ids for out in LLM(target, num_blocks=64, block_size=8).generate(PROMPTS, GREEDY, use_tqdm=False)]


def run_steps(engine: SpeculativeEngine, requests: dict[str, tuple[list[int], SamplingParams]],
              arrivals: dict[int, str] | None = None) -> tuple[dict[str, list[int]], list[list[int]]]:
    """Step ``engine`` to the end; a request named in ``arrivals`` is added before that step.
    Returns each request's tokens and, per step, every chunk's lookahead slots."""
    arrivals = arrivals or {}
    for name, (prompt, params) in requests.items():
        if name not in arrivals.values():
            engine.add_request(name, prompt, params)
    tokens: dict[str, list[int]] = {name: [] for name in requests}
    lookaheads, step = [], 0
    while engine.has_unfinished or step in arrivals:
        if step in arrivals:
            engine.add_request(arrivals[step], *requests[arrivals[step]])
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        lookaheads.append([c.num_lookahead for c in engine.last_step.chunks])
        step += 1
    return tokens, lookaheads


@pytest.mark.parametrize("kind", ["target as draft", "other model"])
def test_a_batch_verifies_together_and_stays_the_targets_through_preemption(target, draft, reference, kind) -> None:
    """A pool too small for four requests at once: the newest are preempted and recomputed
    while the others speculate, and every request's tokens are still the target's alone."""
    speculator = Speculator.with_draft_model(target if kind == "target as draft" else draft, target, 4,
                                             disable_by_batch_size=8)
    engine = SpeculativeEngine(target, EngineConfig(num_blocks=14, block_size=8), speculator=speculator)
    tokens, lookaheads = run_steps(engine, {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)})
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == reference
    assert engine.scheduler.num_preemptions > 0
    assert max(sum(n > 0 for n in step) for step in lookaheads) >= 3  # several sequences drafted in one step
    assert engine.allocator.num_used_blocks == 0
    if kind == "target as draft":
        assert speculator.stats.acceptance_rate == 1.0
        assert speculator.stats.tokens_per_pass > 3


def test_draft_lengths_follow_acceptance(target, draft) -> None:
    """A drafter the target always agrees with keeps drafting ``k``; one it never agrees with
    falls to a single token, so a bad drafter wastes little."""
    for model, expected in ((target, 4), (draft, 1)):
        speculator = Speculator.with_draft_model(model, target, 4, disable_by_batch_size=8)
        engine = SpeculativeEngine(target, EngineConfig(num_blocks=64, block_size=8), speculator=speculator)
        seqs = [engine.add_request(i, p, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
                for i, p in enumerate(PROMPTS[:2])]
        for _ in range(8):
            engine.step()
        assert [speculator.draft_lengths[s] for s in seqs] == [expected, expected]
    assert speculator.stats.acceptance_by_position[0] < 0.2  # the bad drafter's first tokens were rejected


def test_past_the_batch_limit_no_one_drafts(target, reference) -> None:
    speculator = Speculator.with_draft_model(target, target, 3, disable_by_batch_size=2)
    engine = SpeculativeEngine(target, EngineConfig(num_blocks=64, block_size=8), speculator=speculator)
    short = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)  # two finish early
    tokens, lookaheads = run_steps(engine, {str(i): (p, short if i < 2 else GREEDY) for i, p in enumerate(PROMPTS)})
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == [r[:10] for r in reference[:2]] + reference[2:]
    assert all(not any(step) for step in lookaheads if len(step) > 2)
    assert any(sum(n > 0 for n in step) == 2 for step in lookaheads)  # two left: both draft


def test_arrivals_prefix_hits_aborts_and_token_by_token_rows_share_the_verifying_step(target, draft, reference) -> None:
    """A prompt arriving mid-run is prefilled in the step that verifies the others' drafts; a
    request that shares a cached prefix speculates over it; a request that reports logprobs
    (its logits matter at every position) decodes token by token in the same steps; an
    aborted request leaves the others as they were."""
    engine = SpeculativeEngine(target, EngineConfig(num_blocks=64, block_size=8),
                               speculator=Speculator.with_draft_model(draft, target, 3, disable_by_batch_size=8))
    shared = PROMPTS[2] + [7, 7]  # its first 40 tokens are request "2"'s, in the prefix cache by then
    requests = {"0": (PROMPTS[0], GREEDY), "2": (PROMPTS[2], GREEDY),
                "late": (PROMPTS[1], GREEDY), "prefix": (shared, GREEDY),
                "logprobs": (PROMPTS[3], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=2)),
                "aborted": ([3, 1, 4, 1, 5], GREEDY)}
    engine.add_request("aborted", *requests["aborted"])
    engine.step()
    engine.abort("aborted")
    tokens, lookaheads = run_steps(engine, {k: v for k, v in requests.items() if k != "aborted"},
                                   arrivals={3: "late", 6: "prefix"})
    assert [tokens["0"], tokens["late"], tokens["2"], tokens["logprobs"]] == reference
    alone = LLM(target, num_blocks=64, block_size=8).generate([shared], GREEDY, use_tqdm=False)[0].token_ids
    assert tokens["prefix"] == alone
    assert engine.allocator.prefix_hit_rate > 0
    assert engine.allocator.num_used_blocks == 0


def _exact_marginal(model: GPT, prompt: list[int], n: int, skip: int) -> dict[tuple[int, ...], float]:
    """The target's probability of tokens ``skip .. n - 1`` of an ``n``-token continuation."""
    vocab = model.cfg.vocab_size
    marginal: dict[tuple[int, ...], float] = {}
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=n):
            probs = torch.softmax(model(torch.tensor([prompt + list(seq)]))[0].float(), dim=-1)
            p = float(torch.prod(torch.stack([probs[len(prompt) - 1 + i, t] for i, t in enumerate(seq)])))
            marginal[seq[skip:]] = marginal.get(seq[skip:], 0.0) + p
    return marginal


def test_a_sampled_batch_has_the_targets_distribution() -> None:
    """Hundreds of seeded requests in one batch, each drafting with another model: the tokens
    that speculation decided (after the prompt's first sampled token) follow the target's
    distribution, not the draft's, and both acceptance and rejection took part."""
    cfg = ModelConfig(context_length=16, d_model=16, n_layers=1, n_heads=2, vocab_size=4)
    target, draft = peaky(cfg, 10, std=0.5), peaky(cfg, 11, std=0.5)
    prompt, n, runs = [0, 1], 3, 2000
    exact, drafts_own = _exact_marginal(target, prompt, n, 1), _exact_marginal(draft, prompt, n, 1)
    llm = LLM(target, num_blocks=2 * runs, block_size=4, max_num_seqs=runs, speculative_draft=draft,
              num_speculative_tokens=2, speculative_disable_by_batch_size=runs)
    params = [SamplingParams(max_tokens=n, temperature=1.0, seed=run, ignore_eos=True) for run in range(runs)]
    counts = dict.fromkeys(exact, 0)
    for out in llm.generate([prompt] * runs, params, use_tqdm=False):
        counts[tuple(out.token_ids[1:])] += 1
    tv = 0.5 * sum(abs(counts[s] / runs - exact[s]) for s in exact)
    assert tv < 0.04, f"total variation {tv:.3f} from the target's distribution"
    assert 0.5 * sum(abs(drafts_own[s] - exact[s]) for s in exact) > 0.2  # the draft's own is far off
    stats = llm.engine.speculator.stats
    assert 0.1 * stats.drafted < stats.accepted < 0.9 * stats.drafted
    assert stats.target_passes >= runs  # every request drafted, in steps of the whole batch


def test_the_round_costs_are_timed_through_the_engine_before_it_serves(target, draft) -> None:
    """The benchmark's prediction: a round (a verification of k + 1 tokens per sequence and k
    draft steps) in plain steps, timed on random sequences through a fresh engine's runner and
    drafter, for every batch the pool can hold."""
    from minillm.bench.speculative import StepCosts, time_costs

    assert StepCosts(4, 4, step_s=1.0, verify_s=1.6, draft_s=0.1).ratio == pytest.approx(2.0)
    engine = SpeculativeEngine(target, EngineConfig(num_blocks=64, block_size=8),
                               speculator=Speculator.with_draft_model(draft, target, 3))
    costs = time_costs(engine.runner.runner, engine.speculator.drafter, [1, 2, 4, 8], 3, repeats=1)
    assert [c.batch for c in costs] == [1, 2, 4]  # 9 blocks a sequence: 8 sequences do not fit 64 blocks
    assert all(c.step_s > 0 and c.verify_s > 0 and c.draft_s > 0 for c in costs)
    assert costs[0].ratio > 1  # three draft steps of a model as large as the target: dearer than a step
    assert engine.allocator.num_used_blocks == 0


def test_the_measured_choice_tries_both_then_keeps_the_faster_and_retries_the_other() -> None:
    from minillm.speedups.speculative.crossover import MeasuredChoice

    # one timed step of each to decide, and a budget no trial's cost stretches the waits for
    choice = MeasuredChoice(retry_every=4, retry_budget=100, first_steps=1)
    assert choice.choose(4) is True  # untimed: speculation first
    choice.record(4, True, seconds=1.0, tokens_per_sequence=1.0)  # switched to speculation: the catch-up, not counted
    assert choice.choose(4) is True and choice.buckets[3].speculative is None
    choice.record(4, True, seconds=0.030, tokens_per_sequence=2.0)  # 15 ms a token
    assert choice.choose(5) is False  # same bucket (4-7): now time the plain step
    choice.record(5, False, seconds=0.010, tokens_per_sequence=1.0)  # 10 ms a token: plain is faster
    steps = []
    for _ in range(32):  # the slower retried after 4, 8, 16 steps: a switch, then a timed step
        speculated = choice.choose(6)
        steps.append(speculated)
        choice.record(6, speculated, 0.030 if speculated else 0.010, 2.0 if speculated else 1.0)
    assert [i for i, speculated in enumerate(steps) if speculated] == [3, 4, 12, 13, 29, 30]
    assert choice.buckets[3].speculative == pytest.approx(0.015)  # never the switches' catch-up
    assert choice.choose(1) is True and choice.choose(16) is True  # other buckets start afresh
    for _ in range(20):  # the drafter got better: speculative steps now 5 ms a token
        choice.record(4, True, seconds=0.010, tokens_per_sequence=2.0)
    assert choice.choose(4) is True


def test_the_measured_choice_takes_medians_so_one_slow_step_does_not_decide() -> None:
    from minillm.speedups.speculative.crossover import MeasuredChoice

    choice = MeasuredChoice(first_steps=3)
    steps, plain_seconds = [], iter([0.010, 0.090, 0.010])  # one plain step hit by an 80 ms pause
    for _ in range(7):
        speculated = choice.choose(2)
        steps.append(speculated)
        choice.record(2, speculated, 0.030 if speculated else next(plain_seconds), 2.0 if speculated else 1.0)
    # a switch and three timed speculative steps (15 ms a token), then three plain (10, 90, 10 ms)
    assert steps == [True, True, True, True, False, False, False]
    assert choice.buckets[2].plain == pytest.approx(0.010)  # their average: 37 ms, above speculation's 15
    assert choice.choose(2) is False  # plain, the faster, despite the slow step


def steps_after_a_first_trial(switch_seconds: float, speculative_seconds: float, steps: int) -> list[bool]:
    """Whether each of ``steps`` steps at batch 8 speculated, after a first trial of speculation
    (a switch of ``switch_seconds``, one timed step of ``speculative_seconds`` for two tokens) and
    one plain step of 10 ms; each later step takes ``speculative_seconds`` or 10 ms again."""
    from minillm.speedups.speculative.crossover import MeasuredChoice

    choice = MeasuredChoice(retry_every=4, max_retry_every=10**6, retry_budget=0.02, first_steps=1)
    choice.choose(8)
    choice.record(8, True, seconds=switch_seconds, tokens_per_sequence=1.0)  # the switch: catch-up and all
    choice.choose(8)
    choice.record(8, True, seconds=speculative_seconds, tokens_per_sequence=2.0)
    choice.choose(8)
    choice.record(8, False, seconds=0.010, tokens_per_sequence=1.0)  # plain: 10 ms a token
    speculated = []
    for _ in range(steps):
        yes = choice.choose(8)
        speculated.append(yes)
        choice.record(8, yes, speculative_seconds if yes else 0.010, 2.0 if yes else 1.0)
    return speculated


def test_a_dear_trial_of_speculation_waits_until_its_cost_is_within_the_budget() -> None:
    """Where plain decoding is faster, the next trial of speculation waits until the last
    trial's cost beyond plain steps (its two steps' time less what plain steps take for the
    same tokens) is at most ``retry_budget`` of the plain steps in between."""

    def first_trial(switch_seconds: float) -> list[int]:  # speculation at 15 ms a token: the slower
        return [i for i, yes in enumerate(steps_after_a_first_trial(switch_seconds, 0.030, 3000)) if yes]

    # a cheap trial: 35.1 ms for 3 tokens, 5.1 ms beyond 3 plain steps: 2% of 25.5 plain steps
    assert first_trial(0.0051)[:2] == [25, 26]
    # a dear one, whose switch caught up on much: 0.5301 s for 3 tokens, 0.5001 s beyond: 2% of 2,500.5 steps
    assert first_trial(0.5001)[:2] == [2500, 2501]


def test_where_speculation_wins_the_retries_of_plain_steps_keep_the_usual_wait() -> None:
    """A dear first trial (a long catch-up) that still finds speculation faster: the retries
    are of plain steps, which cost no catch-up, so the budget does not stretch their wait."""
    steps = steps_after_a_first_trial(0.5, 0.010, 12)  # speculation at 5 ms a token: the faster
    assert [i for i, speculated in enumerate(steps) if not speculated][:1] == [3]  # plain retried after 4


def test_the_engine_times_both_ways_and_its_output_stays_the_targets(target, draft, reference) -> None:
    """Without a given limit the engine times its own decode steps both ways at each batch
    size: its first four decode steps at a size speculate (the first, which switches to
    speculation, is not timed), the next three do not, and from then on the faster decides;
    the tokens stay the target's all along."""
    speculator = Speculator.with_draft_model(draft, target, 3)
    engine = SpeculativeEngine(target, EngineConfig(num_blocks=64, block_size=8), speculator=speculator)
    tokens, lookaheads = run_steps(engine, {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)})
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == reference
    decode_steps = lookaheads[1:]  # after the prefill, four decodes a step
    assert all(sum(decode_steps[:4], [])) and not any(sum(decode_steps[4:7], []))  # speculation first, then plain
    timed = speculator.measured.buckets[3]  # batch 4
    assert timed.plain is not None and timed.speculative is not None


def test_the_batch_sweep_compares_three_engines_on_the_same_prompts(target, draft) -> None:
    from minillm.bench.speculative import batch_sweep

    report = batch_sweep(target, draft, [1, 2], max_new=6, rounds=1, progress=False, prompts=PROMPTS[:2])
    assert [r["batch"] for r in report["rows"]] == [1, 2]
    assert all(r["identical"] for r in report["rows"])  # plain, speculating and automatic agree token for token
    assert all(r["tokens_per_pass"] >= 1 and r["speedup"] > 0 for r in report["rows"])
    assert report["costs"] and all(c["ratio"] > 0 for c in report["costs"])
    with pytest.raises(ValueError, match="cannot fill a batch of 4"):
        batch_sweep(target, draft, [4], prompts=PROMPTS[:2])
    lookup = batch_sweep(target, "ngram", [1, 2], max_new=6, rounds=1, progress=False, prompts=PROMPTS[:2])
    assert all(r["identical"] for r in lookup["rows"]) and all(c["draft_s"] == 0 for c in lookup["costs"])


def test_the_draft_models_cache_shares_the_kv_cache_budget(target, draft) -> None:
    """The draft's pool mirrors the target's blocks, so a block costs both: sized from
    ``kv_cache_memory`` alone, the target's pool would take the whole budget and the draft's
    come on top of it (on a GPU, whose default budget is most of its free memory, an
    out-of-memory error)."""
    budget, block_size = 2**20, 8
    speculator = Speculator.with_draft_model(draft, target, 4, disable_by_batch_size=8)
    engine = SpeculativeEngine(target, EngineConfig(kv_cache_memory=budget, block_size=block_size),
                               speculator=speculator)
    draft_pool = speculator.drafter.runner.pool
    per_block = engine.pool.nbytes // (engine.pool.num_blocks + 1) + draft_pool.nbytes // (draft_pool.num_blocks + 1)
    assert draft_pool.num_blocks == engine.pool.num_blocks == budget // per_block
    assert engine.pool.nbytes + draft_pool.nbytes <= budget + per_block  # the pad block beyond the budget
    assert LLM(target, kv_cache_memory=budget, block_size=block_size).engine.pool.num_blocks > engine.pool.num_blocks


def test_a_captured_engine_verifies_eagerly_and_runs_its_plain_steps_captured(target, draft, reference) -> None:
    """With captured decode steps, a verification (several query rows a sequence, which no
    decode program takes) runs eagerly, and the plain steps the timed choice picks run the
    captured programs; the tokens stay the target's."""
    llm = LLM(target, num_blocks=64, block_size=8, max_num_seqs=4, enforce_eager=False,
              speculative_draft=draft, num_speculative_tokens=3)
    graphs = llm.engine.graphs
    assert graphs is not None
    ran, program = [], graphs.program
    graphs.program = lambda b: ran.append(b) or program(b)
    assert [out.token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
    assert llm.engine.speculator.stats.drafted > 0  # the first steps at batch 4 speculated
    assert ran and set(ran) <= {4}  # then plain steps, through the batch-4 program


def test_several_choices_of_one_request_speculate_side_by_side(target, draft) -> None:
    """``n`` > 1 through the server: the choices are sequences of one prompt, admitted and
    drafted together; greedy, each is the plain engine's answer."""
    body = {"prompt": "Once upon a time there was a little dog who lived by the sea with his friend the cat",
            "max_tokens": 24, "temperature": 0, "ignore_eos": True}

    async def texts(engine, n: int) -> list[str]:
        async with TestClient(TestServer(create_app(engine, ServerConfig()))) as client:
            response = await client.post("/v1/completions", json={**body, "n": n})
            return [choice["text"] for choice in (await response.json())["choices"]]

    def speculating(n: int) -> tuple[list[str], int]:
        config = EngineConfig(num_blocks=64, block_size=8)
        speculator = Speculator.with_draft_model(draft, target, 4, disable_by_batch_size=8)
        engine = SpeculativeEngine(target, config, get_tokenizer(), speculator=speculator)
        return asyncio.run(asyncio.wait_for(texts(engine, n), 60)), speculator.stats.drafted

    (one,), drafted_alone = speculating(1)
    three, drafted_together = speculating(3)
    plain = LLMEngine(target, EngineConfig(num_blocks=64, block_size=8), get_tokenizer())
    assert three == [one] * 3 == asyncio.run(asyncio.wait_for(texts(plain, 3), 60))
    assert drafted_together == 3 * drafted_alone > 0  # each choice drafted as it would alone


def counting_submits(engine: SpeculativeEngine) -> list[int]:
    """The batch size of every step ``engine`` submits to overlap, as it submits them."""
    submitted: list[int] = []
    submit = engine.runner.submit
    engine.runner.submit = lambda step: submitted.append(len(step.output.chunks)) or submit(step)
    return submitted


def stopping_midway(target, after: int) -> tuple[list[SamplingParams], list[list[int]]]:
    """Greedy requests for :data:`PROMPTS`, the first two of 12 tokens, the last stopping on a
    token it meets after ``after`` tokens; and what the target alone answers them."""
    plain = LLM(target, num_blocks=64, block_size=8)
    first = plain.generate(PROMPTS[3:], GREEDY, use_tqdm=False)[0].token_ids
    stop = next(t for i, t in enumerate(first) if i >= after and t not in first[:i])
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * 2 + [
        GREEDY, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[stop])]
    expected = [out.token_ids for out in plain.generate(PROMPTS, params, use_tqdm=False)]
    assert len(expected[3]) < 30  # it stopped on the token
    return params, expected


def test_with_overlap_scheduling_large_batches_overlap_and_small_ones_speculate(target, draft) -> None:
    """Overlap scheduling on, speculation up to two sequences, a pool too small for all four:
    the steps of three or four sequences overlap; once two are left they speculate, each
    waiting for the step before it and running to its end; every token is the target's."""
    params, expected = stopping_midway(target, after=6)
    speculator = Speculator.with_draft_model(draft, target, 3, disable_by_batch_size=2)
    engine = SpeculativeEngine(target, EngineConfig(num_blocks=11, block_size=8, async_scheduling=True),
                               speculator=speculator)
    assert engine.overlap
    submitted = counting_submits(engine)
    tokens, lookaheads = run_steps(engine, {str(i): (p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, params))})
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == expected
    assert engine.scheduler.num_preemptions > 0
    assert max(submitted) >= 3 and all(n <= 2 for step in lookaheads if any(step) for n in [len(step)])
    assert speculator.stats.drafted > 0
    assert engine.allocator.num_used_blocks == 0 and not engine.has_unfinished


def test_an_overlapping_engine_times_its_plain_steps_for_the_choice(target, draft, reference) -> None:
    """Without a limit, an overlapping engine times both kinds of decode step at a batch size:
    a plain step as submitted and overlapped, a speculative one run serially."""
    speculator = Speculator.with_draft_model(draft, target, 3)
    engine = SpeculativeEngine(target, EngineConfig(num_blocks=64, block_size=8, async_scheduling=True),
                               speculator=speculator)
    submitted = counting_submits(engine)
    tokens, _ = run_steps(engine, {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)})
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == reference
    timed = speculator.measured.buckets[3]  # batch 4
    assert timed.plain is not None and timed.speculative is not None
    assert 4 in submitted  # plain steps of four overlapped


@pytest.mark.parametrize("first", [True, False], ids=["speculating first", "plain first"])
def test_a_request_that_ends_in_an_overlapped_step_drafts_nothing_in_the_next(target, draft, first) -> None:
    """Plain (overlapped) and speculating steps taking turns: the step behind an overlapped one
    is scheduled before it ends, so a request that stops in it is still in the next, which
    speculates; it drafts nothing there (its tokens would be dropped), and every request is the
    target's alone. No draft reaches past its request's ``max_tokens`` (a pending token counts
    towards it)."""
    params, expected = stopping_midway(target, after=14)
    speculator = Speculator.with_draft_model(draft, target, 3)
    turns = itertools.cycle([first, not first])
    speculator.speculates = lambda batch: next(turns)
    drafted_for_ended: list[bool] = []
    propose = speculator.propose

    def proposing(chunks):
        drafted_for_ended.extend(c.seq.is_finished for c in chunks)
        assert all(c.start + 2 + c.num_lookahead - c.seq.prompt_len <= c.seq.params.max_tokens for c in chunks)
        return propose(chunks)

    speculator.propose = proposing
    engine = SpeculativeEngine(target, EngineConfig(num_blocks=64, block_size=8, async_scheduling=True),
                               speculator=speculator)
    tokens, _ = run_steps(engine, {str(i): (p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, params))})
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == expected
    assert drafted_for_ended and not any(drafted_for_ended)
    assert speculator.stats.drafted > 0 and engine.allocator.num_used_blocks == 0


def test_a_draft_vocabulary_keeps_the_most_frequent_tokens_up_to_the_coverage(tmp_path) -> None:
    import numpy as np

    from minillm.speedups.speculative.draft_vocab import draft_vocabulary, training_token_counts

    counts = torch.tensor([0, 50, 5, 30, 0, 15])  # 100 tokens in all
    assert draft_vocabulary(counts, 0.5).tolist() == [1]
    assert draft_vocabulary(counts, 0.8).tolist() == [1, 3]
    assert draft_vocabulary(counts, 0.81).tolist() == [1, 3, 5]
    assert draft_vocabulary(counts, 1.0).tolist() == [1, 3, 5, 2]  # every token that occurred, and no other
    with pytest.raises(ValueError, match="coverage"):
        draft_vocabulary(counts, 0.0)
    config = {"vocab_size": 6}
    assert torch.equal(training_token_counts({"model_config": config, "data": {"token_counts": counts}}), counts)
    np.array([1, 1, 3, 5, 1], dtype=np.uint16).tofile(tmp_path / "train.bin")  # an older checkpoint's corpus
    (tmp_path / "meta.json").write_text('{"source": "synthetic"}')
    older = {"model_config": config, "data": {"directory": str(tmp_path)}}
    assert training_token_counts(older).tolist() == [0, 3, 0, 1, 0, 1]
    assert training_token_counts({"model_config": config, "data": {"directory": str(tmp_path / "gone")}}) is None


def test_a_draft_limited_to_a_vocabulary_guesses_only_its_tokens_and_the_output_stays_the_targets(target, draft,
                                                                                                   reference) -> None:
    """Greedy, a limited draft guesses the best of its tokens (the whole vocabulary's argmax
    where that is one of them); the target rejects what it would not say, so its output is
    unchanged. Sampled, the draft's distribution puts nothing outside the vocabulary."""
    from minillm.engine.kv_cache import PagedKVPool
    from minillm.engine.sequence import Sequence
    from minillm.speedups.speculative.batch_drafters import PagedDrafter

    everything = torch.arange(target.cfg.vocab_size)
    limited = everything[::3]  # a third of the tokens: many of the target's choices are not among them
    speculator = Speculator.with_draft_model(draft, target, 4, disable_by_batch_size=8, vocabulary=limited)
    engine = SpeculativeEngine(target, EngineConfig(num_blocks=64, block_size=8), speculator=speculator)
    tokens, _ = run_steps(engine, {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)})
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == reference
    assert speculator.stats.drafted > 0 and speculator.stats.rejections > 0

    def guesses(vocabulary, params):
        drafter = PagedDrafter(draft, PagedKVPool(target.cfg, 16, 8, target.device, target.dtype), vocabulary)
        seq = Sequence("s", PROMPTS[2], params, target.cfg.context_length, seed=params.seed)
        seq.block_table = list(range(6))
        return drafter.propose([(seq, 4)])[0]

    whole, kept = guesses(None, GREEDY), guesses(limited, GREEDY)
    assert all(t % 3 == 0 for t in kept.tokens) and len(kept.tokens) == 4
    assert guesses(everything, GREEDY).tokens == whole.tokens  # the whole vocabulary, listed: the same guesses
    sampled = guesses(limited, SamplingParams(max_tokens=30, temperature=1.0, seed=3))
    assert sampled.probs.shape == (4, target.cfg.vocab_size) and all(t % 3 == 0 for t in sampled.tokens)
    assert sampled.probs[:, 1::3].sum() == 0 and torch.allclose(sampled.probs.sum(dim=-1), torch.ones(4))
