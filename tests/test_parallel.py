"""Tensor parallelism (minillm.distributed.tensor): sharding, communication counts, and two gloo
processes on the CPU giving the single-process model's logits and greedy tokens."""

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
from minillm.distributed.tensor import (
    ShardedGPT, allreduce_volume, check_tensor_parallel_size, shard_config, shard_state_dict, weights_per_rank,
)
from minillm.distributed.tensor_measure import check_equivalence, measure_decode_step

TINY = get_preset("tiny")  # d_model 64, 4 heads, 2 layers
# Sums in a different order (per rank, then across ranks) move float32 logits of size ~10 by
# a few 1e-6; a wrong shard moves them by whole units.
LOGIT_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model() -> GPT:
    """Random weights, but large enough that greedy decoding does not repeat one token."""
    torch.manual_seed(0)
    gpt = GPT(TINY).eval()
    with torch.no_grad():
        for p in gpt.parameters():
            p.normal_(0.0, 0.3)
    return gpt


PROMPTS = [[464, 3290, 373, 257, 1310, 286], list(range(100, 140)), [50256]]


def test_allreduce_volume_matches_a_hand_count():
    cpu = get_preset("cpu")  # d_model 192, 4 layers
    two = allreduce_volume(cpu, 2, torch.float32)
    # one all-reduce: 192 floats = 768 bytes; a ring sends 2(N-1)/N of it = 768; two per layer
    assert (two.message_bytes, two.sent_per_rank_per_layer, two.sent_per_rank, two.sent_all_ranks) == (768, 1536, 6144, 12288)
    four = allreduce_volume(cpu, 4, torch.bfloat16)
    # 384 bytes; 2 * 3/4 * 384 = 576 per all-reduce; 1152 per layer; 4608 per model; x4 ranks
    assert (four.message_bytes, four.sent_per_rank_per_layer, four.sent_per_rank, four.sent_all_ranks) == (384, 1152, 4608, 18432)
    assert allreduce_volume(cpu, 1).sent_all_ranks == 0


def test_weights_per_rank_match_a_hand_count_for_the_cpu_preset():
    cpu = get_preset("cpu")  # vocab 50257, context 256, d 192, 4 layers; fp32
    d, v, ctx, L = 192, 50257, 256, 4
    table, positions, ln_f = v * d, ctx * d, 2 * d
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    whole = table + positions + L * block + ln_f
    assert whole == 11_478_336
    for n in (2, 4):
        # split: qkv, attn.proj's weight, fc, mlp.proj's weight; replicated: LayerNorms, row biases
        block_rank = 2 * 2 * d + (3 * d * d + 3 * d) // n + d * d // n + d + (4 * d * d + 4 * d) // n + 4 * d * d // n + d
        rank = table + positions + L * block_rank + ln_f
        w = weights_per_rank(cpu, n)
        assert (w.whole_bytes, w.rank_bytes) == (4 * whole, 4 * rank)
        assert (w.whole_read_bytes, w.rank_read_bytes) == (4 * (whole - positions), 4 * (rank - positions))
        assert w.embedding_bytes == 4 * table
        assert w.replicated_bytes == 4 * (table + positions + L * (4 * d + 2 * d) + ln_f)
    two, four = weights_per_rank(cpu, 2), weights_per_rank(cpu, 4)
    assert 0.92 < two.read_share < 0.93 and 0.88 < four.read_share < 0.89  # far from 1/2 and 1/4
    assert abs(two.read_share_vocab_parallel - 0.5) < 0.001  # the head split too: nearly 1/N
    assert weights_per_rank(cpu, 1).read_share == 1.0
    # a large shape, counted on the meta device: the head is a small share, so 1/N nearly holds
    big = weights_per_rank(ModelConfig(d_model=8192, n_layers=80, n_heads=64), 8, torch.bfloat16)
    assert big.whole_bytes > 1e11 and 0.125 < big.read_share < 0.132


def test_weights_per_rank_count_what_a_real_shard_holds(model):
    for n in (2, 4):
        shard = ShardedGPT(TINY, 1, n)  # no group: built, never run
        held = sum(p.numel() * p.element_size() for p in shard.parameters())
        assert weights_per_rank(TINY, n, state=model.state_dict()).rank_bytes == held


def test_measure_decode_step_reports_medians_with_their_quartiles(model):
    rows = measure_decode_step(model, world_size=2, batches=(1, 4), context=8, steps=6, threads=1)
    assert [r["batch"] for r in rows] == [1, 4]
    for r in rows:
        assert 0 < r["single_q1_ms"] <= r["single_ms"] <= r["single_q3_ms"]
        assert 0 < r["tp_q1_ms"] <= r["tp_ms"] <= r["tp_q3_ms"]
        assert r["allreduces_per_step"] == 2 * TINY.n_layers and 0 <= r["allreduce_share"] <= 1


