"""Export to, and import from, the Hugging Face GPT-2 format.

Our model is GPT-2's architecture, so its weights fit GPT-2's file layout once renamed. Written
that way (``config.json`` + ``model.safetensors``, and the tokenizer's files beside them),
anyone can load the directory with ``transformers.pipeline("text-generation", directory)`` and
take it further with the whole ecosystem, e.g. to GGUF with llama.cpp's ``convert_hf_to_gguf.py``;
and we can load GPT-2 checkpoints that ``transformers`` saved. Only ``safetensors`` is needed
here: ``transformers`` itself is never imported.

One trap: GPT-2's linear layers are ``Conv1D`` modules whose weight is ``[in, out]``, the
transpose of ``nn.Linear``'s ``[out, in]``, so every matrix is transposed on the way out and in.

The tokenizer files are derived offline from tiktoken's ``gpt2`` ranks (``minillm.data.tokenizer``),
not downloaded: see :func:`gpt2_vocab`.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from minillm.model.config import ModelConfig
from minillm.model.gpt import GPT
from minillm.data.tokenizer import ENDOFTEXT, EOT_ID, N_VOCAB, get_tokenizer

# (our name, Hugging Face's, llama.cpp's GGUF name) for each tensor of block i, then for the others
_BLOCK = [
    ("ln1.weight", "ln_1.weight", "attn_norm.weight"), ("ln1.bias", "ln_1.bias", "attn_norm.bias"),
    ("attn.qkv.weight", "attn.c_attn.weight", "attn_qkv.weight"),
    ("attn.qkv.bias", "attn.c_attn.bias", "attn_qkv.bias"),
    ("attn.proj.weight", "attn.c_proj.weight", "attn_output.weight"),
    ("attn.proj.bias", "attn.c_proj.bias", "attn_output.bias"),
    ("ln2.weight", "ln_2.weight", "ffn_norm.weight"), ("ln2.bias", "ln_2.bias", "ffn_norm.bias"),
    ("mlp.fc.weight", "mlp.c_fc.weight", "ffn_up.weight"), ("mlp.fc.bias", "mlp.c_fc.bias", "ffn_up.bias"),
    ("mlp.proj.weight", "mlp.c_proj.weight", "ffn_down.weight"),
    ("mlp.proj.bias", "mlp.c_proj.bias", "ffn_down.bias"),
]
_TOP = [("tok_emb.weight", "wte.weight", "token_embd.weight"),
        ("pos_emb.weight", "wpe.weight", "position_embd.weight"),
        ("ln_f.weight", "ln_f.weight", "output_norm.weight"), ("ln_f.bias", "ln_f.bias", "output_norm.bias")]
# causal-mask buffers that older transformers versions saved with the weights
_BUFFER = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")
_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both are GELU's tanh approximation


def tensor_names(n_layers: int) -> list[tuple[str, str, str]]:
    """Every (our state_dict name, HF name without ``transformer.``, GGUF name), in GGUF's order."""
    names = list(_TOP)
    for i in range(n_layers):
        names += [(f"blocks.{i}.{ours}", f"h.{i}.{hf}", f"blk.{i}.{gg}") for ours, hf, gg in _BLOCK]
    return names


def _conv1d(hf: str, tensor: torch.Tensor) -> torch.Tensor:
    """GPT-2's ``Conv1D`` layout for a matrix of a block (every one is a linear layer), else as is."""
    return tensor.t() if hf.startswith("h.") and tensor.dim() == 2 else tensor


def hf_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """A ``GPT2Config`` dict describing ``cfg``."""
    return {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
        "vocab_size": cfg.vocab_size, "n_positions": cfg.context_length, "n_ctx": cfg.context_length,
        "n_embd": cfg.d_model, "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": cfg.layer_norm_eps,
        "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
        "initializer_range": 0.02, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "bos_token_id": EOT_ID, "eos_token_id": EOT_ID,
        "tie_word_embeddings": True, "use_cache": True, "torch_dtype": str(dtype).removeprefix("torch."),
    }


