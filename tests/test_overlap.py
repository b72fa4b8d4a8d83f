"""Overlap scheduling against the serial engine: the same tokens, texts and finish reasons,
whatever stops a request, and nothing freed while a step that may write it still computes."""

from __future__ import annotations

import pytest
import torch

from minillm.engine import LLM, SamplingParams
from minillm.engine.config import EngineConfig, EngineOptionError
from minillm.model.gpt import GPT
from minillm.speedups import decode_graphs
from minillm.speedups.decode_graphs import DecodeGraphs
from tests.test_decode_graphs import _fake_capture
from tests.test_engine import model  # noqa: F401  (the fixture: peaky logits, no near-ties)

SHARED = list(range(300, 318))  # a prefix two blocks of 8 long: later prompts hit the prefix cache
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def workload(stop_token: int = 0, stop_text: str = "\x00") -> tuple[list[list[int]], list[SamplingParams]]:
    """Every way a request can ask to be served: greedy, seeded with and without filters, two
    choices of one prompt (``n = 2``), penalties, logprobs of both kinds, a schema, one token,
    and requests that end on a stop token or a stop string before their length."""
    g = torch.Generator().manual_seed(3)
    prompts = [SHARED + torch.randint(50_000, (int(k),), generator=g).tolist()
               for k in torch.randint(1, 12, (12,), generator=g)]
    greedy = dict(temperature=0, ignore_eos=True)
    params = [
        SamplingParams(max_tokens=20, **greedy),
        SamplingParams(max_tokens=14, temperature=0.9, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=17, temperature=0.8, top_p=0.9, top_k=40, seed=2, ignore_eos=True),
        SamplingParams(max_tokens=17, temperature=0.8, top_p=0.9, top_k=40, seed=3, ignore_eos=True),  # n = 2
        SamplingParams(max_tokens=12, temperature=0.7, frequency_penalty=1.5, presence_penalty=0.5, seed=4,
                       ignore_eos=True),
        SamplingParams(max_tokens=9, logprobs=2, prompt_logprobs=1, **greedy),
        SamplingParams(max_tokens=16, temperature=0.8, seed=6, json_schema=SCHEMA),
        SamplingParams(max_tokens=1, **greedy),
        SamplingParams(max_tokens=25, stop_token_ids=[stop_token], **greedy),
        SamplingParams(max_tokens=25, stop=[stop_text], **greedy),
        SamplingParams(max_tokens=11, repetition_penalty=1.3, min_tokens=4, **greedy),
        SamplingParams(max_tokens=30, **greedy),
    ]
    prompts[3] = prompts[2]
    prompts[8] = prompts[9] = prompts[0]  # greedy like the first, until they stop
    return prompts, params


def served(llm: LLM, prompts, params) -> list[tuple]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats().kv_blocks_used == 0 and not llm.engine.has_unfinished  # every block came back
    return [(o.token_ids, o.text, o.finish_reason, o.logprobs, o.prompt_logprobs) for o in outs]


def assert_same(served: list[tuple], reference: list[tuple]) -> None:
    """Tokens, texts and finish reasons identical; logprobs to 1e-4. A step's batch differs
    between the engines (an overlapped one carries a finished request one step longer), and
    a matrix product's last bits with it."""
    assert [r[:3] for r in served] == [r[:3] for r in reference]
    for ours, theirs in zip(served, reference):
        for kind in (3, 4):
            if theirs[kind] is None:
                assert ours[kind] is None
                continue
            assert [(lp.token_id, [t for t, _ in lp.top]) for lp in ours[kind]] == \
                [(lp.token_id, [t for t, _ in lp.top]) for lp in theirs[kind]]
            flat = lambda lps: [v for lp in lps for v in (lp.logprob, *(x for _, x in lp.top))]  # noqa: E731
            assert flat(ours[kind]) == pytest.approx(flat(theirs[kind]), abs=1e-4)


