import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from minillm.data.corpus import (
    BatchSampler,
    CorpusUnavailable,
    hub_reachable,
    prepare_corpus,
    split_of,
    split_stories,
)
from minillm.data.synthetic import generate_stories
from minillm.data.tokenizer import get_tokenizer

tok = get_tokenizer()


def decoded_stories(corpus, split):
    """The stories of a split, read back from the token file."""
    ids = np.asarray(corpus.tokens(split))
    starts = np.flatnonzero(ids == tok.eot)
    ends = [*starts[1:], len(ids)]
    return [tok.decode(ids[s + 1:e].tolist()) for s, e in zip(starts, ends)]


def test_synthetic_corpus_round_trips(home):
    corpus = prepare_corpus("synthetic", max_stories=300, seed=5, verbose=False)
    train = decoded_stories(corpus, "train")
    expected = [s for s in generate_stories(2000, seed=5) if split_of(s) == "train"][:300]
    assert train == expected
    stats = corpus.stats("train")
    assert stats["stories"] == 300
    assert stats["tokens"] == len(corpus.tokens("train"))
    assert stats["bytes"] == sum(len(s.encode()) for s in expected)


def test_token_stream_format(home):
    corpus = prepare_corpus("synthetic", max_stories=200, verbose=False)
    for split in ("train", "validation"):
        ids = np.asarray(corpus.tokens(split))
        assert ids.dtype == np.uint16
        assert ids[0] == tok.eot
        assert int(ids.max()) < tok.n_vocab
        assert int((ids == tok.eot).sum()) == corpus.stats(split)["stories"]


def test_splits_do_not_overlap(home):
    corpus = prepare_corpus("synthetic", max_stories=400, verbose=False)
    train, val = set(decoded_stories(corpus, "train")), set(decoded_stories(corpus, "validation"))
    assert val and train
    assert not train & val
    assert all(split_of(s) == "validation" for s in val)


def test_cache_is_reused_and_rebuilt_on_request(home):
    first = prepare_corpus("synthetic", max_stories=100, verbose=False)
    cached = first.directory / "train.bin"
    stamp = 1_000_000_000_000_000_000  # 2001: set by hand, so no rewrite (which stamps now) can keep it
    os.utime(cached, ns=(stamp, stamp))
    inode = cached.stat().st_ino
    second = prepare_corpus("synthetic", max_stories=100, verbose=False)
    assert second.directory == first.directory
    assert (cached.stat().st_mtime_ns, cached.stat().st_ino) == (stamp, inode)  # reused, not rewritten
    prepare_corpus("synthetic", max_stories=100, rebuild=True, verbose=False)
    assert cached.stat().st_mtime_ns != stamp and cached.stat().st_ino != inode  # a new file renamed into place
    assert not list(first.directory.glob("*.tmp"))


def test_different_sizes_get_different_caches(home):
    a = prepare_corpus("synthetic", max_stories=50, verbose=False)
    b = prepare_corpus("synthetic", max_stories=60, verbose=False)
    assert a.directory != b.directory and b.stats("train")["stories"] == 60


def many_stories(n=300):
    return [s.replace("\n\n", " ") for s in generate_stories(n, seed=11)]


@pytest.mark.parametrize("separator", ["\n\n", "\n<|endoftext|>\n"])
def test_text_file_source(home, tmp_path, separator):
    stories = many_stories()
    path = tmp_path / "stories.txt"
    path.write_text(separator.join(stories) + "\n")
    corpus = prepare_corpus(str(path), verbose=False)
    got = decoded_stories(corpus, "train") + decoded_stories(corpus, "validation")
    assert sorted(got) == sorted(stories)
    assert corpus.source == "file"


def test_jsonl_source(home, tmp_path):
    stories = many_stories()
    path = tmp_path / "stories.jsonl"
    path.write_text("".join(json.dumps({"text": s, "id": i}) + "\n" for i, s in enumerate(stories)))
    corpus = prepare_corpus(str(path), verbose=False)
    assert corpus.stats("train")["stories"] + corpus.stats("validation")["stories"] == len(stories)
    assert set(decoded_stories(corpus, "validation")) <= set(stories)


