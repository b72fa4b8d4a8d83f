"""The Hugging Face GPT-2 export and import: transformers must compute our logits, and back;
and the exported directory must carry a tokenizer that splits text exactly as ours does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, pipeline

from minillm.model.config import get_preset
from minillm.decoding.generate import generate_kv_cache
from minillm.export.hf import export_hf, gpt2_vocab, load_hf
from minillm.model.gpt import GPT
from minillm.data.tokenizer import EOT_ID, bpe_files, get_tokenizer
from models import lively_tiny

TEXTS = [
    "hello world",
    "Once upon a time, a cat named Tom sat on the mat.",
    "  leading spaces,  double  spaces and a trailing one ",
    "new\nlines\n\n\tand tabs\r\n",
    "digits 0 12 345 6789 3.14159 1,000,000",
    "unicode: héllo wörld, naïve café, 日本語, Привет, 🚀🦙",
    "contractions: it's, I'll, we've, they're, 'quoted'",
]
PROMPTS = ["Once upon a time", "The little dog", "\n\n"]


def perturbed_tiny() -> GPT:
    """A random tiny model, with nonzero biases and LayerNorm affines so every tensor matters."""
    torch.manual_seed(0)
    m = GPT(get_preset("tiny"))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias") or ".ln" in name or name.startswith("ln_f"):
                p.add_(0.1 * torch.randn_like(p))
    return m.eval()


@pytest.fixture
def model() -> GPT:
    return perturbed_tiny()




@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[GPT, str]:
    """One export shared by the tokenizer and pipeline tests (loading transformers' pipeline
    and writing the 50,257-token vocabulary take seconds each)."""
    model = lively_tiny()
    return model, str(export_hf(model, tmp_path_factory.mktemp("hf")))


def tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def test_transformers_computes_our_logits(model: GPT, tmp_path) -> None:
    hf = GPT2LMHeadModel.from_pretrained(export_hf(model, tmp_path)).eval()
    x = tokens(model.cfg.vocab_size)
    diff = (hf(x).logits - model(x)).abs().max().item()
    assert diff < 1e-4, diff


@torch.no_grad()
def test_round_trip_is_exact(model: GPT, tmp_path) -> None:
    loaded = load_hf(export_hf(model, tmp_path / "export")).eval()
    assert loaded.cfg == model.cfg
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    x = tokens(model.cfg.vocab_size)
    assert torch.equal(loaded(x), model(x))


@torch.no_grad()
def test_load_a_checkpoint_transformers_saved(tmp_path) -> None:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=4, layer_norm_epsilon=1e-5)
    hf = GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # GPT-2 initialises biases to zero and LayerNorms to one: perturb them
        for name, p in hf.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).eval()
    x = tokens(config.vocab_size)
    diff = (hf(x).logits - ours(x)).abs().max().item()
    assert diff < 1e-4, diff


def test_relu_is_refused(model: GPT, tmp_path) -> None:
    export_hf(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["activation_function"] = "relu"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="relu"):
        load_hf(tmp_path)


def test_untied_head_and_unknown_tensors_are_refused(model: GPT, tmp_path) -> None:
    export_hf(model, tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    save_file({**tensors, "lm_head.weight": torch.randn_like(tensors["transformer.wte.weight"])}, str(path))
    with pytest.raises(ValueError, match="lm_head"):
        load_hf(tmp_path)
    save_file({**tensors, "transformer.h.9.mlp.c_fc.weight": torch.zeros(1)}, str(path))
    with pytest.raises(ValueError, match="unexpected"):
        load_hf(tmp_path)
    del tensors["transformer.ln_f.bias"]
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match="missing"):
        load_hf(tmp_path)


@torch.no_grad()
def test_old_style_checkpoint_is_accepted(model: GPT, tmp_path) -> None:
    """Older files: no ``transformer.`` prefix, a copied lm_head, and causal-mask buffers."""
    export_hf(model, tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(str(path)).items()}
    tensors["lm_head.weight"] = tensors["wte.weight"].clone()
    for i in range(model.cfg.n_layers):
        tensors[f"h.{i}.attn.bias"] = torch.ones(1, 1, 64, 64).tril()
        tensors[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(tensors, str(path))
    x = tokens(model.cfg.vocab_size)
    assert torch.equal(load_hf(tmp_path).eval()(x), model(x))


def test_derived_vocab_and_merges_are_gpt2s_files() -> None:
    """The vocabulary and merges we rebuild from tiktoken's ranks are, line for line, the
    ``encoder.json`` and ``vocab.bpe`` GPT-2 was published with."""
    vocab, merges = gpt2_vocab()
    vocab_bpe, encoder_json = bpe_files()
    assert vocab == json.loads(encoder_json.read_text(encoding="utf-8"))
    lines = vocab_bpe.read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("#version")
    assert merges == [tuple(line.split(" ")) for line in lines[1:] if line]


def test_config_names_the_context_as_n_ctx(exported) -> None:
    model, directory = exported
    config = json.loads((Path(directory) / "config.json").read_text())
    assert config["n_ctx"] == config["n_positions"] == model.cfg.context_length


def test_transformers_tokenizer_splits_text_as_ours(exported) -> None:
    _, directory = exported
    theirs, ours = AutoTokenizer.from_pretrained(directory), get_tokenizer()
    for text in TEXTS:
        ids = ours.encode(text)
        assert theirs(text)["input_ids"] == ids, text
        assert theirs.decode(ids) == ours.decode(ids), text
    special = "one story<|endoftext|>the next"
    assert theirs(special)["input_ids"] == ours.encode(special, allow_special=True)
    assert EOT_ID in ours.encode(special, allow_special=True)


@torch.no_grad()
def test_pipeline_greedy_generation_matches_ours(exported) -> None:
    """``pipeline("text-generation", directory)`` loads the export as is and continues each
    prompt with our greedy tokens. Every step's top two logits are first checked to be apart
    by far more than the two implementations' rounding, so equality is the right test."""
    model, directory = exported
    generator, tokenizer, n = pipeline("text-generation", directory), get_tokenizer(), 12
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        ours = generate_kv_cache(model, ids, n, stop_token=EOT_ID)
        logits = model(torch.tensor([ids + ours]))[0, len(ids) - 1 : -1]
        top2 = logits.topk(2).values
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-2, prompt
        assert len(set(ours)) > n // 2, ours  # a varied continuation, not one token repeated
        theirs = generator.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
        assert theirs[0, len(ids):].tolist() == ours, prompt
        text = generator(prompt, max_new_tokens=n, do_sample=False, return_full_text=False)[0]["generated_text"]
        assert text == tokenizer.decode(ours), prompt
