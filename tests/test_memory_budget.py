"""``memory_budget`` / ``--memory-budget``: one budget for the whole process, measured and split.

On a CPU the budget is the process's resident memory, torch included (minillm.engine.memory),
so the check is the plainest there is: a child process that serves a full batch to full
context never has more resident than its budget (``VmHWM``), and the pool it was given
is no smaller than its measurements allow.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minillm.model.checkpoint import save_checkpoint
from minillm.cli import UsageError
from minillm.model.config import ModelConfig, get_preset
from minillm.engine import LLM, SamplingParams
from minillm.engine.config import EngineOptionError
from minillm.engine.kv_cache import kv_bytes_per_token
from minillm.engine.config import EngineConfig
from minillm.engine.memory import (MemoryBudgetError, mib, plan, resident_bytes, weight_bytes,
                                   worst_steps)
from minillm.model.gpt import GPT
from minillm.speedups.packed import pack_weights
from minillm.distributed.tensor import shard_config
from server.config import parse_args

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
CPU = torch.device("cpu")

# The child: the tiny preset (real vocabulary, so the sampler's full sort costs what it does
# in a server), max_num_seqs=64 and the default 2048 batched tokens. Its first step prefills
# 2048 tokens of 64 prompts (56 to 63 tokens each), its decodes then run up to 56 rows, each
# sampling with top_k = the vocabulary, to the end of the 64-token context: the shapes the
# warm-up measures, at most. Its budget is what it holds once torch is imported (about 280 MiB
# here) and 320 MiB more: 13 for the weights, about 45 for the tokenizer, 80 for the
# activations, 64 for the allocator's slack, the rest for the KV cache.
CHILD = r"""
import dataclasses, json, re, torch
from minillm.model.config import get_preset
from minillm.engine import LLM, SamplingParams
from minillm.engine.memory import resident_bytes
from minillm.model.gpt import GPT
def high_water():  # VmHWM: this image's own peak (ru_maxrss would count the forking parent)
    return int(re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read())[1]) * 1024
torch.manual_seed(0)
budget = resident_bytes(torch.device("cpu")) + 320 * 2**20
model = GPT(get_preset("tiny")).eval()
before = high_water()  # the warm-up resets the mark, so keep what came before it
llm = LLM(model, memory_budget=budget, max_num_seqs=64)
ctx, vocab = model.cfg.context_length, model.cfg.vocab_size
prompts = [torch.randint(vocab, (56 + i % 8,)).tolist() for i in range(64)]
outs = llm.generate(prompts, SamplingParams(max_tokens=ctx, top_k=vocab, ignore_eos=True), use_tqdm=False)
print(json.dumps({"peak": max(before, high_water()),
                  "split": dataclasses.asdict(llm.engine.memory), "pool": llm.engine.pool.nbytes,
                  "lengths": sorted({len(o.prompt_token_ids) + len(o.token_ids) for o in outs}),
                  "preemptions": llm.engine.stats().preemptions}))
"""


def small_model() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(context_length=64, d_model=64, n_layers=2, n_heads=4)).eval()


def test_a_full_batch_to_full_context_stays_within_the_budget() -> None:
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.splitlines()[-1])
    split = out["split"]
    budget = split["budget"]
    assert out["lengths"] == [64] and out["preemptions"] == 0  # every sequence reached the full context
    assert out["pool"] == split["kv_cache"]
    assert split["activations"] > split["allocator"]  # so a split that ignored activations would overflow
    assert out["peak"] <= budget, f"peak {out['peak'] / MiB:.1f} MiB over a budget of {budget / MiB:.0f} MiB"
    # ...and the measurements are not padding: the peak comes within the allocator's slack of it
    assert out["peak"] >= budget - split["allocator"] - 16 * MiB, (out["peak"] / MiB, split)


def test_the_split_is_the_pool_the_engine_allocates() -> None:
    model = small_model()
    budget = resident_bytes(CPU) + 160 * MiB  # pytest and all, and room for the tokenizer, steps and cache
    llm = LLM(model, memory_budget=budget, max_num_seqs=4, max_num_batched_tokens=64, block_size=8)
    split, engine = llm.engine.memory, llm.engine
    block_bytes = 8 * kv_bytes_per_token(model.cfg, model.dtype)
    rest = split.runtime + split.weights + split.activations + split.allocator + split.graphs
    assert split.block_bytes == block_bytes and split.budget == budget
    assert split.blocks == (budget - rest) // block_bytes - 1  # one block more is the pool's pad block
    assert engine.allocator.num_blocks == split.blocks
    assert engine.pool.nbytes == split.kv_cache == (split.blocks + 1) * block_bytes
    assert 0 <= split.unused < 2 * block_bytes
    assert split.full_context_sequences == split.blocks // 8  # 64 tokens in blocks of 8
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert split.weights == weights  # unpacked: a budget keeps the weights as they are
    assert split.allocator == min(2 * split.activations, 64 * MiB) and split.graphs == 0
    assert 0 <= split.activations < 32 * MiB  # 0 when the heap already holds what a step takes
    assert split.runtime > 100 * MiB  # the interpreter and torch count: the budget is the process's
    assert "memory budget" in split.describe() and f"{split.blocks:,} blocks of 8 tokens" in split.describe()


def test_a_tensor_parallel_split_is_per_rank() -> None:
    """Rank 0 measures its own shard and pool: a block holds one rank's heads."""
    model = small_model()
    with LLM(model, tensor_parallel_size=2, memory_budget=resident_bytes(CPU) + 200 * MiB, max_num_seqs=4,
             max_num_batched_tokens=64) as llm:
        split, engine = llm.engine.memory, llm.engine
        assert split.block_bytes == 16 * kv_bytes_per_token(shard_config(model.cfg, 2), torch.float32)
        assert split.block_bytes * 2 == 16 * kv_bytes_per_token(model.cfg, torch.float32)
        assert split.weights == weight_bytes(engine.model.local) < weight_bytes(model)
        assert engine.pool.nbytes == split.kv_cache and engine.allocator.num_blocks == split.blocks
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        assert len(out[0].token_ids) == 4