def test_shards_have_the_right_shapes_and_tile_the_full_weights(model):
    state = model.state_dict()
    shards = [shard_state_dict(state, TINY, r, 2) for r in range(2)]
    d, hd = TINY.d_model, TINY.head_dim
    assert shards[0]["blocks.0.attn.qkv.weight"].shape == (3 * d // 2, d)
    assert shards[0]["blocks.0.attn.proj.weight"].shape == (d, d // 2)
    assert shards[0]["blocks.0.mlp.fc.weight"].shape == (4 * d // 2, d)
    assert shards[0]["blocks.0.mlp.proj.weight"].shape == (d, 4 * d // 2)
    assert torch.equal(shards[1]["tok_emb.weight"], state["tok_emb.weight"])  # replicated
    # rank 0 holds heads 0-1, rank 1 heads 2-3, of each of q, k and v
    qkv = torch.cat([s["blocks.1.attn.qkv.weight"].view(3, 2, hd, d) for s in shards], dim=1)
    assert torch.equal(qkv.reshape(3 * d, d), state["blocks.1.attn.qkv.weight"])
    proj = torch.cat([s["blocks.1.mlp.proj.weight"] for s in shards], dim=1)
    assert torch.equal(proj, state["blocks.1.mlp.proj.weight"])
    # each rank's KV cache holds only its heads: half the bytes per token
    assert shard_config(TINY, 2).n_heads == 2 and shard_config(TINY, 2).head_dim == hd
    assert ShardedGPT(TINY, 1, 2).cfg == shard_config(TINY, 2)


def test_a_size_that_does_not_divide_the_heads_is_refused(model):
    for bad in (3, 8, 0):
        with pytest.raises(ValueError, match="--tensor-parallel-size"):
            check_tensor_parallel_size(TINY, bad)
    with pytest.raises(ValueError, match=r"4 attention heads; choose one of \[1, 2, 4\]"):
        check_tensor_parallel_size(TINY, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="--tensor-parallel-size"):
        LLM(model, tensor_parallel_size=3)  # refused before any process starts
    from server.config import parse_args

    assert parse_args(["--tensor-parallel-size", "2"]).engine_config().tensor_parallel_size == 2
    with pytest.raises(UsageError, match="tensor_parallel_size"):
        parse_args(["--tensor-parallel-size", "0"])


def test_the_server_reports_a_bad_size_as_a_usage_error(model, tmp_path):
    from minillm.model.checkpoint import save_checkpoint
    from server.__main__ import main

    path = save_checkpoint(tmp_path / "ckpt.pt", {"model": model.state_dict(), "model_config": TINY.to_dict()})
    with pytest.raises(UsageError, match=r"--tensor-parallel-size\) 3 must divide the model's 4 attention heads"):
        main(["--checkpoint", str(path), "--device", "cpu", "--tensor-parallel-size", "3"])


def test_two_processes_give_the_same_logits_and_greedy_tokens(model):
    result = check_equivalence(model, PROMPTS, world_size=2, max_new_tokens=12)
    assert result.max_abs_logit_diff < LOGIT_TOLERANCE
    assert result.tokens_identical, result
    assert len({t for seq in result.reference_tokens for t in seq}) > 3  # not one token repeated


def test_the_engine_with_two_ranks_generates_what_one_process_does(model):
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    single = LLM(model, num_blocks=32, max_num_batched_tokens=24).generate(PROMPTS, params, use_tqdm=False)
    with LLM(model, tensor_parallel_size=2, num_blocks=32, max_num_batched_tokens=24) as llm:
        tp = llm.engine.model
        assert llm.engine.pool.k.shape[3] == TINY.n_heads // 2  # rank 0's KV cache: its heads only
        split = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.token_ids for o in split] == [o.token_ids for o in single]

        # an impossible position is refused on every rank alike, and the ranks stay in step
        with pytest.raises(ValueError, match="beyond the model's context"):
            tp(torch.zeros(1, 1, dtype=torch.long), torch.tensor([[TINY.context_length]]))
        tp.local.allreduce.reset()
        x = torch.tensor([PROMPTS[0]])
        forwards, nbytes = tp.workers.sent["forward"]
        with torch.inference_mode():
            assert (tp(x) - model(x)).abs().max() < LOGIT_TOLERANCE
        # one more forward told to the worker: its token ids among the bytes, in a message of a few hundred
        assert tp.workers.sent["forward"][0] == forwards + 1
        assert 8 * x.numel() < tp.workers.sent["forward"][1] - nbytes < 1000
        volume = allreduce_volume(TINY, 2)  # the counted all-reduces carry what the formula says
        assert tp.local.allreduce.calls == volume.allreduces_per_layer * TINY.n_layers
        assert tp.local.allreduce.bytes == tp.local.allreduce.calls * x.shape[1] * volume.message_bytes
        workers = [w.process for w in tp.workers.spawned]
    assert all(w.poll() is not None for w in workers)  # closing the LLM stopped them


def test_speculation_with_two_ranks_generates_what_one_process_does(model):
    """Speculation wraps the runner and tensor parallelism the model, so the two combine, for
    ``LLM`` and the server alike: the drafts are verified by the split target on every rank
    like any other forward, and greedy tokens stay one process's."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = [[1, 2, 3, 1, 2, 3, 1, 2]]  # repeats, so prompt lookup has drafts to offer
    single = LLM(model, num_blocks=32).generate(prompt, params, use_tqdm=False)
    with LLM(model, tensor_parallel_size=2, num_blocks=32, speculative_draft="ngram", num_speculative_tokens=3,
             speculative_disable_by_batch_size=1) as llm:
        split = llm.generate(prompt, params, use_tqdm=False)
        assert llm.engine.speculator.stats.accepted > 0
    assert split[0].token_ids == single[0].token_ids
    from server.config import parse_args

    config = parse_args(["--tensor-parallel-size", "2", "--speculative-draft", "ngram"], environ={})
    assert (config.engine_config().tensor_parallel_size, config.speculative_draft) == (2, "ngram")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"  # exited, not yet reaped
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc")
def test_workers_exit_when_rank_0_dies():
    code = (
        "import os, signal\n"
        "from minillm.model.config import get_preset\n"
        "from minillm.model.gpt import GPT\n"
        "from minillm.distributed.tensor_workers import TensorParallelGPT\n"
        "tp = TensorParallelGPT(GPT(get_preset('tiny')), 2)\n"
        "print(tp.workers.spawned[0].process.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == -9, result.stderr[-2000:]
    pid = int(result.stdout.split()[0])
    deadline = time.monotonic() + 20
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid), f"worker {pid} outlived rank 0"
