"""Speculative decoding's core: the acceptance rule, the drafters, the loop over two KV caches.

Greedy output must equal the target's alone, token for token; sampled output must have the
target's distribution, which a tiny-vocabulary model lets us check against exact probabilities.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from minillm.model.config import ModelConfig
from minillm.speedups.speculative.drafters import ModelDrafter, NgramDrafter
from minillm.decoding.generate import ContiguousKVCache, generate_kv_cache
from minillm.model.gpt import GPT
from minillm.decoding.draws import Stream, uniform
from minillm.decoding.sampling import SamplingParams
from minillm.speedups.speculative.rule import Draft, accept, distribution, draw, generate_speculative, rollback

SMALL = ModelConfig(context_length=64, d_model=32, n_layers=2, n_heads=4, vocab_size=512)


def peaky(cfg: ModelConfig, seed: int, std: float = 0.2) -> GPT:
    """A random model with large weights: peaked logits, so greedy has no near-ties."""
    torch.manual_seed(seed)
    model = GPT(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, std)
    return model


@pytest.fixture(scope="module")
def target() -> GPT:
    return peaky(SMALL, 0)


@pytest.fixture(scope="module")
def draft() -> GPT:
    return peaky(SMALL, 1)


PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("kind", ["other model", "same model", "ngram"])
def test_greedy_output_is_the_targets_token_for_token(target, draft, kind, k) -> None:
    drafter = {"other model": lambda: ModelDrafter(draft), "same model": lambda: ModelDrafter(target),
               "ngram": NgramDrafter}[kind]()
    out = generate_speculative(target, drafter, PROMPT, 40, num_speculative_tokens=k)
    assert out.tokens == generate_kv_cache(target, PROMPT, 40)
    assert out.stats.generated == 40 and out.stats.accepted <= out.stats.drafted


def test_a_perfect_drafter_gives_k_plus_one_tokens_per_target_pass(target) -> None:
    out = generate_speculative(target, ModelDrafter(target), PROMPT, 30, num_speculative_tokens=4)
    assert out.stats.acceptance_rate == 1.0
    assert out.stats.target_passes == 6  # 30 tokens, 5 per pass
    assert out.stats.tokens_per_pass == 5.0


def test_a_stop_token_ends_generation_inside_an_accepted_run(target) -> None:
    full = generate_kv_cache(target, PROMPT, 20)
    stop = full[7]
    out = generate_speculative(target, ModelDrafter(target), PROMPT, 20, num_speculative_tokens=4, stop_token=stop)
    assert out.tokens == full[: full.index(stop) + 1]


def test_greedy_acceptance_stops_at_the_first_disagreement() -> None:
    logits = torch.full((4, 6), -5.0)
    for row, best in enumerate([2, 3, 1, 4]):
        logits[row, best] = 5.0
    greedy = SamplingParams(temperature=0)
    assert accept(logits, Draft([2, 3, 1]), greedy) == (3, 4)  # all accepted, bonus 4
    assert accept(logits, Draft([2, 0, 1]), greedy) == (1, 3)  # second wrong: replaced by 3
    assert accept(logits[:1], Draft(), greedy) == (0, 2)  # no draft: a plain step
    with pytest.raises(ValueError, match="rows of target logits"):
        accept(logits, Draft([2]), greedy)


def _one_step_frequencies(p_logits: torch.Tensor, q: torch.Tensor | None, n: int) -> torch.Tensor:
    """How often each token is the first output of a 1-token draft, over ``n`` draws: one
    seed's draws at ``n`` positions, the draft's by its own stream as a drafter's are."""
    params = SamplingParams(temperature=1.0)
    counts = torch.zeros(p_logits.shape[-1])
    for position in range(n):
        if q is None:
            x = 1  # a deterministic drafter always guesses token 1
            draft = Draft([x])
        else:
            x = draw(q, uniform(0, position, Stream.DRAFT))
            draft = Draft([x], q[None])
        accepted, token = accept(p_logits, draft, params, 0, position)
        counts[x if accepted else token] += 1
    return counts / n


@pytest.mark.parametrize("drafter", ["sampled draft", "deterministic draft"])
def test_the_first_token_has_the_targets_distribution(drafter) -> None:
    p = torch.tensor([0.5, 0.1, 0.25, 0.1, 0.05])
    q = torch.tensor([0.1, 0.5, 0.1, 0.2, 0.1]) if drafter == "sampled draft" else None
    logits = torch.stack([p.log(), p.log()])  # row 1 (the bonus) is unused by the first token
    freq = _one_step_frequencies(logits, q, 8000)
    assert (freq - p).abs().max() < 0.02
    drafted = q if q is not None else torch.eye(5)[1]
    assert (drafted - p).abs().max() > 0.3  # the draft alone is far off: the rule did the work


