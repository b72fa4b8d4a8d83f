"""The training loss without the full logits: the output layer and cross-entropy fused, in chunks.

For a model this small the output layer is most of a training step. With 2,048 tokens in a
batch and GPT-2's 50,257-token vocabulary, ``F.cross_entropy(F.linear(h, W), y)`` writes a
``[2048, 50257]`` fp32 logits tensor (411 MB), reads it back for the log-softmax, keeps that
for the backward pass, and writes and reads a gradient of the same size there, exponentiating
every logit twice on the way. None of it fits in a cache, so the step spends its time moving
those tensors rather than multiplying matrices.

:func:`linear_cross_entropy` takes a few hundred tokens at a time instead. For each chunk it
computes the logits, their log-sum-exp and the loss, and, while the chunk is still in the
cache, the gradient of the loss with respect to the logits (``softmax - one_hot``), which it
turns at once into the chunk's share of the two gradients that matter: the hidden states' (a
``[chunk, d]`` block) and the output matrix's (summed into one ``[vocab, d]`` buffer). The
backward pass then only scales those by the incoming gradient. The arithmetic is the same three
matrix products as the plain version; what is saved is the traffic and the second pass of
exponentials. (The same idea drives Liger Kernel's fused linear cross-entropy and Apple's
Cut Cross-Entropy on GPUs; this one is plain PyTorch.)
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK = 256  # tokens: a 256 x 50,257 fp32 block is 51 MB, a few passes from the cache


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, dtype: torch.dtype,
             want_h: bool, want_w: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The mean loss, and (when wanted) its gradients with respect to ``hidden`` and ``weight``."""
    n = hidden.shape[0]
    w = weight.to(dtype)
    grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if want_h else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, n, chunk):
        h = hidden[start:start + chunk].to(dtype)
        t = targets[start:start + chunk]
        # The chunk's logits transposed, [vocab, chunk]: W @ h.T is the faster product on
        # oneDNN, and the two gradient products below then read it in their natural layout.
        logits = (w @ h.t()).float()
        cols = torch.arange(len(t), device=t.device)
        picked = logits[t, cols]
        top = logits.amax(dim=0, keepdim=True)
        probs = logits.sub_(top).exp_()  # in place: from here on the block holds exp(logit - max)
        sums = probs.sum(dim=0)
        total += (top.squeeze(0) + sums.log() - picked).sum()
        if want_h or want_w:
            # d(mean loss)/d(logits) = (softmax - one_hot) / n, built in the same block
            probs.mul_(1.0 / (n * sums))
            probs[t, cols] -= 1.0 / n
            g = probs.to(dtype)
            if want_h:
                grad_h[start:start + chunk] = (g.t() @ w).to(hidden.dtype)
            if want_w:
                if dtype == torch.float32:
                    grad_w.addmm_(g, h)  # summed in place: no [vocab, d] temporary
                else:
                    grad_w += (g @ h).float()
    return total / n, grad_h, None if grad_w is None else grad_w.to(weight.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """The gradients are computed in the forward pass, chunk by chunk, and saved; the backward
    pass only scales them by the incoming gradient (1 when the loss is the last thing)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, dtype):
        loss, grad_h, grad_w = chunked_cross_entropy(hidden, weight, targets, chunk, dtype, *ctx.needs_input_grad[:2])
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return (None if grad_h is None else grad_h * grad_out.to(grad_h.dtype),
                None if grad_w is None else grad_w * grad_out.to(grad_w.dtype), None, None, None)


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = DEFAULT_CHUNK
) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets``, never holding all the logits.

    ``hidden`` is ``[..., d]``, ``weight`` ``[vocab, d]``, ``targets`` the matching ``[...]``
    token ids. Equal (to fp32 rounding) to ``F.cross_entropy(F.linear(hidden, weight), targets)``
    and so are its gradients. Under autocast the two matrix products run in the autocast dtype;
    the softmax, the loss and the output matrix's gradient stay in fp32.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, not {chunk}")
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    args = (hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), chunk, dtype)
    with torch.autocast(device_type, enabled=False):
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            return _LinearCrossEntropy.apply(*args)
        return chunked_cross_entropy(*args, want_h=False, want_w=False)[0]  # evaluation: the loss alone