def test_jsonl_without_text_field_is_refused(home, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"story": "a"}\n')
    with pytest.raises(ValueError, match="text"):
        prepare_corpus(str(path), verbose=False)


def test_missing_path_is_refused(home, tmp_path):
    with pytest.raises(FileNotFoundError, match="neither"):
        prepare_corpus(str(tmp_path / "nope.txt"), verbose=False)


def test_split_stories():
    assert split_stories("a b\n\nc d\n\n\n e ") == ["a b", "c d", "e"]
    # With <|endoftext|> present, blank lines are part of a story.
    assert split_stories("one\n\npara<|endoftext|>two") == ["one\n\npara", "two"]


def test_auto_falls_back_to_synthetic_offline_and_says_why(home, monkeypatch):
    """Offline (``HF_HUB_OFFLINE``, as ``home`` sets it) the decision is made without touching
    the network at all: no name looked up, no connection tried, so no retries to wait through."""
    attempts = []

    def no_network(what):
        def refuse(*args, **kwargs):
            attempts.append((what, args[1:] if what == "connect" else args[:2]))
            raise OSError(f"test: no network ({what})")
        return refuse

    monkeypatch.setattr(socket, "getaddrinfo", no_network("getaddrinfo"))
    monkeypatch.setattr(socket.socket, "connect", no_network("connect"))
    monkeypatch.setattr(socket.socket, "connect_ex", no_network("connect"))
    corpus = prepare_corpus("auto", max_stories=100, verbose=False)
    assert attempts == []
    assert corpus.source == "synthetic"
    assert "did not answer" in corpus.reason


def test_tinystories_offline_is_a_clear_error(home):
    with pytest.raises(CorpusUnavailable, match="synthetic"):
        prepare_corpus("tinystories", max_stories=10, verbose=False)


def test_probe_of_an_unreachable_hub_switches_to_offline(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nobody answers
    assert hub_reachable(timeout=2) is False
    assert os.environ["HF_HUB_OFFLINE"] == "1"


def test_batch_sampler_windows():
    tokens = np.arange(1000, dtype=np.uint16)
    sampler = BatchSampler(tokens, batch_size=4, block_size=16, seed=1)
    x, y = sampler.batch(0)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x moved one token on
    assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(4, 15, dtype=torch.int64))  # contiguous


def test_batch_sampler_is_a_function_of_step():
    tokens = np.arange(5000, dtype=np.uint16)
    a = BatchSampler(tokens, 8, 32, seed=3)
    b = BatchSampler(tokens, 8, 32, seed=3)
    assert torch.equal(a.batch(7)[0], b.batch(7)[0])  # a resumed run sees the same batch
    assert not torch.equal(a.batch(7)[0], a.batch(8)[0])


def test_ranks_read_their_own_shards():
    tokens = np.arange(4000, dtype=np.uint16)
    r0 = BatchSampler(tokens, 16, 32, rank=0, world_size=2).batch(0)[1]
    r1 = BatchSampler(tokens, 16, 32, rank=1, world_size=2).batch(0)[1]
    assert int(r0.max()) < 2000 <= int(r1.min())


def test_batch_sampler_rejects_a_stream_too_short():
    with pytest.raises(ValueError, match="too short"):
        BatchSampler(np.arange(10, dtype=np.uint16), 2, 16)


def run_cli(*args, **env):
    return subprocess.run([sys.executable, "-m", "minillm.data.corpus", *args], capture_output=True, text=True,
                          env={**os.environ, **env})


def test_cli_prints_statistics(home):
    out = run_cli("--data", "synthetic", "--max-stories", "50", "--show", "1")
    assert out.returncode == 0, out.stderr
    assert "train:" in out.stdout and "50 stories" in out.stdout
    assert "--- validation story 1 ---" in out.stdout


@pytest.mark.parametrize("args, flag", [
    (["--max-stories", "x"], "--max-stories"),
    (["--max-stories", "0"], "--max-stories"),
    (["--data", "/no/such/file.txt"], "--data"),
    (["--bogus"], "--bogus"),
])
def test_cli_bad_flags_give_one_line(home, args, flag):
    out = run_cli(*args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and "Traceback" not in out.stderr