def _exact_joint(model: GPT, prompt: list[int], n: int) -> dict[tuple[int, ...], float]:
    """The target's probability of every ``n``-token continuation, by enumeration."""
    vocab = model.cfg.vocab_size
    joint = {}
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=n):
            probs = torch.softmax(model(torch.tensor([prompt + list(seq)]))[0].float(), dim=-1)
            positions = range(len(prompt) - 1, len(prompt) - 1 + n)
            joint[seq] = float(torch.prod(torch.stack([probs[pos, tok] for pos, tok in zip(positions, seq)])))
    return joint


def test_sampled_sequences_have_the_targets_joint_distribution() -> None:
    """Two tokens from a 4-token vocabulary with a draft model: accepted drafts, rejected and
    resampled ones, and bonus tokens all take part. The empirical distribution of the 16
    continuations must match the target's exact one, and not the draft's."""
    cfg = ModelConfig(context_length=16, d_model=16, n_layers=1, n_heads=2, vocab_size=4)
    target, draft = peaky(cfg, 10, std=0.5), peaky(cfg, 11, std=0.5)
    prompt, n, runs = [0, 1], 2, 2500
    exact, drafts_own = _exact_joint(target, prompt, n), _exact_joint(draft, prompt, n)
    drafter = ModelDrafter(draft)
    counts = dict.fromkeys(exact, 0)
    drafted = accepted = 0
    for run in range(runs):
        out = generate_speculative(target, drafter, prompt, n, num_speculative_tokens=2, temperature=1.0, seed=run)
        counts[tuple(out.tokens)] += 1
        drafted, accepted = drafted + out.stats.drafted, accepted + out.stats.accepted
    tv = 0.5 * sum(abs(counts[s] / runs - exact[s]) for s in exact)
    assert tv < 0.04, f"total variation {tv:.3f} from the target's distribution"
    assert 0.5 * sum(abs(drafts_own[s] - exact[s]) for s in exact) > 0.2  # the draft's own is far off
    assert 0.1 * drafted < accepted < 0.9 * drafted  # both acceptance and rejection took part


def test_a_sampled_draft_without_a_seed_is_refused_with_a_clear_error(draft) -> None:
    drafter, sampled = ModelDrafter(draft), SamplingParams(temperature=0.8)
    with pytest.raises(ValueError, match="seed="):
        drafter.propose(PROMPT, 3, sampled)
    assert len(drafter.propose(PROMPT, 3, sampled, seed=7).tokens) == 3  # with one, it drafts
    assert len(drafter.propose(PROMPT, 3, SamplingParams(temperature=0)).tokens) == 3  # greedy needs none


def test_distribution_applies_top_k_and_top_p_like_the_sampler() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    top2 = distribution(logits, SamplingParams(temperature=1.0, top_k=2))[0]
    expected = torch.softmax(logits[0, :2], dim=-1)
    assert torch.allclose(top2[:2], expected) and top2[2:].sum() == 0
    full = torch.softmax(logits[0], dim=-1)
    nucleus = distribution(logits, SamplingParams(temperature=1.0, top_p=0.8))[0]
    kept = int((nucleus > 0).sum())
    assert full[: kept - 1].sum() < 0.8 <= full[:kept].sum()  # the smallest set reaching 0.8
    assert torch.allclose(distribution(logits, SamplingParams(temperature=0.5))[0], torch.softmax(logits[0] / 0.5, -1))


def test_the_draft_models_cache_rolls_back_to_the_common_prefix(draft) -> None:
    greedy = SamplingParams(temperature=0)
    used = ModelDrafter(draft)
    used.propose(PROMPT + [1, 2, 3], 4, greedy)  # fills its cache past the point we change
    again = used.propose(PROMPT + [9], 4, greedy)
    assert again.tokens == ModelDrafter(draft).propose(PROMPT + [9], 4, greedy).tokens
    assert used.cache.length == len(PROMPT) + 1 + 3  # the prompt, 9, and three fed drafts


def test_rollback_only_shortens(target) -> None:
    cache = ContiguousKVCache(target, 1, 16)
    target(torch.tensor([[1, 2, 3, 4]]), cache=cache)
    rollback(cache, 2)
    assert cache.length == 2
    with pytest.raises(ValueError, match="roll a cache of 2 positions back to 3"):
        rollback(cache, 3)