def test_the_warm_up_measures_the_largest_prefill_too() -> None:
    """Nine sequences a step: the decode is nine rows, the prefill 4096 tokens (8 chunks of
    511, each attending over 512 keys, and one of 8), whose activations are tens of MiB."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(context_length=512, d_model=256, n_layers=2, n_heads=4)).eval()
    decode, prefill = worst_steps(model.cfg, 16, 9, 4096)
    assert [(c.start, c.num_tokens) for c in decode.chunks] == [(511, 1)] * 9
    assert [(c.start, c.num_tokens) for c in prefill.chunks] == [(1, 511)] * 8 + [(504, 8)]
    # Measured in a fresh process: in this one, whose heap holds what earlier tests freed, the
    # steps can run in memory already resident, and the resident peak would hardly move.
    child = (
        "import json, torch\n"
        "from minillm.model.config import ModelConfig\n"
        "from minillm.engine.memory import profile_peak\n"
        "from minillm.model.gpt import GPT\n"
        "torch.manual_seed(0)\n"
        "model = GPT(ModelConfig(context_length=512, d_model=256, n_layers=2, n_heads=4)).eval()\n"
        "print(json.dumps(profile_peak(model, block_size=16, max_num_seqs=9, max_num_batched_tokens=4096)))\n"
    )
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    step_peak, decode_peak = json.loads(result.stdout.splitlines()[-1])
    assert step_peak > decode_peak + 16 * MiB, (step_peak / MiB, decode_peak / MiB)  # 4096 x 1024 floats in the MLP


def test_plan_gives_the_cache_what_the_rest_leaves() -> None:
    split = plan(1000, runtime=100, weights=200, activations=50, allocator=30, graphs=20, block_bytes=64,
                 block_size=4, context_length=16)
    assert (split.blocks, split.kv_cache, split.unused) == (600 // 64 - 1, 9 * 64, 600 - 9 * 64)
    assert split.full_context_sequences == 2  # 8 blocks, 4 a sequence
    # exactly one sequence of full context (4 blocks) + the pad block fits; one byte less does not
    assert plan(400 + 5 * 64, runtime=100, weights=200, activations=50, allocator=30, graphs=20, block_bytes=64,
                block_size=4, context_length=16).blocks == 4
    with pytest.raises(MemoryBudgetError, match=r"is 0\.0 MiB short"):
        plan(400 + 5 * 64 - 1, runtime=100, weights=200, activations=50, allocator=30, graphs=20, block_bytes=64,
             block_size=4, context_length=16)


def test_too_small_a_budget_names_what_does_not_fit() -> None:
    model = small_model()
    with pytest.raises(EngineOptionError) as err:
        LLM(model, memory_budget="64MiB", max_num_seqs=2, max_num_batched_tokens=32)
    message = str(err.value)
    assert err.value.option == "memory_budget" and "\n" not in message
    assert re.match(r"memory budget 64\.0 MiB is [\d.]+ (MiB|GiB) short: it must hold runtime ", message), message
    assert f"weights {mib(weight_bytes(model))}, activations peak " in message
    assert "a KV cache for one sequence of full context (64 tokens: 4 blocks + the pad block" in message


def test_the_cli_refuses_too_small_a_budget_in_one_line(tmp_path: Path) -> None:
    m = small_model()
    ckpt = save_checkpoint(tmp_path / "ckpt.pt", {"model": m.state_dict(), "model_config": m.cfg.to_dict()})
    result = subprocess.run(
        [sys.executable, "-m", "server", "--checkpoint", str(ckpt), "--device", "cpu", "--memory-budget", "100MiB",
         "--max-num-seqs", "2", "--max-num-batched-tokens", "32"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, "MINILLM_HOME": str(tmp_path)},
    )
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("python -m server: error: --memory-budget: memory budget 100.0 MiB is ")


def test_memory_budget_and_kv_cache_memory_are_refused_together() -> None:
    with pytest.raises(UsageError, match="--memory-budget: .*kv_cache_memory and num_blocks size it alone: give one"):
        parse_args(["--memory-budget", "6GiB", "--kv-cache-memory", "1GiB"])
    with pytest.raises(ValueError, match="give one of them"):
        EngineConfig(memory_budget="6GiB", num_blocks=10)
    with pytest.raises(ValueError, match="pack_weights=True does not combine with memory_budget"):
        EngineConfig(memory_budget="6GiB", pack_weights=True)
    assert parse_args(["--memory-budget", "6GiB"]).engine_config().memory_budget == "6GiB"


def test_without_a_budget_nothing_is_measured(monkeypatch) -> None:
    import minillm.engine.llm_engine as llm_engine

    def refuse(*args: object) -> None:
        raise AssertionError("measured without a budget")

    monkeypatch.setattr(llm_engine, "measure", refuse)
    llm = LLM(small_model(), kv_cache_memory="1MiB")
    assert llm.engine.memory is None and llm.engine.pool.num_blocks == MiB // (16 * 1024)  # 1 KiB a token


def test_the_split_shows_in_the_banner_and_metrics() -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from server.__main__ import banner, memory_line
    from server.config import ServerConfig
    from server.engine_loop import AsyncEngine
    from server.metrics import Metrics

    model = small_model()
    llm = LLM(model, memory_budget=resident_bytes(CPU) + 160 * MiB, max_num_seqs=4, max_num_batched_tokens=64)
    split = llm.engine.memory
    text = banner(ServerConfig(), 8000, "decode steps run eagerly", memory_line(llm.engine))
    assert f"  {split.describe()}\n" in text and "  decode steps run eagerly\n" in text
    metrics = Metrics(AsyncEngine(llm.engine))
    metrics.show_memory(llm.engine)
    samples = {(s.name, s.labels.get("part")): s.value
               for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
               for s in family.samples}
    assert {part: samples["minillm:memory_bytes", part] for part in split.parts()} == split.parts()
    assert samples["minillm:kv_cache_blocks", None] == split.blocks
    assert samples["minillm:kv_cache_full_context_sequences", None] == split.full_context_sequences
    plain = LLM(model, kv_cache_memory="1MiB").engine  # no budget: the cache alone
    assert memory_line(plain).startswith(f"KV cache 1.0 MiB ({plain.pool.num_blocks:,} blocks of 16 tokens")


def test_weights_count_each_tensor_once() -> None:
    model = GPT(get_preset("tiny"))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes(model, model) == params
    assert weight_bytes(pack_weights(model), model) == params  # the packed copy shares every parameter
    assert weight_bytes(model, GPT(get_preset("tiny"))) == 2 * params


def test_quantized_weights_are_measured_as_stored() -> None:
    """An int8 model's weights are its int8 matrices and their scales, not the float model it
    came from; the engine measures the model it runs."""
    model = small_model()
    fp32 = weight_bytes(model)
    budget = resident_bytes(CPU) + 160 * MiB
    with LLM(model, quantize="int8", memory_budget=budget, max_num_seqs=4, max_num_batched_tokens=64) as llm:
        split, engine = llm.engine.memory, llm.engine
        stored = sum(t.untyped_storage().nbytes() for t in [*engine.model.parameters(), *engine.model.buffers()])
        assert split.weights == weight_bytes(engine.model) <= stored
        assert split.weights < fp32 / 2  # int8 matrices, bf16 rest: well under the fp32 model
        assert engine.pool.nbytes == split.kv_cache and engine.pool.k.dtype == torch.bfloat16
        assert split.block_bytes == 16 * kv_bytes_per_token(model.cfg, torch.bfloat16)


def test_compiled_decode_steps_reserve_a_copy_of_the_weights_per_bucket() -> None:
    """Inductor freezes the weights into each bucket's program, so a budget that compiles sets
    aside one copy per bucket (an upper bound) before anything is compiled."""
    model = small_model()
    budget = resident_bytes(CPU) + 240 * MiB  # four copies of the weights besides the rest
    llm = LLM(model, enforce_eager=False, memory_budget=budget, max_num_seqs=5, max_num_batched_tokens=64)
    split = llm.engine.memory
    assert llm.engine.graphs is not None and llm.engine.graphs.buckets == [1, 2, 4, 8]
    assert split.graphs == 4 * weight_bytes(model)
    assert LLM(model, memory_budget=budget, max_num_seqs=5, max_num_batched_tokens=64).engine.memory.graphs == 0