def export_hf(model: GPT, directory: str | Path) -> Path:
    """Write ``model`` as a Hugging Face GPT-2 checkpoint with its tokenizer in ``directory``;
    return the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ours = model.state_dict()
    tensors = {f"transformer.{hf}": _conv1d(hf, ours[name]).detach().cpu().contiguous()
               for name, hf, _ in tensor_names(model.cfg.n_layers)}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(model.cfg, model.dtype)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer(directory, model.cfg)
    return directory


# ----------------------------------------------------------------------------- the tokenizer


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte: the vocabulary files hold strings, and a byte
    such as a space or a control character would not survive a text file or a ``"a b"`` merge
    line. Printable Latin-1 bytes stand for themselves; the other 68 (space, controls, DEL, NBSP,
    soft hyphen) map to U+0100 onwards in byte order, so a space becomes ``"Ġ"`` and a newline ``"Ċ"``."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}


def _merged_pair(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two tokens whose merge made ``token``: run BPE on its bytes with only the merges
    ranked before it, which leaves exactly two parts (tiktoken keeps ranks, not merges)."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        candidates = [(ranks.get(parts[i] + parts[i + 1], rank), i) for i in range(len(parts) - 1)]
        best, i = min(candidates)
        if best >= rank:
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} (rank {rank}) is not the merge of two earlier tokens")
    return parts[0], parts[1]


@lru_cache(maxsize=1)
def gpt2_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """GPT-2's ``vocab.json`` (byte-level string -> id, ``<|endoftext|>`` included) and its merge
    list in priority order, derived from our tokenizer's ranks: a token's rank is its id and the
    priority of the merge that makes it, so the merges are the multi-byte tokens in rank order."""
    tokenizer = get_tokenizer()
    ranks = {tokenizer.token_bytes(i): i for i in range(tokenizer.n_vocab) if i != EOT_ID}
    chars = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(chars[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    vocab[ENDOFTEXT] = EOT_ID
    merges = [
        (text(a), text(b))
        for a, b in (_merged_pair(token, rank, ranks) for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])
                     if len(token) > 1)
    ]
    return vocab, merges


def _tokenizer_json(vocab: dict[str, int], merges: list[tuple[str, str]]) -> dict:
    """The ``tokenizers`` library's description of GPT-2's tokenizer: byte-level pre-tokenizing
    with GPT-2's regex, BPE, no prefix space, and ``<|endoftext|>`` as its one special token."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": EOT_ID, "content": ENDOFTEXT, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": True, "special": True}],
        "normalizer": None, "pre_tokenizer": byte_level,
        "post_processor": {**byte_level, "trim_offsets": False}, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [f"{a} {b}" for a, b in merges]},
    }


def write_tokenizer(directory: str | Path, cfg: ModelConfig) -> None:
    """Write GPT-2's tokenizer files (``vocab.json``, ``merges.txt``, ``tokenizer.json``,
    ``tokenizer_config.json``, ``special_tokens_map.json``) into ``directory``, so that
    ``AutoTokenizer`` and llama.cpp's converter find the tokenizer beside the weights. Decoding
    keeps spaces as they are (no ``clean_up_tokenization_spaces``), as ours does."""
    if cfg.vocab_size != N_VOCAB:
        raise ValueError(f"the GPT-2 tokenizer has {N_VOCAB} tokens, this model {cfg.vocab_size}")
    directory = Path(directory)
    vocab, merges = gpt2_vocab()
    special = {"bos_token": ENDOFTEXT, "eos_token": ENDOFTEXT, "unk_token": ENDOFTEXT}
    tokenizer_config = {
        "tokenizer_class": "GPT2Tokenizer", "model_max_length": cfg.context_length, **special,
        "add_bos_token": False, "add_prefix_space": False, "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "added_tokens_decoder": {str(EOT_ID): {"content": ENDOFTEXT, "lstrip": False, "normalized": True,
                                               "rstrip": False, "single_word": False, "special": True}},
    }
    files = {
        "vocab.json": json.dumps(vocab, ensure_ascii=False),
        "merges.txt": "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
        "tokenizer.json": json.dumps(_tokenizer_json(vocab, merges), ensure_ascii=False),
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=2) + "\n",
        "special_tokens_map.json": json.dumps(special, indent=2) + "\n",
    }
    for name, content in files.items():
        (directory / name).write_text(content, encoding="utf-8")


