"""The quantization lab in its smoke size: every format measured, and the accounting adds up.
(Speed is not judged here, CI machines are too noisy; the figures live in chapter 12.)"""

from __future__ import annotations

import json

import pytest
import torch

from minillm.bench.__main__ import main
from minillm.bench.quant import agreement, markdown_table
from minillm.checkpoint import save_checkpoint
from minillm.cli import UsageError
from minillm.config import get_preset
from minillm.model import GPT


@pytest.fixture
def checkpoint(home):
    torch.manual_seed(0)
    m = GPT(get_preset("tiny")).eval()
    state = {"model": m.state_dict(), "model_config": m.cfg.to_dict(),
             "train_config": {"data": "synthetic", "max_stories": 400, "seed": 0}}
    return save_checkpoint(home / "ckpt.pt", state)


def test_smoke_lab_measures_every_format(checkpoint, tmp_path) -> None:
    formats = ["fp32", "bf16", "int8", "int4"]  # fp16 costs like bf16; a fresh process per format adds up
    assert main(["quant", "--smoke", "--formats", ",".join(formats), "--checkpoint", str(checkpoint),
                 "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "quant-cpu.json").read_text())
    assert (tmp_path / "quant-cpu.png").stat().st_size > 1000
    rows = report["rows"]
    assert list(rows) == formats
    size = {f: rows[f]["weight_bytes"] for f in formats}
    assert size["fp32"] > size["bf16"] > size["int8"] > size["int4"]
    assert size["fp32"] == 2 * size["bf16"]
    assert rows["fp32"]["agreement"] == 1.0 and rows["fp32"]["bound_gain"] == 1.0
    assert rows["int8"]["kernels"] and rows["int4"]["kernels"] and not rows["fp32"]["kernels"]
    for r in rows.values():
        assert r["rss_peak"] >= r["rss_loaded"] > r["rss_before"] > 0
        assert r["ttft_s"] > 0 and r["decode_b1"] > 0 and r["decode_wide"] > 0
        assert r["fraction_of_roofline"] == pytest.approx(r["decode_b1"] / r["roofline_b1"])
        assert r["val_ppl"] == pytest.approx(rows["fp32"]["val_ppl"], rel=0.05)  # a random model: all near-uniform
    # fewer bytes per step raise the bound in proportion (the KV bytes shrink with the float parts)
    assert rows["int4"]["bound_gain"] > rows["int8"]["bound_gain"] > rows["bf16"]["bound_gain"] > 1.5
    assert markdown_table(report).count("\n") == len(formats) + 1


def test_agreement_counts_matching_positions() -> None:
    assert agreement([[1, 2, 3], [4, 5]], [[1, 2, 9], [4, 6]]) == pytest.approx(3 / 5)


def test_bad_formats_are_one_line_errors(checkpoint) -> None:
    with pytest.raises(UsageError, match="--formats: format must be one of"):
        main(["quant", "--formats", "fp32,int3", "--checkpoint", str(checkpoint)])
    with pytest.raises(UsageError, match="each format once"):
        main(["quant", "--formats", "fp32,fp32", "--checkpoint", str(checkpoint)])
    with pytest.raises(UsageError, match="--checkpoint: no checkpoint"):
        main(["quant", "--checkpoint", str(checkpoint.parent / "missing.pt")])
