"""Pipeline parallelism (minillm.distributed.pipeline, minillm.distributed.pipeline_workers): the split, the stages
chained in one process, and two gloo processes giving the single-process engine's greedy
tokens with micro-batches in flight, preemption and an abort."""

import itertools
import os
import subprocess
import sys
import time

import pytest
import torch

from minillm.cli import UsageError
from minillm.model.config import ModelConfig, get_preset
from minillm.engine import LLM, EngineConfig, SamplingParams
from minillm.model.gpt import GPT
from minillm.distributed.pipeline import (
    PipelineStage,
    check_pipeline_parallel_size,
    pipeline_volume,
    stage_layers,
    stage_state_dict,
    stage_weights,
)
from minillm.distributed.pipeline_workers import PipelineParallelGPT

TINY = get_preset("tiny")  # d_model 64, 2 layers
PROMPTS = [[464, 3290, 373, 257, 1310, 286], list(range(100, 140)), [50256], list(range(900, 917)), [7, 8, 9]]


@pytest.fixture(scope="module")
def model() -> GPT:
    """Random weights, large enough that greedy decoding does not repeat one token."""
    torch.manual_seed(0)
    gpt = GPT(TINY).eval()
    with torch.no_grad():
        for p in gpt.parameters():
            p.normal_(0.0, 0.6)
    return gpt


@pytest.mark.parametrize("layers,vocab,size", [(8, 50257, 2), (8, 50257, 4), (12, 2000, 3), (6, 100, 6), (5, 9000, 2)])
def test_the_split_makes_the_heaviest_stage_as_light_as_any_split_could(layers, vocab, size):
    cfg = ModelConfig(vocab_size=vocab, d_model=64, n_layers=layers, n_heads=4)
    split = stage_layers(cfg, size)
    assert [i for r in split for i in r] == list(range(layers)) and all(len(r) >= 1 for r in split)
    best = min(
        max(stage_weights(cfg, [range(a, b) for a, b in zip((0, *cuts), (*cuts, layers))]))
        for cuts in itertools.combinations(range(1, layers), size - 1)
    )
    assert max(stage_weights(cfg, split)) == best


def test_the_head_on_rank_0_gives_it_the_fewest_blocks():
    # the cpu preset's output matrix (50,257 x 192) outweighs its four blocks five times over
    assert stage_layers(get_preset("cpu"), 2) == [range(0, 1), range(1, 4)]
    # with a small vocabulary the split is even
    assert stage_layers(ModelConfig(vocab_size=64, d_model=64, n_layers=4, n_heads=4), 2) == [range(0, 2), range(2, 4)]


def test_the_volume_is_one_hidden_state_per_hop():
    cpu = get_preset("cpu")
    two = pipeline_volume(cpu, 2, torch.float32)
    assert (two.message_bytes, two.hops, two.sent_per_token) == (768, 2, 1536)
    assert pipeline_volume(cpu, 4, torch.bfloat16).sent_per_token == 4 * 384
    assert pipeline_volume(cpu, 1).sent_per_token == 0


def test_stages_chained_in_one_process_compute_the_model(model):
    layers = [range(0, 1), range(1, 2)]
    state = model.state_dict()
    stages = []
    for rank in range(2):
        stage = PipelineStage(TINY, layers[rank], rank, 2).eval()
        stage.load_state_dict(stage_state_dict(state, layers[rank], rank, 2))
        stages.append(stage)
    assert set(stage_state_dict(state, layers[1], 1, 2)) >= {"blocks.0.ln1.weight", "ln_f.weight"}
    assert "tok_emb.weight" not in stage_state_dict(state, layers[1], 1, 2)
    x = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        hidden = stages[1].run(stages[0].run(x, None, None), None, None)
        assert torch.equal(stages[0].logits(hidden), model(x))


def test_a_bad_size_names_the_flag(model):
    for bad in (0, 3, 2.0):
        with pytest.raises(ValueError, match="--pipeline-parallel-size"):
            check_pipeline_parallel_size(TINY, bad)
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        EngineConfig(pipeline_parallel_size=0)
    for clash in ({"tensor_parallel_size": 2}, {"attention": "triton"}, {"memory_budget": "2GiB"}):
        with pytest.raises(ValueError, match="does not combine with"):
            EngineConfig(pipeline_parallel_size=2, **clash)
    with pytest.raises(ValueError, match="--pipeline-parallel-size"):
        LLM(model, pipeline_parallel_size=3)  # 2 layers: refused before any process starts
    with pytest.raises(ValueError, match="quantize does not combine"):
        LLM(model, pipeline_parallel_size=2, quantize="int8")
    from server.config import parse_args

    assert parse_args(["--pipeline-parallel-size", "2"]).engine_config().pipeline_parallel_size == 2
    with pytest.raises(UsageError, match="pipeline_parallel_size"):
        parse_args(["--pipeline-parallel-size", "0"])


def test_the_server_reports_a_bad_size_as_a_usage_error(model, tmp_path):
    from minillm.model.checkpoint import save_checkpoint
    from server.__main__ import main

    path = save_checkpoint(tmp_path / "ckpt.pt", {"model": model.state_dict(), "model_config": TINY.to_dict()})
    with pytest.raises(UsageError, match=r"--pipeline-parallel-size: .*from 1 to the model's 2 layers"):
        main(["--checkpoint", str(path), "--device", "cpu", "--pipeline-parallel-size", "3"])