def serial_and_overlapped(model: GPT, prompts, params, **options) -> tuple[list[tuple], list[tuple], LLM]:
    serial = LLM(model, async_scheduling=False, **options)
    overlapped = LLM(model, async_scheduling=True, **options)
    assert not serial.engine.overlap and overlapped.engine.overlap
    # the first request alone, then the rest, which find the shared prefix in the cache
    outputs = [served(llm, prompts[:1], params[:1]) + served(llm, prompts[1:], params[1:]) for llm in (serial, overlapped)]
    return *outputs, overlapped


@pytest.fixture(scope="module")
def stops(model: GPT) -> tuple[int, str]:
    """A token and a piece of text the greedy request meets half-way, so the requests that
    stop on them stop early, and one step before an overlapped engine sees it."""
    prompts, params = workload()
    (tokens, text, *_), = served(LLM(model, async_scheduling=False), prompts[:1], params[:1])
    first_new = next(i for i in range(6, len(tokens)) if tokens[i] not in tokens[:i])
    stop_text = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop_text
    return tokens[first_new], stop_text


OPTIONS = {
    "roomy": dict(block_size=8),
    "preempting": dict(block_size=8, num_blocks=14, max_num_seqs=6),
    "chunked": dict(block_size=8, max_num_batched_tokens=24, max_num_seqs=5),
}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_overlapped_serves_what_serial_serves(model: GPT, stops, options) -> None:
    prompts, params = workload(*stops)
    serial, overlapped, llm = serial_and_overlapped(model, prompts, params, **options)
    assert_same(overlapped, serial)
    reasons = [r[2] for r in serial]
    assert reasons[8] == reasons[9] == "stop" and len(serial[8][0]) < 25 and len(serial[9][0]) < 25
    if "num_blocks" in options:
        assert llm.engine.stats().preemptions > 0
    assert llm.engine.allocator.prefix_hit_rate > 0


