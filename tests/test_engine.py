"""The paged engine against the simple loops: same greedy tokens, whatever the scheduling."""

import pytest
import torch

from minillm.model.config import ModelConfig
from minillm.engine import LLM, LLMEngine, SamplingParams
from minillm.engine.config import EngineConfig
from minillm.decoding.generate import generate_kv_cache, generate_naive, generate_static_batch
from minillm.model.gpt import GPT
from minillm.data.tokenizer import get_tokenizer


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    m = GPT(ModelConfig(context_length=96, d_model=64, n_layers=2, n_heads=4)).eval()
    with torch.no_grad():  # peaky logits: greedy decoding has no near-ties to break differently
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return m


def prompts(n: int = 7, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (n,), generator=g).tolist()
    return [torch.randint(50_000, (k,), generator=g).tolist() for k in lengths]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def engine_tokens(model: GPT, batch: list[list[int]], limits: list[int], **options) -> tuple[list[list[int]], LLM]:
    llm = LLM(model, **options)
    outs = llm.generate(batch, [greedy(n) for n in limits], use_tqdm=False)
    return [o.token_ids for o in outs], llm


LIMITS = [20, 5, 33, 1, 12, 27, 9]


@pytest.fixture(scope="module")
def reference(model: GPT) -> list[list[int]]:
    return [generate_naive(model, p, n) for p, n in zip(prompts(), LIMITS)]


def test_kv_cache_and_static_batch_match_naive(model: GPT, reference) -> None:
    assert [generate_kv_cache(model, p, n) for p, n in zip(prompts(), LIMITS)] == reference
    assert generate_static_batch(model, prompts(), LIMITS) == reference


def test_engine_matches_naive(model: GPT, reference) -> None:
    tokens, llm = engine_tokens(model, prompts(), LIMITS)
    assert tokens == reference
    assert llm.engine.stats().kv_blocks_used == 0  # every block came back


def test_engine_matches_naive_when_forced_to_preempt(model: GPT, reference) -> None:
    # 12 blocks of 4 tokens cannot hold seven sequences of up to 60 tokens at once.
    tokens, llm = engine_tokens(model, prompts(), LIMITS, num_blocks=12, block_size=4)
    assert tokens == reference
    assert llm.engine.stats().preemptions > 0
    assert llm.engine.stats().kv_blocks_used == 0


def test_engine_matches_naive_with_chunked_prefill(model: GPT, reference) -> None:
    tokens, llm = engine_tokens(model, prompts(), LIMITS, max_num_batched_tokens=8, max_num_seqs=3)
    assert tokens == reference


def test_prefix_cache_hits_give_the_same_tokens(model: GPT) -> None:
    shared = prompts(1, seed=5)[0] * 2  # a long common prefix
    batch = [shared + [7], shared + [8, 9], shared + [10, 11, 12]]
    reference = [generate_naive(model, p, 10) for p in batch]
    llm = LLM(model, block_size=8)
    first = llm.generate(batch[:1], greedy(10), use_tqdm=False)
    rest = llm.generate(batch[1:], greedy(10), use_tqdm=False)  # the prefix is cached by now
    assert [o.token_ids for o in first + rest] == reference
    assert llm.engine.stats().prefix_cache_hit_rate > 0


def test_bf16_engine_runs_and_mostly_agrees(model: GPT, reference) -> None:
    """bf16 rounds differently, so exact agreement is not promised; the first tokens agree."""
    import copy

    tokens, _ = engine_tokens(copy.deepcopy(model), prompts(), LIMITS, dtype="bfloat16")
    assert [len(t) for t in tokens] == LIMITS
    assert sum(t[0] == r[0] for t, r in zip(tokens, reference)) >= len(reference) - 1


def test_text_is_the_decoded_tokens(model: GPT) -> None:
    out = LLM(model).generate(["Once upon a time"], greedy(15), use_tqdm=False)[0]
    assert out.text == get_tokenizer().decode(out.token_ids)
    assert out.finish_reason == "length"
    assert out.prompt_token_ids == get_tokenizer().encode("Once upon a time")


def test_stop_string_ends_generation_and_is_not_returned(model: GPT) -> None:
    tok = get_tokenizer()
    free = LLM(model).generate(["The"], greedy(20), use_tqdm=False)[0]
    stop = tok.decode(free.token_ids[3:5])
    out = LLM(model).generate(["The"], SamplingParams(max_tokens=20, temperature=0, stop=[stop]), use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert stop not in out.text and free.text.startswith(out.text)
    assert out.text == free.text[: free.text.index(stop)]


def test_seeded_sampling_ignores_batch_neighbours(model: GPT) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=123, ignore_eos=True)
    alone = LLM(model).generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids
    crowd = LLM(model).generate(
        [[1, 2], [5, 6, 7], [9] * 30], [SamplingParams(max_tokens=20, temperature=1.0), params, greedy(3)],
        use_tqdm=False,
    )
    assert crowd[1].token_ids == alone


