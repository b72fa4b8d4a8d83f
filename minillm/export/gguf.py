"""Export to GGUF, the single file llama.cpp (and everything built on it) runs.

A GGUF file is a list of key-value metadata followed by named tensors. llama.cpp already has
GPT-2's architecture (``src/models/gpt2.cpp``), so our model needs only the names and keys it
reads. There is no ``output.weight``: llama.cpp reuses ``token_embd`` when the output matrix is
absent, which is exactly our tied embedding.

No transposes either, unlike the Hugging Face export. ggml lists a matrix's dimensions fastest
first, so the ``{n_embd, 3 * n_embd}`` that llama.cpp asks for ``attn_qkv`` is, in row-major
terms, ``[3 * n_embd, n_embd]``: ``nn.Linear``'s ``[out, in]``, the layout we already have.

Tensor types follow llama.cpp's own converter (``convert_hf_to_gguf.py``): vectors (norms,
biases) and the position table stay ``f32``; the other matrices take the requested type.
The file is written with the ``gguf`` package (llama.cpp's ``gguf-py``), a dev extra imported
only here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from minillm.export.hf import gpt2_vocab, tensor_names
from minillm.model.gpt import GPT
from minillm.data.tokenizer import EOT_ID, N_VOCAB

_KEEP_F32 = {"position_embd.weight"}  # as llama.cpp's converter: too few rows to matter, and exact
_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
Q8_0_BLOCK = 32  # q8_0 stores each run of 32 values as 32 int8s and one f16 scale


def _import_gguf():
    """The ``gguf`` package, or an error that says how to install it."""
    try:
        import gguf
    except ModuleNotFoundError:
        raise RuntimeError(
            "GGUF export needs the gguf package (llama.cpp's gguf-py): pip install gguf, "
            "or pip install -e '.[dev]'"
        ) from None
    return gguf


def export_gguf(model: GPT, path: str | Path, dtype: str | None = None) -> Path:
    """Write ``model`` and GPT-2's tokenizer as one GGUF file that llama.cpp loads; return the path.

    ``dtype`` is the matrices' type: ``"f32"``, ``"f16"``, ``"bf16"`` or ``"q8_0"`` (8-bit
    blocks, llama.cpp's near-lossless quantization). By default it is the model's own dtype,
    so nothing is rounded unless asked for.
    """
    gguf = _import_gguf()
    types = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}
    file_types = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                  "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
    dtype = dtype or _DTYPES.get(model.dtype, "f32")
    if dtype not in types:
        raise ValueError(f"dtype must be one of {list(types)}, not {dtype!r}")
    cfg = model.cfg
    if cfg.vocab_size != N_VOCAB:
        raise ValueError(f"the GPT-2 tokenizer has {N_VOCAB} tokens, this model {cfg.vocab_size}")
    if dtype == "q8_0" and cfg.d_model % Q8_0_BLOCK:
        raise ValueError(f"q8_0 needs d_model divisible by {Q8_0_BLOCK}, not {cfg.d_model}")
    state = model.state_dict()
    names = tensor_names(cfg.n_layers)
    if set(state) != {ours for ours, _, _ in names} or not all(t.is_floating_point() for t in state.values()):
        raise ValueError("only a plain floating-point GPT can be exported to GGUF (not a quantized one)")

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, arch="gpt2")
    writer.add_name("minillm")
    writer.add_file_type(file_types[dtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(cfg.context_length)
    writer.add_embedding_length(cfg.d_model)
    writer.add_block_count(cfg.n_layers)
    writer.add_feed_forward_length(4 * cfg.d_model)
    writer.add_head_count(cfg.n_heads)
    writer.add_layer_norm_eps(cfg.layer_norm_eps)

    vocab, merges = gpt2_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i == EOT_ID else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    writer.add_token_merges([f"{a} {b}" for a, b in merges])
    writer.add_bos_token_id(EOT_ID)
    writer.add_eos_token_id(EOT_ID)
    writer.add_add_bos_token(False)  # our prompts are the ids as given: nothing is prepended

    for ours, _, theirs in names:
        data = state[ours].detach().float().cpu().numpy()
        qtype = gguf.GGMLQuantizationType.F32 if data.ndim == 1 or theirs in _KEEP_F32 else types[dtype]
        writer.add_tensor(theirs, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_context_length(path: str | Path) -> int:
    """The context length a GGUF file declares (``{architecture}.context_length``): the most
    positions llama.cpp may run it at, read from the metadata without loading the tensors."""
    reader = _import_gguf().GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    return int(reader.fields[f"{arch}.context_length"].contents())
