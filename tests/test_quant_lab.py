"""The quantization lab in its smoke size: every format measured, and the accounting adds up,
on a model trained here for a few seconds so that its quality columns mean something.
(Speed is not judged here, CI machines are too noisy; the figures live in chapter 14.)"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.bench import quant as lab
from minillm.bench.__main__ import main
from minillm.bench.quant import agreement, markdown_table
from minillm.model.checkpoint import save_checkpoint
from minillm.cli import UsageError
from minillm.model.config import get_preset
from minillm.data.corpus import BatchSampler, prepare_corpus
from minillm.model.gpt import GPT
from minillm.train.trainer import TrainConfig, lr_at, make_optimizer, resolve, train_step


@pytest.fixture
def checkpoint(home):
    torch.manual_seed(0)
    m = GPT(get_preset("tiny")).eval()
    state = {"model": m.state_dict(), "model_config": m.cfg.to_dict(),
             "train_config": {"data": "synthetic", "max_stories": 400, "seed": 0}}
    return save_checkpoint(home / "ckpt.pt", state)


# A rhyme of single-token words, each always followed by the next: a tiny model learns it in seconds
# and then predicts it confidently, so the lab's quality columns have something to measure.
RHYME = ("one two three four five six seven eight nine ten red blue green black white dog cat bird fish cow "
         "sun moon star tree rock king queen boy girl man woman child").split()


class WithTheRestOfTheVocabulary(nn.Module):
    """A GPT over only the corpus's tokens, scored as the full-vocabulary GPT would score them if
    every other token's row were zero: each of those scores 0, together one column of
    ``log(how many)``. Training this is training the full model, without its 50,257-wide matmuls."""

    def __init__(self, model: GPT, others: int) -> None:
        super().__init__()
        self.model, self.others = model, math.log(others)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy, as ``GPT(tokens, targets=)`` returns it for the training step."""
        scores = self.model(tokens)
        scores = torch.cat([scores, torch.full_like(scores[..., :1], self.others)], dim=-1)
        return F.cross_entropy(scores.float().flatten(0, 1), targets.flatten())


