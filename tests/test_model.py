import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from minillm.model.config import PRESETS, ModelConfig, get_preset
from minillm.model.gpt import (
    GPT,
    count_parameters,
    explicit_attention,
    fused_attention,
    inference_flops_per_token,
    matmul_parameters,
    training_flops_per_token,
)

TINY = get_preset("tiny")


@pytest.fixture
def model():
    torch.manual_seed(0)
    return GPT(TINY).eval()


def reference_logits(model: GPT, tokens: torch.Tensor) -> torch.Tensor:
    """GPT-2's forward written out from the weights alone, one formula a line, so a change to
    any layer of the module (norm order, GELU form, head split, scaling, positions, tied head)
    shows up as a difference."""
    w, cfg = model.state_dict(), model.cfg
    heads, t = cfg.n_heads, tokens.shape[1]

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        centred = x - x.mean(-1, keepdim=True)
        return centred / (centred.pow(2).mean(-1, keepdim=True) + cfg.layer_norm_eps).sqrt() * w[f"{name}.weight"] + w[f"{name}.bias"]

    def linear(x: torch.Tensor, name: str) -> torch.Tensor:
        return x @ w[f"{name}.weight"].T + w[f"{name}.bias"]

    def split(x: torch.Tensor) -> torch.Tensor:  # [b, t, d] -> [b, heads, t, d / heads]
        return x.view(x.shape[0], t, heads, -1).transpose(1, 2)

    x = w["tok_emb.weight"][tokens] + w["pos_emb.weight"][:t]
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    for i in range(cfg.n_layers):
        b = f"blocks.{i}"
        q, k, v = map(split, linear(norm(x, f"{b}.ln1"), f"{b}.attn.qkv").chunk(3, dim=-1))
        scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(future, float("-inf"))
        mixed = (scores.softmax(-1) @ v).transpose(1, 2).reshape_as(x)
        x = x + linear(mixed, f"{b}.attn.proj")
        hidden = linear(norm(x, f"{b}.ln2"), f"{b}.mlp.fc")
        gelu = 0.5 * hidden * (1 + torch.tanh(math.sqrt(2 / math.pi) * (hidden + 0.044715 * hidden ** 3)))
        x = x + linear(gelu, f"{b}.mlp.proj")
    return norm(x, "ln_f") @ w["tok_emb.weight"].T


def test_logits_equal_gpt2_written_out_by_hand(model):
    with torch.no_grad():  # every parameter random, so zero biases and unit norms hide nothing
        for name, p in model.named_parameters():  # norms near one, products of order one
            p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("ln1.weight") or name.endswith("ln2.weight")
                    or name == "ln_f.weight" else torch.randn_like(p) / math.sqrt(p.shape[-1]))
    x = torch.randint(0, TINY.vocab_size, (3, 10))
    with torch.no_grad():
        logits = model(x)
        assert logits.shape == (3, 10, TINY.vocab_size)
        assert torch.allclose(logits, reference_logits(model, x), atol=1e-4, rtol=1e-4)


def test_future_tokens_never_change_earlier_logits(model):
    x = torch.randint(0, TINY.vocab_size, (2, 20))
    y = x.clone()
    y[:, 12:] = torch.randint(0, TINY.vocab_size, (2, 8))
    assert torch.allclose(model(x)[:, :12], model(y)[:, :12], atol=1e-5)
    assert not torch.allclose(model(x)[:, 12:], model(y)[:, 12:], atol=1e-3)


@pytest.mark.parametrize("tq, tk", [(7, 7), (1, 9), (3, 11)])
def test_explicit_and_fused_attention_agree(tq, tk):
    torch.manual_seed(tq * tk)
    q, k, v = torch.randn(2, 4, tq, 16), torch.randn(2, 4, tk, 16), torch.randn(2, 4, tk, 16)
    assert torch.allclose(explicit_attention(q, k, v), fused_attention(q, k, v), atol=1e-5)


def test_whole_model_same_with_either_attention(model):
    x = torch.randint(0, TINY.vocab_size, (2, 33))
    fused = model(x)
    assert torch.allclose(model.set_attention("explicit")(x), fused, atol=1e-4)


def test_positions_are_honoured(model):
    x = torch.randint(0, TINY.vocab_size, (1, 5))
    shifted = torch.arange(3, 8).unsqueeze(0)
    assert not torch.allclose(model(x), model(x, positions=shifted))
    with pytest.raises(ValueError, match="context"):
        model(x, positions=torch.full((1, 5), TINY.context_length))


def test_embedding_is_tied(model):
    hidden = model.hidden_states(torch.tensor([[1, 2, 3]]))
    assert torch.allclose(model(torch.tensor([[1, 2, 3]])), hidden @ model.tok_emb.weight.T, atol=1e-5)
    assert not any(p.shape == model.tok_emb.weight.shape for n, p in model.named_parameters() if n != "tok_emb.weight")


@pytest.mark.parametrize("name", list(PRESETS))
def test_parameter_count_matches_the_module(name):
    cfg = PRESETS[name]
    with torch.device("meta"):  # shapes only: no memory for the 50M model
        model = GPT(cfg)
    assert count_parameters(cfg) == sum(p.numel() for p in model.parameters())


def test_the_seed_model_is_about_fifty_million():
    assert 45e6 <= count_parameters(get_preset("tinystories-50m")) <= 52e6


def test_flop_formulas_match_a_flop_counter():
    cfg = TINY
    model = GPT(cfg).set_attention("explicit")
    x = torch.randint(0, cfg.vocab_size, (2, 24))
    with FlopCounterMode(display=False) as fwd:
        logits = model(x)
    assert fwd.get_total_flops() == x.numel() * inference_flops_per_token(cfg, 24)
    with FlopCounterMode(display=False) as both:
        model(x).sum().backward()
    assert both.get_total_flops() == x.numel() * training_flops_per_token(cfg, 24)
    # and N is nearly every parameter: only positions, biases and norms are left out
    assert 0.95 < matmul_parameters(cfg) / count_parameters(cfg) <= 1


def test_config_validation():
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(d_model=100, n_heads=3)
    with pytest.raises(ValueError, match="n_layers"):
        ModelConfig(n_layers=0)
    with pytest.raises(ValueError, match="unknown preset 'huge'.*tiny"):
        get_preset("huge")


class RecordingCache:
    """The smallest cache: keeps every layer's keys and values, attends over all of them."""

    def __init__(self):
        self.k, self.v = {}, {}

    def attend(self, layer, q, k, v):
        if layer in self.k:
            k = torch.cat([self.k[layer], k], dim=2)
            v = torch.cat([self.v[layer], v], dim=2)
        self.k[layer], self.v[layer] = k, v
        return explicit_attention(q, k, v)


def test_a_cache_sees_the_same_logits_one_token_at_a_time(model):
    x = torch.randint(0, TINY.vocab_size, (1, 12))
    full = model(x)
    cache = RecordingCache()
    prefill = model(x[:, :8], cache=cache)
    steps = [model(x[:, i:i + 1], positions=torch.tensor([[i]]), cache=cache) for i in range(8, 12)]
    assert torch.allclose(torch.cat([prefill, *steps], dim=1), full, atol=1e-4)
    assert cache.k[0].shape[2] == 12