def config_from_hf(config: dict) -> ModelConfig:
    """Our :class:`ModelConfig` for a ``GPT2Config`` dict, or a ValueError for what we lack."""
    checks = [
        (config.get("model_type", "gpt2") == "gpt2", f"model_type {config.get('model_type')!r} is not 'gpt2'"),
        (config.get("activation_function", "gelu_new") in _ACTIVATIONS,
         f"activation {config.get('activation_function')!r} is not one of {_ACTIVATIONS}"),
        (config.get("n_inner") in (None, 4 * config["n_embd"]),
         f"n_inner {config.get('n_inner')} is not 4 * n_embd"),
        (config.get("scale_attn_weights", True), "scale_attn_weights=false is not supported"),
        (not config.get("scale_attn_by_inverse_layer_idx", False), "per-layer attention scaling is not supported"),
        (not config.get("add_cross_attention", False), "cross-attention is not supported"),
    ]
    for ok, problem in checks:
        if not ok:
            raise ValueError(f"cannot load this GPT-2 checkpoint: {problem}")
    return ModelConfig(
        vocab_size=config["vocab_size"], context_length=config["n_positions"], d_model=config["n_embd"],
        n_layers=config["n_layer"], n_heads=config["n_head"], dropout=config.get("resid_pdrop", 0.0),
        layer_norm_eps=config.get("layer_norm_epsilon", 1e-5),
    )


def _check_head(tensors: dict[str, torch.Tensor], tied: bool) -> None:
    """Accept an ``lm_head.weight`` only as a copy of ``wte``: our output matrix is tied."""
    head = tensors.pop("lm_head.weight", None)
    if head is None and not tied:
        raise ValueError("cannot load: tie_word_embeddings is false and there is no lm_head.weight")
    if head is not None and not torch.equal(head, tensors.get("wte.weight", head)):
        raise ValueError("cannot load: lm_head.weight differs from wte.weight (untied embeddings)")


def load_hf(directory: str | Path) -> GPT:
    """Load a GPT-2 checkpoint (ours, or one ``transformers`` saved) from ``directory``, in eval
    mode (files saved by ``transformers`` carry a dropout of 0.1 for training)."""
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    if not (directory / "model.safetensors").exists():
        raise ValueError(f"no model.safetensors in {directory} (sharded and .bin checkpoints are not supported)")
    cfg = config_from_hf(config)
    raw = load_file(str(directory / "model.safetensors"))
    tensors = {k.removeprefix("transformer."): v for k, v in raw.items()}
    tensors = {k: v for k, v in tensors.items() if not _BUFFER.fullmatch(k)}
    _check_head(tensors, config.get("tie_word_embeddings", True))
    names = tensor_names(cfg.n_layers)
    missing = sorted(hf for _, hf, _ in names if hf not in tensors)
    unexpected = sorted(set(tensors) - {hf for _, hf, _ in names})
    if missing or unexpected:
        raise ValueError(f"cannot load: missing tensors {missing}, unexpected tensors {unexpected}")
    state = {ours: _conv1d(hf, tensors[hf]) for ours, hf, _ in names}
    model = GPT(cfg).to(tensors["wte.weight"].dtype)
    try:
        model.load_state_dict(state)  # strict, and shapes must match the config
    except RuntimeError as err:
        raise ValueError(f"cannot load: tensors do not fit the config: {err}") from None
    return model.eval()