def train_on_the_rhyme(home: Path, steps: int = 60) -> Path:
    """Write the rhyme as 400 stories, train the tiny preset on it with the package's training step
    and schedule, and save it as a checkpoint whose train config names that corpus."""
    rng = random.Random(0)
    stories = []
    for _ in range(400):
        start, length = rng.randrange(len(RHYME)), rng.randrange(40, 90)
        stories.append(" ".join(RHYME[(start + i) % len(RHYME)] for i in range(length)))
    text = home / "rhyme.txt"
    text.write_text("\n\n".join(stories))
    corpus = prepare_corpus(str(text), max_stories=400, seed=0, verbose=False)
    cfg, model_cfg = resolve(TrainConfig(preset="tiny", lr=1e-2, warmup=5))
    cfg = dataclasses.replace(cfg, max_steps=steps)  # not MINILLM_QUICK's cap, which resolve applies
    used = torch.from_numpy(np.unique(corpus.tokens("train")).astype(np.int64))
    index = torch.zeros(model_cfg.vocab_size, dtype=torch.long)
    index[used] = torch.arange(len(used))
    torch.manual_seed(0)
    small = GPT(dataclasses.replace(model_cfg, vocab_size=len(used)))
    runner = WithTheRestOfTheVocabulary(small, model_cfg.vocab_size - len(used))
    optimizer, scaler = make_optimizer(small, cfg), torch.amp.GradScaler("cpu", enabled=False)
    sampler = BatchSampler(corpus.tokens("train"), cfg.batch_size, cfg.seq_len, seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ops this small gain nothing from a second thread, and wait for it when cores are shared
    try:
        small.train()
        for step in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, cfg)
            x, y = sampler.batch(step)
            train_step(runner, optimizer, scaler, contextlib.nullcontext(), [(index[x], index[y])], cfg.grad_clip)
    finally:
        torch.set_num_threads(threads)
    state = small.state_dict()
    table = torch.zeros(model_cfg.vocab_size, model_cfg.d_model)
    table[used] = state["tok_emb.weight"]
    model = GPT(model_cfg)
    model.load_state_dict(state | {"tok_emb.weight": table})
    return save_checkpoint(home / "ckpt.pt", {"model": model.state_dict(), "model_config": model_cfg.to_dict(),
                                              "train_config": {"data": str(text), "max_stories": 400, "seed": 0}})


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The rhyme's checkpoint, trained once for the module; its MINILLM_HOME (the checkpoint's
    folder) holds the tokenized corpus, so a test that runs there finds it cached."""
    home = tmp_path_factory.mktemp("quant-lab")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MINILLM_HOME", str(home))
        env.setenv("HF_HUB_OFFLINE", "1")
        env.setenv("HF_DATASETS_OFFLINE", "1")
        return train_on_the_rhyme(home)


def test_smoke_lab_measures_every_format(trained, home, tmp_path, monkeypatch) -> None:
    """On a model that has learned something: an untrained one scores every format near-uniform,
    so a format whose weights were all lost would pass."""
    monkeypatch.setenv("MINILLM_HOME", str(trained.parent))  # where the rhyme's corpus is cached
    greedy, outputs = lab.greedy_outputs, []

    def traced(model: GPT, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """The lab's greedy outputs, kept in --formats order; the reference's (fp32's) comes back
        with one token changed to one no model emits, so that every other format must show the
        mismatch: a lab that compared a format with itself would report 1.0 everywhere."""
        out = greedy(model, prompts, max_tokens)
        outputs.append(copy.deepcopy(out))
        if len(outputs) == 1:
            out[0][-1] = -1
        return out

    monkeypatch.setattr(lab, "greedy_outputs", traced)
    formats = ["fp32", "bf16", "int8", "int4"]  # fp16 costs like bf16; a fresh process per format adds up
    assert main(["quant", "--smoke", "--formats", ",".join(formats), "--checkpoint", str(trained),
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
        for key in ("ttft_s", "decode_b1", "decode_wide"):  # each median lies within its quartiles
            low, high = r[f"{key}_iqr"]
            assert low <= r[key] <= high
        assert r["fraction_of_roofline"] == pytest.approx(r["decode_b1"] / r["roofline_b1"])
    # fewer bytes per step raise the bound in proportion (the KV bytes shrink with the float parts)
    assert rows["int4"]["bound_gain"] > rows["int8"]["bound_gain"] > rows["bf16"]["bound_gain"] > 1.5
    assert markdown_table(report).count("\n") == len(formats) + 1
    # perplexity: the rhyme is learned (uniform would be the vocabulary's 50,257), and kept by each format
    ppl = {f: rows[f]["val_ppl"] for f in formats}
    assert ppl["fp32"] < 2.0
    for fmt, rel in {"bf16": 0.02, "int8": 0.02, "int4": 0.05}.items():
        assert ppl[fmt] == pytest.approx(ppl["fp32"], rel=rel), fmt
    # agreement: measured against the reference's outputs, then what the quantization tests promise
    got = dict(zip(formats, outputs))
    reference = copy.deepcopy(got["fp32"])
    reference[0][-1] = -1
    for fmt in formats:
        assert rows[fmt]["agreement"] == pytest.approx(agreement(got[fmt], reference) if fmt != "fp32" else 1.0), fmt
    assert agreement(got["bf16"], got["fp32"]) >= 0.95
    assert agreement(got["int8"], got["fp32"]) >= 0.95 and agreement(got["int4"], got["fp32"]) >= 0.80


def test_agreement_counts_matching_positions() -> None:
    assert agreement([[1, 2, 3], [4, 5]], [[1, 2, 9], [4, 6]]) == pytest.approx(3 / 5)


def test_bad_formats_are_one_line_errors(checkpoint) -> None:
    with pytest.raises(UsageError, match="--formats: format must be one of"):
        main(["quant", "--formats", "fp32,int3", "--checkpoint", str(checkpoint)])
    with pytest.raises(UsageError, match="each format once"):
        main(["quant", "--formats", "fp32,fp32", "--checkpoint", str(checkpoint)])
    with pytest.raises(UsageError, match="--checkpoint: no checkpoint"):
        main(["quant", "--checkpoint", str(checkpoint.parent / "missing.pt")])
