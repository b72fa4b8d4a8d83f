"""Weights moved into 2 MB pages: the same parameters and numbers, one aligned mapping, moved once."""

from __future__ import annotations

import torch

from minillm.decoding.sampling import SamplingParams
from minillm.engine import LLM
from minillm.model.config import get_preset
from minillm.model.gpt import GPT
from minillm.speedups import huge_pages
from minillm.speedups.huge_pages import HUGE_PAGE, into_huge_pages


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(get_preset("tiny")).eval()


def _eligible_for_huge_pages(address: int) -> bool:
    """Whether the kernel may back the mapping holding ``address`` with huge pages
    (``THPeligible`` in ``/proc/self/smaps``: 1 for memory marked MADV_HUGEPAGE in ``madvise`` mode)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    return False


def test_parameters_move_into_one_aligned_mapping_with_their_numbers_and_only_once():
    model = _model()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    moved = into_huge_pages(model)
    assert moved == huge_pages.huge_pages_available()
    if not moved:
        return
    assert list(model.parameters()) == params  # the same objects
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    first = min(p.data_ptr() for p in params)
    assert first % HUGE_PAGE == 0 and all(p.data_ptr() % 64 == 0 for p in params)
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in params)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # no two overlap
    addresses = [p.data_ptr() for p in params]
    assert not into_huge_pages(model) and [p.data_ptr() for p in params] == addresses  # a second call moves nothing
    assert _eligible_for_huge_pages(first)  # marked for them (whether the kernel finds free 2 MB pages is its own affair)


def test_nothing_moves_where_huge_pages_cannot_be_asked_for(monkeypatch):
    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: False)
    model = _model()
    addresses = [p.data_ptr() for p in model.parameters()]
    assert not into_huge_pages(model)
    assert [p.data_ptr() for p in model.parameters()] == addresses


def test_an_engine_over_moved_weights_decodes_the_plain_paths_tokens():
    model = _model()
    greedy = SamplingParams(max_tokens=12, temperature=0)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    plain = [o.token_ids for o in LLM(model, num_blocks=32, block_size=4, enforce_eager=True).generate(
        prompts, greedy, use_tqdm=False)]
    fast = LLM(model, num_blocks=32, block_size=4)  # packs, moving the weights first
    again = LLM(model, num_blocks=32, block_size=4)  # a second engine over the same model
    assert [o.token_ids for o in fast.generate(prompts, greedy, use_tqdm=False)] == plain
    assert [o.token_ids for o in again.generate(prompts, greedy, use_tqdm=False)] == plain
    assert [o.token_ids for o in fast.generate(prompts, greedy, use_tqdm=False)] == plain  # its packed copies still found


def test_a_model_made_under_inference_mode_moves_as_inference_tensors():
    with torch.inference_mode():
        model = _model()
        moved = into_huge_pages(model)
        assert moved == huge_pages.huge_pages_available()
        assert all(p.is_inference() for p in model.parameters())
        torch.testing.assert_close(model(torch.tensor([[1, 2, 3]])), _model()(torch.tensor([[1, 2, 3]])))