def _reference(model, params):
    return [o.token_ids for o in LLM(model, num_blocks=64).generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_two_stages_generate_what_one_process_does_even_when_preempting(model, micro_batches):
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    reference = _reference(model, params)
    assert len({t for seq in reference for t in seq}) > 5  # not one token repeated
    # 9 blocks of 16 tokens cannot hold the five requests at once: someone is preempted
    with LLM(model, pipeline_parallel_size=2, pipeline_micro_batches=micro_batches, num_blocks=9,
             max_num_batched_tokens=24) as llm:
        pp = llm.engine.model
        assert llm.engine.pool.k.shape[0] == 1  # rank 0's KV pool holds its one layer only
        out = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.token_ids for o in out] == reference
        assert llm.engine.stats().preemptions > 0
        stats = pp.stage_stats()
        assert stats[0].forwards == stats[1].forwards == llm.engine.stats().steps
        # every hop carried one d_model-wide float32 row per token, as the formula says
        pp.reset_stats()
        x = torch.tensor([PROMPTS[1]])
        with torch.inference_mode():
            assert torch.equal(pp(x), model(x))
        sent = sum(s.bytes_sent for s in pp.stage_stats())
        assert sent == x.shape[1] * pipeline_volume(TINY, 2).sent_per_token
        workers = [w.process for w in pp.workers.spawned]
    assert all(w.poll() is not None for w in workers)  # closing the LLM stopped them


def test_micro_batches_are_in_flight_at_once_and_an_abort_loses_nothing(model):
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    reference = _reference(model, params)
    with LLM(model, pipeline_parallel_size=2, num_blocks=64) as llm:
        engine = llm.engine
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, params)
        tokens = {str(i): [] for i in range(len(PROMPTS))}
        for out in engine.step():  # launches two micro-batches, finishes the first
            tokens[out.request_id] += out.new_token_ids
        assert len(engine._in_flight) == 1
        in_flight = {c.seq.request_id for c in engine._in_flight[0].output.chunks}
        assert in_flight and len(in_flight) < len(PROMPTS)
        victim = sorted(in_flight)[0]
        assert engine.abort(victim)
        while engine.has_unfinished:
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
        assert victim not in {o.request_id for o in engine.step()}
        for i, expected in enumerate(reference):
            if str(i) != victim:
                assert tokens[str(i)] == expected


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"  # exited, not yet reaped
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc")
def test_a_stage_exits_when_rank_0_dies_mid_forward():
    code = (
        "import os, signal, torch\n"
        "from minillm.model.config import get_preset\n"
        "from minillm.model.gpt import GPT\n"
        "from minillm.distributed.pipeline_workers import PipelineParallelGPT\n"
        "pp = PipelineParallelGPT(GPT(get_preset('tiny')), 2)\n"
        "print(pp.workers.spawned[0].process.pid, flush=True)\n"
        "with torch.inference_mode():\n"
        "    pp.launch(torch.zeros(1, 4, dtype=torch.long))  # stage 1 will find no one to send to\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == -9, result.stderr[-2000:]
    pid = int(result.stdout.split()[0])
    deadline = time.monotonic() + 30
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid), f"stage {pid} outlived rank 0"


def test_pipelined_forwards_are_waited_for_in_order(model):
    # every stage on this process's thread count: a matmul split over another number of threads
    # may sum in another order, and the comparison below is bit for bit
    with PipelineParallelGPT(model, 2, threads=torch.get_num_threads()) as pp, torch.inference_mode():
        first = pp.launch(torch.tensor([PROMPTS[0]]))
        second = pp.launch(torch.tensor([PROMPTS[1]]))
        with pytest.raises(RuntimeError, match="in the order"):
            second.wait()
        assert torch.equal(first.wait(), model.hidden_states(torch.tensor([PROMPTS[0]])))
        assert torch.equal(second.wait(), model.hidden_states(torch.tensor([PROMPTS[1]])))


def test_the_bubble_measurement_reports_each_stage(model):
    from minillm.distributed.pipeline_measure import measure_bubble, predict_utilisation

    rows = measure_bubble(model, stages=2, micro_batches=(1, 2), micro_batch_size=2, prompt_len=4, rounds=2, repeats=1)
    assert [(r["setup"], r["batch"]) for r in rows] == [
        ("1 process, 2 threads", 2), ("2 stages, 1 in flight", 2), ("1 process, 2 threads", 4), ("2 stages, 2 in flight", 4)]
    for r in rows:
        # every request advanced one token per round: tokens/s is batch / round time
        assert r["tokens_per_s"] == pytest.approx(r["batch"] / (r["round_ms"] / 1e3), rel=1e-6)
    for r in rows[1::2]:
        assert 0 < r["utilisation_1"] <= 1 and 0 < r["rank0_not_waiting"] <= 1
        assert r["busy_ms_1"] <= r["round_ms"]
    assert predict_utilisation(10.0, 0.0, 8, 1) == pytest.approx(1 / 8)
    assert predict_utilisation(10.0, 0.0, 8, 16) == 1.0
    assert predict_utilisation(10.0, 10.0, 2, 2) == pytest.approx(0.5)


def test_the_chapters_equivalence_check_counts_what_it_sends(model):
    from minillm.distributed.pipeline_measure import check_pipeline_equivalence

    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[4]]  # 1 + 2 + 1 blocks admitted, then they grow: preemption
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # every process on one thread, as the reference: see the comparison below
    try:
        eq = check_pipeline_equivalence(model, prompts, stages=2, max_new_tokens=16, num_blocks=4)
    finally:
        torch.set_num_threads(threads)
    assert eq.tokens_identical and all(n > 0 for n in eq.preemptions.values())
    # the same blocks in the same order on the same thread count: bit for bit (on another thread
    # count a matmul may split its sums differently, and the logits differ in the last bits)
    assert eq.max_abs_logit_diff == 0.0
    assert eq.bytes_per_token == pipeline_volume(TINY, 2).sent_per_token
