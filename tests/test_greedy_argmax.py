"""The CPU's blockwise argmax is the argmax: same index for ties, NaN and infinities, tails."""

import pytest
import torch

from minillm.decoding.sampling import ARGMAX_BLOCK, argmax_rows


@pytest.mark.parametrize("vocab", [8 * ARGMAX_BLOCK - 1, 8 * ARGMAX_BLOCK, 8 * ARGMAX_BLOCK + 3, 11 * ARGMAX_BLOCK + 77])
def test_blockwise_argmax_is_torch_argmax(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    for trial in range(200):
        rows = int(torch.randint(1, 7, (1,), generator=g))
        x = torch.randint(0, 4, (rows, vocab), generator=g).float()  # many ties, across blocks
        if trial % 3 == 0:
            x[torch.rand(rows, vocab, generator=g) < 0.004] = float("nan")
        if trial % 4 == 0:
            x[torch.rand(rows, vocab, generator=g) < 0.004] = float("inf")
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1)), trial


def test_the_tail_past_the_last_block_is_searched_and_loses_ties() -> None:
    vocab = 9 * ARGMAX_BLOCK + 5
    x = torch.zeros(3, vocab)
    x[0, -1] = 1.0  # the maximum is in the tail
    x[1, 7] = x[1, -2] = 1.0  # a tie between a block and the tail: the first wins
    x[2, -3] = float("nan")  # a NaN in the tail only
    assert argmax_rows(x).tolist() == [vocab - 1, 7, vocab - 3]
    strided = torch.zeros(2, 2 * vocab)[:, ::2]
    strided[1, 9] = 1.0
    assert argmax_rows(strided).tolist() == [0, 9]