def test_ngram_lookup_proposes_what_followed_the_latest_match() -> None:
    lookup = NgramDrafter(max_ngram=2)
    assert lookup.propose([1, 2, 3, 4, 9, 1, 2], 2).tokens == [3, 4]
    assert lookup.propose([1, 2, 3, 4, 1, 2, 5, 6, 1, 2], 3).tokens == [5, 6, 1]  # latest full match
    assert lookup.propose([1, 2, 3], 3).tokens == []  # nothing repeats
    assert lookup.propose([7, 7, 7], 4).tokens == [7]  # only one token ever followed a 7 7
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(max_ngram=1, min_ngram=2)


def test_bad_arguments_are_refused(target) -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        generate_speculative(target, NgramDrafter(), PROMPT, 4, num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        generate_speculative(target, NgramDrafter(), PROMPT, 64)


def test_the_benchmark_measures_both_drafters_and_checks_outputs(target, draft) -> None:
    from minillm.bench.speculative import OUT_OF_DOMAIN, batched_verify_cost, expected_speedup, measure, out_of_domain_prompts

    assert expected_speedup(0.0, 4, 0.5) == pytest.approx(1 / 3)  # nothing accepted: pay for 4 drafts
    assert expected_speedup(1.0, 4, 0.0) == 5.0  # everything accepted, free drafts: k + 1 per pass
    assert expected_speedup(0.5, 1, 0.0) == pytest.approx(1.5)
    prompts = out_of_domain_prompts(len(OUT_OF_DOMAIN), 16)
    assert len({tuple(p) for p in prompts}) == len(OUT_OF_DOMAIN) and all(len(p) == 17 for p in prompts)
    with pytest.raises(ValueError, match="out-of-domain openings"):
        out_of_domain_prompts(len(OUT_OF_DOMAIN) + 1, 16)
    report = measure(target, draft, {"text": [PROMPT]}, ks=[2], max_new=6, rounds=1, progress=False)
    rows = report["results"]
    assert [(r["drafter"], r["k"]) for r in rows] == [("draft model", 2), ("n-gram lookup", 2)]
    assert all(r["identical"] and r["speedup"] > 0 and 1 <= r["tokens_per_pass"] <= r["k"] + 1 for r in rows)
    assert all(r["acceptance_rate"] <= r["per_position_acceptance"] <= 1 for r in rows)
    (row,) = batched_verify_cost(target, [2], k=3, context=8, repeats=1)
    assert row["batch"] == 2 and row["ratio"] == row["verify_s"] / row["step_s"]
    assert row["step_quartiles_s"] == [row["step_s"]] * 2  # one repeat: no spread


def test_per_position_acceptance_recovers_alpha_and_predicts_tokens_per_pass() -> None:
    """Rounds simulated under Leviathan et al.'s model (each drafted token accepted with
    probability alpha once the earlier ones were): the per-position estimate recovers alpha at
    every k, and the formula fed with it predicts the simulated tokens per pass. Accepted over
    drafted falls with k and, fed to the formula, predicts too few tokens (truncation counted twice)."""
    import random

    from minillm.bench.speculative import expected_speedup, expected_tokens_per_pass
    from minillm.speedups.speculative.rule import SpeculativeStats

    rng = random.Random(0)
    alpha = 0.7
    for k in (1, 2, 4, 8):
        stats = SpeculativeStats()
        for _ in range(20000):
            n = next((i for i in range(k) if rng.random() >= alpha), k)
            stats.record(k, n, n + 1)
        assert stats.per_position_acceptance == pytest.approx(alpha, abs=0.01)
        assert expected_tokens_per_pass(stats.per_position_acceptance, k) == pytest.approx(stats.tokens_per_pass, rel=0.02)
        if k >= 4:  # the old estimate: 0.51 at k = 4, predicting 1.9 tokens per pass where 2.8 come
            assert stats.acceptance_rate < alpha - 0.15
            assert expected_tokens_per_pass(stats.acceptance_rate, k) < 0.8 * stats.tokens_per_pass
    assert expected_speedup(alpha, 4, 0.0) == pytest.approx(expected_tokens_per_pass(alpha, 4))
    full = SpeculativeStats()
    full.record(3, 3, 4)  # every token accepted: no rejection counted, alpha estimated 1
    assert (full.rejections, full.per_position_acceptance) == (0, 1.0)
    full.record(3, 0, 1)
    assert (full.rejections, full.per_position_acceptance) == (1, 0.75)
    assert SpeculativeStats().per_position_acceptance == 0.0