def test_a_seeded_request_draws_the_same_tokens_whether_or_not_it_is_preempted(model: GPT) -> None:
    """A token's draw is keyed by the request's seed and the token's position, so a request
    preempted and recomputed (a longer prompt that samples at the same position) draws what it
    would have drawn had it kept its blocks: serial or overlapped, roomy pool or tight. The
    requests keep their top 20 or 40 tokens: a batch of another size rounds the logits' last
    bits differently, which a draw over 50,000 near-equal tokens can feel (steps of 1e-5 in
    the CDF), and one over a few dozen cannot."""
    prompts = [list(range(1000 + 37 * i, 1030 + 37 * i)) for i in range(6)]
    params = [SamplingParams(max_tokens=40, temperature=1.0, top_k=20 if i % 2 else 40, top_p=0.95 if i % 3 else 1.0,
                             seed=10 + i, ignore_eos=True) for i in range(6)]
    runs = {}
    for overlap in (False, True):
        for pool, options in (("roomy", dict(block_size=8)), ("tight", dict(block_size=8, num_blocks=16, max_num_seqs=6))):
            engine = LLM(model, async_scheduling=overlap, **options).engine
            seqs = [engine.add_request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
            while engine.has_unfinished:
                engine.step()
            runs[overlap, pool] = [s.output_ids for s in seqs], [s.num_preemptions for s in seqs]
    tokens = runs[False, "roomy"][0]
    assert all(outputs == tokens for outputs, _ in runs.values())
    assert all(len(t) == 40 and len(set(t)) > 10 for t in tokens)  # sampled, not stuck on a few tokens
    for overlap in (False, True):
        assert sum(runs[overlap, "roomy"][1]) == 0
        assert sum(n > 0 for n in runs[overlap, "tight"][1]) >= 2  # several seeded requests were preempted


def test_captured_steps_fill_pending_tokens_on_the_device(model: GPT, stops, monkeypatch) -> None:
    """The captured step (a CUDA graph's contract, recorded and replayed on the CPU) reads its
    pending tokens from the previous step's sampled ones, copied into its static buffer."""
    replays: list[int] = []
    monkeypatch.setattr(decode_graphs, "capture_cuda_graph", _fake_capture(replays))
    prompts, params = workload(*stops)
    engines = []
    for overlap in (False, True):
        llm = LLM(model, block_size=8, num_blocks=14, max_num_seqs=6, async_scheduling=overlap)
        llm.engine.graphs = llm.engine.runner.graphs = DecodeGraphs(model, llm.engine.pool, 8, mode="cuda-graph")
        engines.append(served(llm, prompts, params))
    assert_same(engines[1], engines[0])
    assert len(replays) > 20


def test_a_step_queued_on_the_device_reads_back_behind_the_next(model: GPT, stops) -> None:
    """A GPU's overlap queues step N+1 before reading N's tokens, from one thread: the same
    code path, run on the CPU (where "queued" computes at once), serves what serial serves."""
    prompts, params = workload(*stops)
    reference = served(LLM(model, block_size=8, num_blocks=14, max_num_seqs=6, async_scheduling=False), prompts, params)
    llm = LLM(model, block_size=8, num_blocks=14, max_num_seqs=6, async_scheduling=True)
    llm.engine.runner.queues_on_device = True
    assert_same(served(llm, prompts, params), reference)
    assert llm.engine.runner._device_thread is None  # no thread was needed


def test_the_next_step_starts_before_the_last_ones_tokens_are_appended(model: GPT) -> None:
    """The point of it all: step N+1 is submitted while step N's tokens are still unread."""
    llm = LLM(model, block_size=8, async_scheduling=True)
    engine, events = llm.engine, []
    submit, finish = engine.runner.submit, engine._finish_step
    engine.runner.submit = lambda step: events.append(("submit", engine.scheduler.num_waiting)) or submit(step)
    engine._finish_step = lambda output, produced: events.append(("append", None)) or finish(output, produced)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    kinds = [kind for kind, _ in events]
    # prefill and 5 decodes submitted; each step's tokens appended after the next was submitted
    assert kinds == ["submit", "submit", "append", "submit", "append", "submit", "append", "submit", "append",
                     "submit", "append", "append"]


def test_a_request_that_ends_is_seen_one_step_late_and_shows_nothing_more(model: GPT, stops) -> None:
    """A request stopped by a token is already in the next step: that step computes a token for
    it, which is dropped, and its blocks come back only after that step."""
    llm = LLM(model, block_size=8, async_scheduling=True)
    engine = llm.engine
    stop_token, _ = stops
    prompts, _ = workload()
    seq = engine.add_request("stops", prompts[0], SamplingParams(max_tokens=25, temperature=0, stop_token_ids=[stop_token]))
    outputs = []
    while not seq.is_finished:
        outputs += engine.step()
    assert [t for o in outputs for t in o.new_token_ids][-1] == stop_token and outputs[-1].finish_reason == "stop"
    assert seq.output_ids[-1] == stop_token and seq.block_table  # the next step, in flight, may still write them
    assert engine.step() == [] and not seq.block_table and not engine.has_unfinished
    assert engine.stats().kv_blocks_used == 0


def test_an_abort_while_a_step_computes_keeps_its_blocks_until_that_step_is_done(model: GPT) -> None:
    llm = LLM(model, block_size=8, async_scheduling=True)
    engine = llm.engine
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    reference = served(LLM(model, async_scheduling=False, block_size=8), [[9, 8, 7, 6]], [params])[0][0]
    gone = engine.add_request("gone", [1, 2, 3, 4, 5], params)
    stays = engine.add_request("stays", [9, 8, 7, 6], params)
    for _ in range(4):
        engine.step()
    assert engine.abort("gone") and gone.finish_reason.value == "abort"
    assert gone.block_table and gone.num_steps_in_flight == 1  # its step is still computing
    engine.step()
    assert not gone.block_table
    while engine.has_unfinished:
        engine.step()
    assert stays.output_ids == reference and engine.stats().kv_blocks_used == 0


def test_a_failing_computation_ends_both_steps_and_undoes_them(model: GPT, monkeypatch) -> None:
    """If step N's forward raises, step N+1 (started on N's tokens) is waited for and undone
    too; both batches are ``last_step``, the requests a server ends, and nothing leaks."""
    llm = LLM(model, block_size=8, async_scheduling=True)
    engine = llm.engine
    seqs = [engine.add_request(f"r{i}", [i + 1, 2, 3], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
            for i in range(3)]
    compute, calls = engine.runner.compute, []

    def failing(step):  # the third step computed: the device thread runs them in order
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return compute(step)

    monkeypatch.setattr(engine.runner, "compute", failing)
    engine.step(), engine.step()
    before = [(s.num_computed_tokens, len(s.token_ids)) for s in seqs]  # one step in flight
    engine.step()  # submits the failing step; appends the one before, which was fine
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    assert {c.seq for c in engine.last_step.chunks} == set(seqs) and len(engine.last_step.chunks) == 6
    # as if the failing step had never been scheduled: the good one's token appended, nothing pending
    assert [(s.num_computed_tokens, s.num_pending, len(s.token_ids)) for s in seqs] == [(n, 0, k + 1) for n, k in before]
    for s in seqs:
        assert engine.abort(s.request_id)
    assert not engine.has_unfinished and engine.stats().kv_blocks_used == 0


def test_overlap_is_the_default_on_a_gpu_only(model: GPT) -> None:
    """On a CPU the forward already keeps every core busy: the serial engine is the default."""
    assert not LLM(model, block_size=8).engine.overlap
    assert not LLM(model, block_size=8, async_scheduling=None).engine.overlap


def test_the_option_is_refused_where_it_cannot_run() -> None:
    with pytest.raises(EngineOptionError, match="pipeline_parallel_size") as err:
        EngineConfig(async_scheduling=True, pipeline_parallel_size=2)
    assert err.value.option == "async_scheduling"


def test_the_server_streams_what_the_serial_engine_serves(model: GPT) -> None:
    """Through the HTTP server: a streamed request cut by a stop string and two seeded choices
    of one prompt, from an overlapped engine, are the serial engine's text."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from minillm.data.tokenizer import get_tokenizer
    from minillm.engine import LLMEngine
    from server.app import create_app
    from server.config import ServerConfig
    from tests.test_server import sse_events

    async def answers(overlap: bool) -> tuple:
        engine = LLMEngine(model, EngineConfig(num_blocks=64, block_size=8, async_scheduling=overlap), get_tokenizer())
        async with TestClient(TestServer(create_app(engine, ServerConfig()))) as client:
            body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            whole = (await (await client.post("/v1/completions", json=body)).json())["choices"][0]["text"]
            stop = whole[len(whole) // 2:][:3]
            events = await sse_events(await client.post("/v1/completions", json=body | {"stop": [stop], "stream": True}))
            streamed = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
            seeded = await (await client.post("/v1/completions", json={"prompt": "The dog", "n": 2, "max_tokens": 12,
                                                                         "seed": 7, "temperature": 0.9})).json()
            return whole, streamed, [c["text"] for c in seeded["choices"]]

    serial, overlapped = asyncio.run(answers(False)), asyncio.run(answers(True))
    assert overlapped == serial and serial[1] == serial[0][: serial[0].index(serial[0][len(serial[0]) // 2:][:3])]


def test_the_device_thread_runs_with_the_engines_torch_threads(model: GPT) -> None:
    """A new thread starts with torch's default thread count; a compiled step traced under
    another count would fail its guards and recompile at every call on the device thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(model, block_size=8, async_scheduling=True)
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
        assert llm.engine.runner._device_thread.submit(torch.get_num_threads).result() == 1
        llm.close()
        assert llm.engine.runner._device_thread is None
    finally:
        torch.set_num_threads(before)
