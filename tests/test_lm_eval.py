"""An evaluation harness against the live server: lm-eval's ``local-completions`` scores a
multiple-choice task from local files through ``echo`` + ``logprobs``, and every choice's
log-likelihood equals the same model's, scored in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from models import tiny_model
from test_server_live import live_server, small_engine

from minillm.model.gpt import GPT
from minillm.data.tokenizer import bpe_files, get_tokenizer

DOCS = [
    {"context": "Once upon a time there was a", "choices": ["cat", "dog", "little girl"], "label": 2},
    {"context": "Tom went to the park. He saw a", "choices": ["bird", "big red ball"], "label": 0},
    {"context": "The sun was", "choices": ["hot", "happy and bright", "blue"], "label": 1},
    {"context": "Lily liked to play with her", "choices": ["toys", "friend Ben"], "label": 0},
]


def task_dir(root: Path) -> Path:
    root.mkdir()
    data = root / "stories_mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (root / "stories_mc.yaml").write_text(
        "task: stories_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\n'
        "doc_to_choice: choices\n"
        "doc_to_target: label\n"
        "metric_list:\n  - metric: acc\n"
    )
    return root


def hf_tokenizer(root: Path) -> Path:
    """GPT-2's tokenizer as transformers saves it, made from the BPE files we ship (offline)."""
    from transformers import GPT2TokenizerFast

    vocab_bpe, encoder_json = bpe_files()
    vocab = json.loads(encoder_json.read_text())
    merges = [tuple(line.split()) for line in vocab_bpe.read_text().splitlines()[1:] if line.strip()]
    tokenizer = GPT2TokenizerFast(vocab=vocab, merges=merges)
    text = "Once upon a time, a llama \U0001f999 said:\n\n"
    assert tokenizer.encode(text) == get_tokenizer().encode(text)  # the same tokens as the server's
    tokenizer.save_pretrained(root)
    return root


def in_process(model: GPT, context: str, continuation: str) -> float:
    """What lm-eval asks for, computed here: log P(continuation | context), its tokens split
    off the whole string's encoding as lm-eval splits them."""
    tok = get_tokenizer()
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([whole]))[0].float(), dim=-1)
    return sum(float(logprobs[p - 1, whole[p]]) for p in range(len(ctx), len(whole)))


def test_lm_eval_local_completions_matches_in_process_scoring(tmp_path: Path, monkeypatch) -> None:
    from lm_eval import simple_evaluate  # a dev dependency; imported here, as it takes seconds
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = tiny_model()
    tasks, tokenizer = task_dir(tmp_path / "tasks"), hf_tokenizer(tmp_path / "tokenizer")
    with live_server(small_engine(model)) as live:
        results = simple_evaluate(
            model="local-completions",
            model_args={"base_url": f"{live.url}/v1/completions", "model": "minillm", "tokenizer_backend": "huggingface",
                        "tokenizer": str(tokenizer), "max_length": 128, "batch_size": 3, "num_concurrent": 1},
            tasks=["stories_mc"], task_manager=TaskManager(include_path=str(tasks)), log_samples=True,
        )
    samples = sorted(results["samples"]["stories_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(DOCS)
    correct = 0
    for sample, doc in zip(samples, DOCS):
        served = [resp[0][0] for resp in sample["resps"]]
        local = [in_process(model, doc["context"], " " + choice) for choice in doc["choices"]]
        assert served == pytest.approx(local, abs=1e-4)
        correct += max(range(len(local)), key=local.__getitem__) == doc["label"]
    assert results["results"]["stories_mc"]["acc,none"] == pytest.approx(correct / len(DOCS))
