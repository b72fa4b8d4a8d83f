"""The fused output layer + cross-entropy (minillm.model.losses) against the textbook two-step loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minillm.model.config import get_preset
from minillm.model.losses import linear_cross_entropy
from minillm.model.gpt import GPT


def _inputs(n: int = 20, d: int = 16, vocab: int = 97, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, requires_grad=True)
    weight = (torch.randn(vocab, d, generator=g) * 0.5).requires_grad_()
    targets = torch.randint(vocab, (n,), generator=g)
    return hidden, weight, targets


def _grads(loss_fn, hidden, weight, targets):
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    loss = loss_fn(h, w, targets)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def reference(h, w, t):
    return F.cross_entropy(F.linear(h, w), t)


@pytest.mark.parametrize("chunk", [1, 7, 20, 256])  # one token at a time, a ragged last chunk, exact, one chunk
def test_loss_and_both_gradients_equal_the_plain_cross_entropy(chunk):
    hidden, weight, targets = _inputs()
    want = _grads(reference, hidden, weight, targets)
    got = _grads(lambda h, w, t: linear_cross_entropy(h, w, t, chunk), hidden, weight, targets)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_an_incoming_gradient_scales_both_gradients():
    hidden, weight, targets = _inputs()
    _, h1, w1 = _grads(lambda h, w, t: linear_cross_entropy(h, w, t, 8), hidden, weight, targets)
    _, h3, w3 = _grads(lambda h, w, t: 3.0 * linear_cross_entropy(h, w, t, 8), hidden, weight, targets)
    torch.testing.assert_close(h3, 3 * h1)
    torch.testing.assert_close(w3, 3 * w1)


def test_without_grad_it_gives_the_same_loss_and_builds_no_graph():
    hidden, weight, targets = _inputs()
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, targets, 6)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, reference(hidden, weight, targets).detach())


def test_under_bf16_autocast_the_loss_stays_fp32_and_close():
    hidden, weight, targets = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, targets, 8)
    loss.backward()
    assert loss.dtype == torch.float32 and weight.grad.dtype == torch.float32 and hidden.grad.dtype == torch.float32
    torch.testing.assert_close(loss, reference(hidden, weight, targets).detach(), rtol=2e-2, atol=2e-2)


def test_the_model_given_targets_returns_the_loss_of_its_logits_with_the_same_gradients():
    torch.manual_seed(0)
    model = GPT(get_preset("tiny"))
    x = torch.randint(model.cfg.vocab_size, (2, 17))
    plain = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    plain.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    fused = model(x[:, :-1], targets=x[:, 1:])
    fused.backward()
    torch.testing.assert_close(fused, plain.detach())
    for name, p in model.named_parameters():  # the tied embedding gets both its gradients
        torch.testing.assert_close(p.grad, want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_chunk_below_one_is_refused():
    hidden, weight, targets = _inputs()
    with pytest.raises(ValueError, match="chunk"):
        linear_cross_entropy(hidden, weight, targets, 0)