def test_abort_returns_blocks_and_stops_output(model: GPT) -> None:
    engine = LLMEngine(model, EngineConfig())
    engine.add_request("a", [1, 2, 3], greedy(50))
    engine.add_request("b", [4, 5], greedy(3))
    engine.step()
    assert engine.abort("a") and not engine.abort("nope")
    while engine.has_unfinished:
        assert all(out.request_id == "b" for out in engine.step())
    assert engine.stats().kv_blocks_used == 0


def test_requests_that_can_never_run_are_refused(model: GPT) -> None:
    engine = LLMEngine(model, EngineConfig(num_blocks=4, block_size=4))
    with pytest.raises(ValueError, match="max_model_len is 96"):
        engine.add_request("long", list(range(96)), greedy(1))
    with pytest.raises(ValueError, match="block"):
        engine.add_request("big", list(range(10)), greedy(30))  # needs 10 blocks, pool has 4
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("bad", [1, 60_000], greedy(1))
    engine.add_request("ok", [1, 2], greedy(3))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", [1, 2], greedy(3))
    assert engine.stats().waiting == 1  # the refusals left nothing behind; the good one waits


def test_a_failing_step_still_returns_finished_blocks(model: GPT) -> None:
    engine = LLMEngine(model, EngineConfig())
    engine.add_request("a", [1, 2, 3], greedy(1))  # finishes on its first token
    b = engine.add_request("b", [4, 5, 6], greedy(5))

    def broken(token: int) -> str:
        raise RuntimeError("detokenizer failure")

    b.detokenizer.add = broken
    with pytest.raises(RuntimeError, match="detokenizer failure"):
        engine.step()
    assert engine.abort("b")
    assert not engine.has_unfinished
    assert engine.stats().kv_blocks_used == 0


def test_decodes_split_into_length_sorted_groups_give_the_same_tokens(model: GPT, reference, monkeypatch) -> None:
    from minillm.engine import model_runner

    monkeypatch.setattr(model_runner, "DECODE_GROUP", 2)  # seven requests -> four attention groups
    tokens, _ = engine_tokens(model, prompts(), LIMITS)
    assert tokens == reference


def test_a_finished_request_leaves_nothing_behind(model: GPT) -> None:
    """The request's ``Sequence`` is its one record: once it is finished (or aborted) and the
    next step has replaced ``last_step``, nothing in the engine refers to it any more, so it
    and everything it owned (detokenizer, drafter) are garbage."""
    import gc
    import weakref

    from minillm.speedups.speculative.speculator import SpeculativeEngine, Speculator

    speculator = Speculator.with_draft_model(model, model, 3, disable_by_batch_size=2)
    engine = SpeculativeEngine(model, EngineConfig(num_blocks=32, block_size=8), speculator=speculator)
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=3, stop=["zz"], ignore_eos=True)
    done = engine.add_request("done", [5, 6, 7, 5, 6, 7, 5, 6], sampled)
    gone = engine.add_request("gone", [1, 2, 3], greedy(50))
    owned = [weakref.ref(x) for x in (done, gone, done.detokenizer)]
    while not done.is_finished:
        engine.step()
    assert done in speculator.draft_lengths and done in speculator.drafter.held  # state of its own, held weakly
    assert engine.abort("gone") and not engine.abort("gone")
    del done, gone
    engine.step()  # idle: replaces last_step, the plan of the step that ran them
    gc.collect()
    assert [r() for r in owned] == [None] * 3
    assert engine.unfinished_request_ids == [] and not engine.scheduler.running and not engine.scheduler.waiting
    assert sum(engine.allocator.ref_counts) == 0 and engine.stats().kv_blocks_used == 0


def test_the_last_output_carries_the_request_times(model: GPT) -> None:
    engine = LLMEngine(model, EngineConfig(num_blocks=32, block_size=8))
    engine.add_request("a", [1, 2, 3], greedy(3), arrival_time=0.0)
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step()
    assert [o.times is None for o in outputs] == [True, True, False]
    times = outputs[-1].times
    assert times.arrival == 0.0 < times.first_scheduled <= times.first_token <= times.finish
    assert len(times.token_times) == 3 and times.token_times[-1] == times.finish


def test_the_per_sequence_decode_loop_gives_the_same_tokens(model: GPT, reference) -> None:
    tokens, _ = engine_tokens(model, prompts(), LIMITS, attention="torch-loop")
    assert tokens == reference
