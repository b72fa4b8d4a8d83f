"""Chapter 16's Triton kernels against the reference: causal, non-causal, ragged and paged.

On a CUDA machine they run compiled, on the GPU; elsewhere in Triton's interpreter on CPU
tensors (``minillm.speedups.kernels.runtime``), which is slow, hence the small shapes. ``make test``
installs the ``triton`` extra and sets ``MINILLM_REQUIRE_TRITON=1``, so there (and in CI) a
missing Triton fails the run instead of quietly dropping this file; a bare ``pytest`` without
the extra skips it, with the reason in the summary.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from minillm.speedups.kernels import interpreting, triton_installed  # before triton: it picks the interpreter

if not triton_installed():
    WHY = "Triton is not installed: pip install -e '.[triton]' (make test installs it)"
    if os.environ.get("MINILLM_REQUIRE_TRITON") == "1":
        pytest.fail(WHY, pytrace=False)
    pytest.skip(WHY, allow_module_level=True)

from minillm.model.config import ModelConfig  # noqa: E402
from minillm.engine import LLM, SamplingParams  # noqa: E402
from minillm.speedups.kernels.flash_triton import flash_attention  # noqa: E402
from minillm.speedups.kernels.paged_triton import paged_decode_attention  # noqa: E402
from minillm.model.gpt import GPT  # noqa: E402
from minillm.speedups import decode_graphs  # noqa: E402

DEVICE = torch.device("cpu" if interpreting() else "cuda")
pytestmark = pytest.mark.cuda  # compiled on a GPU where there is one: the GPU check runs these natively
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def reference(q, k, v, causal: bool) -> torch.Tensor:
    t_q, t_k = q.shape[-2], k.shape[-2]
    mask = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril(t_k - t_q) if causal else None
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)


def randn(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


@pytest.mark.parametrize(
    "causal, t_q, t_k, d",
    [
        (False, 37, 37, 16),  # ragged: 37 is no multiple of the 16-row blocks
        (True, 37, 37, 16),
        (True, 5, 50, 32),  # a chunk of new tokens after a cached prefix (bottom-right mask)
        (False, 1, 29, 20),  # a decode; head_dim 20 is padded to 32 inside the kernel
    ],
)
def test_flash_attention_equals_sdpa(causal, t_q, t_k, d) -> None:
    q, k, v = randn(1, 2, t_q, d, seed=1), randn(1, 2, t_k, d, seed=2), randn(1, 2, t_k, d, seed=3)
    out = flash_attention(q, k, v, causal=causal, block_m=16, block_n=16)
    torch.testing.assert_close(out.double(), reference(q, k, v, causal), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_attention_half_precision_inputs(dtype) -> None:
    q, k, v = (randn(2, 2, 40, 16, dtype=dtype, seed=s) for s in range(3))
    out = flash_attention(q, k, v, causal=True, block_m=16, block_n=32)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), reference(q, k, v, True), atol=TOLERANCE[dtype], rtol=0)


def test_flash_attention_reads_strided_views() -> None:
    """The engine hands the kernel slices of a fused qkv projection, not contiguous tensors."""
    qkv = randn(1, 24, 3, 2, 16).permute(2, 0, 3, 1, 4)  # [3, B, H, T, d], as CausalSelfAttention makes
    q, k, v = qkv[0][:, :, 8:], qkv[1], qkv[2]
    torch.testing.assert_close(flash_attention(q, k, v, causal=True, block_m=16, block_n=16).double(),
                               reference(q, k, v, True), atol=1e-5, rtol=1e-5)


def test_flash_attention_rejects_bad_input() -> None:
    q = randn(1, 1, 4, 16)
    with pytest.raises(ValueError, match="block_m must be a power of two >= 16"):
        flash_attention(q, q, q, block_m=24)
    with pytest.raises(ValueError, match=r"expected q \[B, H, T_q, d\]"):
        flash_attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="at least as many keys"):
        flash_attention(randn(1, 1, 8, 16), q, q, causal=True)


@pytest.mark.parametrize("block_size, dtype", [(8, torch.float32), (6, torch.float32), (4, torch.bfloat16)])
def test_paged_decode_equals_sdpa_over_the_gathered_blocks(block_size, dtype) -> None:
    """Ragged lengths, blocks scattered through the pool in no order, a non-power-of-two block
    size, and table entries past a sequence's end pointing at garbage: none of it may matter."""
    heads, d, num_blocks = 2, 16, 24
    k_pool, v_pool = (randn(num_blocks, block_size, heads, d, dtype=dtype, seed=s) for s in (4, 5))
    lengths = torch.tensor([1, 3 * block_size, 2 * block_size + 1], device=DEVICE)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(6))
    tables = order[:12].view(3, 4).to(DEVICE)
    q = randn(3, heads, d, dtype=dtype, seed=7)
    out = paged_decode_attention(q, k_pool, v_pool, tables, lengths)
    for b in range(3):
        keys = k_pool[tables[b]].reshape(-1, heads, d)[: lengths[b]].transpose(0, 1)
        values = v_pool[tables[b]].reshape(-1, heads, d)[: lengths[b]].transpose(0, 1)
        expected = reference(q[b][:, None], keys, values, causal=False)[:, 0]
        torch.testing.assert_close(out[b].double(), expected, atol=TOLERANCE[dtype], rtol=0)


