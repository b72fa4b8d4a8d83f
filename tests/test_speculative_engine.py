"""Speculative decoding through the engine, ``LLM.generate`` and the server.

Every decoding request of a step speculates (up to the batch size where it stops paying);
greedy output must be the same as without it, one prompt at a time or several together.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from minillm.model.checkpoint import save_checkpoint
from minillm.cli import UsageError
from minillm.model.config import ModelConfig
from minillm.engine.llm import LLM
from minillm.engine.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.build import build_speculator
from minillm.speedups.speculative.speculator import SpeculativeEngine, Speculator
from minillm.model.gpt import GPT
from minillm.decoding.sampling import SamplingParams
from minillm.data.tokenizer import get_tokenizer
from server.__main__ import build
from server.app import create_app
from server.config import ServerConfig, parse_args
from test_speculative import peaky

CFG = ModelConfig(context_length=96, d_model=32, n_layers=2, n_heads=4)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 2, 3], list(range(100, 140))]
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def target() -> GPT:
    return peaky(CFG, 0)


@pytest.fixture(scope="module")
def draft() -> GPT:
    return peaky(CFG, 1)


@pytest.fixture(scope="module")
def reference(target) -> list[list[int]]:
    return [out.token_ids for out in LLM(target, num_blocks=64, block_size=8).generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("kind", ["draft", "target as draft", "ngram"])
def test_greedy_through_the_engine_equals_no_speculation(target, draft, reference, kind) -> None:
    drafter = {"draft": draft, "target as draft": target, "ngram": "ngram"}[kind]
    llm = LLM(target, num_blocks=64, block_size=8, speculative_draft=drafter, num_speculative_tokens=4,
              speculative_disable_by_batch_size=4)
    one_at_a_time = [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in PROMPTS]
    spec = llm.engine.speculator
    assert one_at_a_time == reference
    assert spec.stats.drafted > 0  # speculation did run
    if kind != "draft":  # (two random models never agree; the others save target passes)
        assert spec.stats.target_passes < spec.stats.generated
    before = replace(spec.stats)
    batched = [out.token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert batched == reference
    assert spec.stats.drafted > before.drafted  # the batch speculated too
    if kind != "draft":
        assert spec.stats.target_passes - before.target_passes < spec.stats.generated - before.generated
    assert llm.engine.allocator.num_used_blocks == 0  # the drafts' extra blocks went back too
    if kind == "target as draft":
        assert spec.stats.acceptance_rate == 1.0


def test_a_seeded_sampled_request_is_reproducible_and_well_formed(target, draft) -> None:
    llm = LLM(target, num_blocks=64, block_size=8, speculative_draft=draft, num_speculative_tokens=3,
              speculative_disable_by_batch_size=1)
    params = SamplingParams(max_tokens=30, temperature=0.9, top_k=50, seed=7, ignore_eos=True)
    first, second = (llm.generate([PROMPTS[0]], params, use_tqdm=False)[0] for _ in range(2))
    assert first.token_ids == second.token_ids
    assert len(first.token_ids) == 30 and first.finish_reason == "length"
    assert all(0 <= t < CFG.vocab_size for t in first.token_ids)
    assert llm.engine.speculator.stats.drafted > 0


def test_stop_strings_and_max_tokens_cut_inside_an_accepted_run(target, reference) -> None:
    llm = LLM(target, num_blocks=64, block_size=8, speculative_draft=target, num_speculative_tokens=8,
              speculative_disable_by_batch_size=1)
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=13, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == reference[0][:13] and out.finish_reason == "length"
    tok = get_tokenizer()
    stop = tok.decode(reference[0][5:7])
    text = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]),
                        use_tqdm=False)[0]
    assert text.finish_reason == "stop" and stop not in text.text


def test_a_draft_with_another_vocabulary_is_refused(target) -> None:
    other = GPT(ModelConfig(context_length=96, d_model=32, n_layers=1, n_heads=4, vocab_size=1000))
    with pytest.raises(ValueError, match="vocabulary"):
        Speculator.with_draft_model(other, target, 4)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        build_speculator("ngram", target, 0)


def test_server_flags(tmp_path, target) -> None:
    path = str(save_checkpoint(tmp_path / "ckpt.pt", {"model": target.state_dict(), "model_config": target.cfg.to_dict()}))
    config = parse_args(["--speculative-draft", "ngram", "--num-speculative-tokens", "6"], environ={})
    assert build(replace(config, checkpoint=path)).speculator.k == 6
    config = parse_args(["--speculative-draft", "ngram", "--speculative-disable-by-batch-size", "8"], environ={})
    speculator = build(replace(config, checkpoint=path)).speculator
    assert speculator.speculates(8) and not speculator.speculates(9)
    with pytest.raises(UsageError, match="--speculative-disable-by-batch-size"):
        parse_args(["--speculative-draft", "ngram", "--speculative-disable-by-batch-size", "0"], environ={})
    with pytest.raises(UsageError, match="num_speculative_tokens"):
        parse_args(["--speculative-draft", "ngram", "--num-speculative-tokens", "0"], environ={})
    with pytest.raises(UsageError, match="--speculative-draft: no checkpoint"):
        build(parse_args(["--checkpoint", path, "--speculative-draft", str(tmp_path / "missing")], environ={}))
    assert not isinstance(build(parse_args(["--checkpoint", path], environ={})), SpeculativeEngine)
    counts = torch.zeros(target.cfg.vocab_size, dtype=torch.int64)
    counts[[7, 3, 11]] = torch.tensor([5, 9, 1])
    draft = str(save_checkpoint(tmp_path / "draft.pt", {"model": target.state_dict(), "model_config": target.cfg.to_dict(),
                                                        "data": {"token_counts": counts}}))
    drafter = build(parse_args(["--checkpoint", path, "--speculative-draft", draft], environ={})).speculator.drafter
    assert drafter.vocabulary.tolist() == [3, 7, 11]  # a draft from a checkpoint that counted its training tokens
    drafter = build(parse_args(["--checkpoint", path, "--speculative-draft", path], environ={})).speculator.drafter
    assert drafter.vocabulary is None  # one that did not (and names no corpus): the whole vocabulary


def test_the_server_streams_the_same_greedy_text_with_speculation(target, draft) -> None:
    async def complete(speculator: Speculator | None) -> str:
        config = EngineConfig(num_blocks=64, block_size=8)
        engine = (LLMEngine(target, config, get_tokenizer()) if speculator is None
                  else SpeculativeEngine(target, config, get_tokenizer(), speculator=speculator))
        async with TestClient(TestServer(create_app(engine, ServerConfig()))) as client:
            body = {"prompt": "Once upon a time", "max_tokens": 30, "temperature": 0, "ignore_eos": True}
            response = await client.post("/v1/completions", json=body)
            assert response.status == 200
            return (await response.json())["choices"][0]["text"]

    async def both() -> tuple[str, str]:
        return await complete(None), await complete(Speculator.with_draft_model(draft, target, 4, disable_by_batch_size=1))

    plain, speculative = asyncio.run(asyncio.wait_for(both(), 60))
    assert speculative == plain and plain


def test_speculation_runs_through_the_one_step_path_and_only_the_scheduler_allocates(target, monkeypatch) -> None:
    """The scheduler reserves the draft's lookahead slots; the speculative runner drafts and
    verifies in ``execute`` and returns every emitted token of the chunk; ``step`` is the plain
    engine's, and the tokens equal the target's alone."""
    from minillm.engine.block_allocator import BlockAllocator

    plain = LLM(target, num_blocks=64, block_size=8).generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].token_ids
    engine = SpeculativeEngine(target, EngineConfig(num_blocks=64, block_size=8), speculator=Speculator.with_ngram(4, disable_by_batch_size=1))
    assert type(engine).step is LLMEngine.step
    callers = []
    real_grow = BlockAllocator.grow

    def grow(self, seq, num_tokens):
        import inspect

        callers.append(inspect.stack()[1].frame.f_globals["__name__"])
        return real_grow(self, seq, num_tokens)

    monkeypatch.setattr(BlockAllocator, "grow", grow)
    seq = engine.add_request("r", PROMPTS[0], GREEDY)
    widths, lookaheads = [], []
    while engine.has_unfinished:
        outs = engine.step()
        chunk = engine.last_step.chunks[0]
        lookaheads.append(chunk.num_lookahead)
        widths += [len(o.new_token_ids) for o in outs]
        assert seq.is_finished or len(seq.block_table) * 8 >= chunk.start + 1 + chunk.num_lookahead  # the slots were there
    assert seq.output_ids == plain
    assert max(widths) > 1 and max(lookaheads) == 4  # drafts were accepted, several tokens a step
    assert set(callers) <= {"minillm.engine.scheduler", "minillm.engine.block_allocator"}


def test_lookahead_slots_never_preempt_and_stop_at_max_tokens() -> None:
    from minillm.engine.block_allocator import BlockAllocator
    from minillm.engine.scheduler import Scheduler
    from minillm.engine.sequence import Sequence

    def decode_after_prefill(prompt_len: int, max_tokens: int, num_blocks: int, held_elsewhere: int = 0):
        scheduler = Scheduler(BlockAllocator(num_blocks, block_size=4), max_model_len=64, num_lookahead_slots=4)
        other = Sequence("other", [0] * (4 * held_elsewhere), SamplingParams(), 64)
        scheduler.allocator.admit(other, 4 * held_elsewhere, [])
        seq = Sequence("a", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), 64)
        scheduler.add(seq)
        prefill = scheduler.schedule(0.0)
        assert prefill.chunks[0].num_lookahead == 0  # a prefill does not speculate
        seq.append_token(9, 0.0)
        scheduler.postprocess(prefill)
        return scheduler.schedule(0.0), seq

    out, seq = decode_after_prefill(3, max_tokens=3, num_blocks=8)
    assert out.chunks[0].num_lookahead == 1  # 2 tokens left to give: 1 draft + 1 from the target
    out, seq = decode_after_prefill(3, max_tokens=20, num_blocks=8)
    assert out.chunks[0].num_lookahead == 4 and len(seq.block_table) == 2  # 4 tokens + 4 slots
    out, seq = decode_after_prefill(7, max_tokens=5, num_blocks=3, held_elsewhere=1)  # no block to spare
    assert out.chunks[0].num_lookahead == 0 and not out.preempted and len(seq.block_table) == 2
