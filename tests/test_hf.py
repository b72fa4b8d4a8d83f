"""The Hugging Face GPT-2 export and import: transformers must compute our logits, and back."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

from minillm.config import get_preset
from minillm.hf import export_hf, load_hf
from minillm.model import GPT


@pytest.fixture
def model() -> GPT:
    """A random tiny model, with nonzero biases and LayerNorm affines so every tensor matters."""
    torch.manual_seed(0)
    m = GPT(get_preset("tiny"))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias") or ".ln" in name or name.startswith("ln_f"):
                p.add_(0.1 * torch.randn_like(p))
    return m.eval()


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