def test_paged_decode_rejects_bad_shapes() -> None:
    pool = randn(4, 8, 2, 16)
    with pytest.raises(ValueError, match=r"expected block_tables \[B, W\]"):
        paged_decode_attention(randn(3, 2, 16), pool, pool, torch.zeros(2, 1, dtype=torch.long), torch.ones(3))
    with pytest.raises(ValueError, match=r"expected q \[B, H, d\]"):
        paged_decode_attention(randn(3, 4, 16), pool, pool, torch.zeros(3, 1, dtype=torch.long), torch.ones(3))


def test_engine_with_triton_attention_gives_the_same_greedy_tokens(monkeypatch) -> None:
    """Prefill through the FlashAttention kernel, decodes through the paged kernel, eagerly and
    in captured decode steps (compiled on a CPU, without autotuning; CUDA graphs on a GPU),
    against the engine's eager PyTorch attention. Prompts of different lengths give ragged
    decode groups, and 4-token blocks make them span several blocks."""
    no_autotuning = {**decode_graphs.CPU_INDUCTOR_CONFIG, "max_autotune": False}
    monkeypatch.setattr(decode_graphs, "CPU_INDUCTOR_CONFIG", no_autotuning)
    torch.manual_seed(0)
    model = GPT(ModelConfig(context_length=64, d_model=64, n_layers=2, n_heads=4)).to(DEVICE).eval()
    with torch.no_grad():  # peaky logits: greedy decoding has no near-ties to break differently
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    prompts = [[464, 3290, 373, 257, 1310, 11, 290], [7454, 2402]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    runs = {"torch": dict(attention="torch", enforce_eager=True),
            "triton": dict(attention="triton", enforce_eager=True),
            "triton, captured": dict(attention="triton", enforce_eager=False)}
    tokens = {}
    for name, options in runs.items():
        llm = LLM(model, num_blocks=16, block_size=4, max_num_seqs=2, **options)
        tokens[name] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine.graphs is not None and llm.engine.graphs.prepare_seconds  # the last run's steps were captured
    assert tokens["triton"] == tokens["torch"] == tokens["triton, captured"]
    assert [len(t) for t in tokens["triton"]] == [6, 6]


# Compiles both kernels for an sm_80 GPU, which needs no GPU, in a process of its own: this one's
# Triton library functions were made for the interpreter.
COMPILE_FOR_A_GPU = textwrap.dedent("""
    from triton import compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from minillm.speedups.kernels.flash_triton import flash_forward_kernel
    from minillm.speedups.kernels.paged_triton import paged_decode_kernel

    def ptx(fn, pointers, constants):
        types = {name: pointers.get(name, "i32") for name in fn.arg_names} | {c: "constexpr" for c in constants}
        types |= {name: "fp32" for name in ("scale", "scale_log2") if name in types}
        constexprs = {(fn.arg_names.index(c),): value for c, value in constants.items()}
        return compile(ASTSource(fn=fn, signature=types, constexprs=constexprs), target=GPUTarget("cuda", 80, 32)).asm["ptx"]

    flash = ptx(flash_forward_kernel, dict.fromkeys("QKVO", "*fp16"),
                dict(CAUSAL=True, BLOCK_M=64, BLOCK_N=64, BLOCK_D=64, UPCAST=False, PRECISION="tf32"))
    paged = ptx(paged_decode_kernel, dict.fromkeys(["Q", "K_POOL", "V_POOL", "O"], "*bf16") | {"TABLES": "*i64", "LENGTHS": "*i64"},
                dict(BLOCK_SIZE=16, BLOCK_N=16, BLOCK_D=64))
    print("mma.sync" in flash, ".entry paged_decode_kernel" in paged)
""")


@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU the tests above already compile the kernels")
def test_kernels_compile_for_a_real_gpu() -> None:
    """The interpreter is forgiving where the compiler is not (types of loop-carried values,
    tile shapes), so CI also compiles the kernels, and checks both ``tl.dot`` products of the
    FlashAttention kernel went to the tensor cores (``mma``)."""
    env = os.environ | {"TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": "", "TRITON_DEFAULT_FP_FUSION": "1"}
    result = subprocess.run([sys.executable, "-c", COMPILE_FOR_A_GPU], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["True", "True"]
