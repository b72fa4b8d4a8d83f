"""The engine, its captured step and training on a CUDA GPU: each skips without one.

They are marked ``cuda`` with the other tests that run natively on a GPU (the Triton kernels):
``pytest -m cuda`` is what the GPU check (``scripts/gpu_check.sh``) runs there. Small shapes:
what they check is that the CUDA paths give the tokens the CPU reference gives, not speed.
"""

from __future__ import annotations

import math

import pytest
import torch

from minillm.model.config import ModelConfig
from minillm.engine import LLM, SamplingParams
from minillm.machine.hardware import measure_machine
from minillm.model.gpt import GPT
from minillm.train.trainer import measure_throughput

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[464, 3290, 373, 257, 1310, 11, 290], [7454, 2402], [40, 1101, 257, 1310, 11, 290, 314, 588, 340]]


def peaky_model() -> GPT:
    """Large random weights: greedy decoding has no near-ties for rounding to break differently."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(context_length=64, d_model=64, n_layers=2, n_heads=4)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return model


def greedy(model: GPT, **options) -> list[list[int]]:
    llm = LLM(model, num_blocks=32, block_size=4, max_num_seqs=4, **options)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_the_engine_on_cuda_gives_the_cpu_greedy_tokens() -> None:
    model = peaky_model()
    expected = greedy(model, enforce_eager=True)
    assert greedy(model.to("cuda"), enforce_eager=True) == expected


def test_cuda_graph_decode_replays_the_eager_tokens() -> None:
    model = peaky_model().to("cuda")
    eager = greedy(model, enforce_eager=True)
    llm = LLM(model, num_blocks=32, block_size=4, max_num_seqs=4, enforce_eager=False)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == eager
    assert llm.engine.graphs is not None and llm.engine.graphs.mode == "cuda-graph"
    assert llm.engine.overlap  # overlap scheduling is the default on a GPU: its tokens are the serial engine's


def test_bf16_decode_on_cuda_gives_every_token_asked_for() -> None:
    model = peaky_model().to("cuda", torch.bfloat16)
    assert [len(t) for t in greedy(model)] == [12, 12, 12]


def test_a_bf16_training_step_and_the_machine_measure_on_cuda() -> None:
    assert measure_throughput("tiny", "bfloat16", batch_size=4, steps=2, device="cuda") > 0
    profile = measure_machine("cuda", small=True)
    assert {"fp32", "bf16", "fp16"} <= set(profile.flops) and profile.bandwidth > 0
    assert all(math.isfinite(profile.ridge(d)) for d in profile.flops)
