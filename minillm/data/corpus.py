"""Corpora and token streams: from stories to the ``(x, y)`` batches a model trains on.

A corpus is TinyStories (through ``datasets``), a local ``.txt`` or ``.jsonl`` file, or the
stories of :mod:`minillm.data.synthetic`. ``auto`` takes TinyStories when the hub answers (or
it is already cached here) and the synthetic stories otherwise, and says which and why.
Either way the text is tokenized once into ``uint16`` files (GPT-2's 50,257 ids fit in 16
bits), one per split, with ``<|endoftext|>`` before every story, and read back through
``np.memmap``: the OS pages in only what a batch touches, so a corpus larger than memory costs nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

from minillm.settings import cache_dir, quick
from minillm.data.synthetic import generate_stories
from minillm.data.tokenizer import ENDOFTEXT, get_tokenizer

SPLITS = ("train", "validation")
TINYSTORIES = "roneneldan/TinyStories"
VALIDATION_PERCENT = 5  # for sources without their own validation split


def default_max_stories(source: str) -> int | None:
    """How many stories to take when not told: all of TinyStories (2.1M), 40,000 synthetic ones,
    and 4,000 in QUICK mode. 40,000 synthetic stories are 6.3M tokens, five times what the
    ``cpu`` preset trains on, and take about 13 s to write on two cores; the 200,000 this once
    was cost a first run a minute to three for tokens no training ever read."""
    if quick():
        return 4_000
    return 40_000 if source == "synthetic" else None


# ----------------------------------------------------------------------------- the corpus


@dataclass(frozen=True)
class Corpus:
    """A tokenized corpus on disk: ``train.bin`` and ``validation.bin`` plus ``meta.json``."""

    directory: Path
    meta: dict

    @property
    def source(self) -> str:
        return self.meta["source"]

    @property
    def reason(self) -> str:
        """Why this source was used (``auto`` explains its choice here)."""
        return self.meta.get("reason", "")

    def tokens(self, split: str) -> np.memmap:
        """The split's token ids, memory-mapped: ``<eot> story <eot> story ...``."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
        return np.memmap(self.directory / f"{split}.bin", dtype=np.uint16, mode="r")

    def token_counts(self, split: str, vocab_size: int) -> torch.Tensor:
        """How often each token id occurs in the split (the index is the id), as int64: a
        checkpoint keeps its training split's, so a draft model proposes only the tokens it
        learned (:mod:`minillm.speedups.speculative.draft_vocab`)."""
        return torch.from_numpy(np.bincount(self.tokens(split), minlength=vocab_size)[:vocab_size].astype(np.int64))

    def stats(self, split: str) -> dict:
        """``stories``, ``tokens`` and ``bytes`` (UTF-8 text, for bits per byte) of a split."""
        return self.meta["splits"][split]

    def summary(self) -> str:
        """A few lines a person can read: where the stories came from and how many there are."""
        lines = [f"corpus: {self.source}  ({self.reason})", f"cache:  {self.directory}"]
        for split in SPLITS:
            s = self.stats(split)
            lines.append(
                f"{split:>10}: {s['stories']:>9,} stories {s['tokens']:>12,} tokens "
                f"({s['tokens'] / max(s['stories'], 1):.0f} tokens/story, "
                f"{s['bytes'] / max(s['tokens'] - s['stories'], 1):.2f} bytes/token)"
            )
        return "\n".join(lines)


def prepare_corpus(
    source: str = "auto",
    *,
    max_stories: int | None = None,
    seed: int = 0,
    rebuild: bool = False,
    verbose: bool = True,
) -> Corpus:
    """Tokenize a corpus once and return it; later calls with the same arguments reuse the cache.

    ``source`` is ``auto``, ``tinystories``, ``synthetic`` or a path to a ``.txt``/``.jsonl``
    file. ``max_stories`` caps the training split (validation is capped at a twentieth of it);
    ``None`` means the source's default (see :func:`default_max_stories`).
    """
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if verbose else (lambda msg: None)
    if source == "auto":
        try:
            return _build(TinyStoriesSource(), max_stories, seed, rebuild, log,
                          reason="auto: TinyStories was available")
        except CorpusUnavailable:
            why = "auto: the Hugging Face hub did not answer (offline?) and TinyStories is not cached here"
        except Exception as err:  # a partial download, a changed dataset: fall back, loudly
            why = f"auto: TinyStories failed to load ({type(err).__name__}: {str(err)[:120]})"
        log(f"{why}; using the synthetic children's stories instead.")
        return _build(SyntheticSource(seed), max_stories, seed, rebuild, log,
                      reason=f"{why}; synthetic stories used")
    if source == "tinystories":
        return _build(TinyStoriesSource(), max_stories, seed, rebuild, log, reason="asked for")
    if source == "synthetic":
        return _build(SyntheticSource(seed), max_stories, seed, rebuild, log, reason="asked for")
    path = Path(source).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"data source {source!r} is neither auto, tinystories, synthetic nor an existing file"
        )
    return _build(FileSource(path), max_stories, seed, rebuild, log, reason=f"local file {path}")


def hub_reachable(timeout: float = 3.0) -> bool:
    """Ask the Hugging Face hub, once and briefly, whether it answers.

    Without this, ``datasets`` would retry for a long time on a machine with no network. When
    the hub does not answer we switch it to offline mode for this process, so any later call
    fails at once instead of waiting through the same retries.
    """
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes"}:
        return False
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    answered = threading.Event()

    def probe() -> None:
        try:
            urllib.request.urlopen(f"{endpoint}/api/datasets/{TINYSTORIES}", timeout=timeout).close()
            answered.set()
        except Exception:
            pass

    # A thread bounds DNS resolution too, which socket timeouts do not cover.
    worker = threading.Thread(target=probe, daemon=True)
    worker.start()
    worker.join(timeout)
    if not answered.is_set():
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
        for module, names in (("huggingface_hub.constants", ["HF_HUB_OFFLINE"]),
                              ("datasets.config", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"])):
            if module in sys.modules:
                for name in names:
                    setattr(sys.modules[module], name, True)
    return answered.is_set()


# ----------------------------------------------------------------------------- sources


class CorpusUnavailable(RuntimeError):
    """A source that cannot be read here (no network, no cached copy)."""


class TinyStoriesSource:
    """The TinyStories dataset from the Hugging Face hub (or the local ``datasets`` cache)."""

    name = "tinystories"
    key = "tinystories"

    def stories(self, split: str, limit: int | None) -> Iterator[str]:
        hub_reachable()  # when it does not answer, only a copy cached earlier can load, at once
        from datasets import load_dataset

        try:
            ds = load_dataset(TINYSTORIES, split=split, cache_dir=str(cache_dir("huggingface")))
        except (ConnectionError, OSError) as err:
            raise CorpusUnavailable(
                f"TinyStories could not be loaded ({type(err).__name__}): the Hugging Face hub did "
                "not answer and no copy is cached here. Use --data synthetic, auto, or a local file."
            ) from err
        n = len(ds) if limit is None else min(limit, len(ds))
        for row in ds.select(range(n)):
            yield row["text"].strip()


class SyntheticSource:
    """Stories from :mod:`minillm.data.synthetic`; a story's split is decided by its text."""

    name = "synthetic"

    def __init__(self, seed: int) -> None:
        import inspect

        from minillm.data import synthetic

        self.seed = seed
        # The generator's own source is part of the cache key: edit a template, get new stories.
        version = hashlib.sha1(inspect.getsource(synthetic).encode()).hexdigest()[:8]
        self.key = f"synthetic-{version}-seed{seed}"

    def stories(self, split: str, limit: int) -> Iterator[str]:
        # An endless supply: ``limit`` is always set (see default_max_stories).
        # Draw stories in order and keep those whose hash puts them in this split: identical
        # texts always land in the same split, so train and validation never share a story.
        return _take_split(generate_stories(sys.maxsize, self.seed), split, limit)


class FileSource:
    """A local ``.txt`` or ``.jsonl`` file of stories, loaded with ``datasets``."""

    name = "file"

    def __init__(self, path: Path) -> None:
        self.path = path.resolve()
        st = self.path.stat()
        fingerprint = hashlib.sha1(f"{self.path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
        self.key = f"file-{self.path.stem}-{fingerprint}"

    def stories(self, split: str, limit: int | None) -> Iterator[str]:
        from datasets import load_dataset

        kw = dict(data_files=str(self.path), split="train", cache_dir=str(cache_dir("huggingface")))
        if self.path.suffix in (".jsonl", ".json"):
            ds = load_dataset("json", **kw)
            if "text" not in ds.column_names:
                raise ValueError(f"{self.path}: every JSONL line needs a 'text' field (found {ds.column_names})")
            texts: Iterable[str] = ds["text"]
        else:
            (whole,) = load_dataset("text", sample_by="document", **kw)["text"]
            texts = split_stories(whole)
        return _take_split((t.strip() for t in texts if t and t.strip()), split, limit)


def split_stories(text: str) -> list[str]:
    """A text file's stories: separated by ``<|endoftext|>`` if it has any, else by blank lines."""
    parts = text.split(ENDOFTEXT) if ENDOFTEXT in text else text.replace("\r\n", "\n").split("\n\n")
    return [p.strip() for p in parts if p.strip()]


def split_of(text: str) -> str:
    """A story's split, decided by its text alone (about 5% go to validation)."""
    bucket = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "big") % 100
    return "validation" if bucket < VALIDATION_PERCENT else "train"


def _take_split(stories: Iterable[str], split: str, limit: int | None) -> Iterator[str]:
    count = 0
    for text in stories:
        if limit is not None and count >= limit:
            return
        if split_of(text) == split:
            count += 1
            yield text


# ----------------------------------------------------------------------------- tokenizing


def _build(src, max_stories: int | None, seed: int, rebuild: bool, log, reason: str) -> Corpus:
    if max_stories is None:
        max_stories = default_max_stories(src.name)
    if max_stories is not None and max_stories < 1:
        raise ValueError(f"max_stories must be at least 1, not {max_stories}")
    directory = cache_dir("data", f"{src.key}-{'all' if max_stories is None else max_stories}")
    if (directory / "meta.json").is_file() and not rebuild:
        return Corpus(directory, {**json.loads((directory / "meta.json").read_text()), "reason": reason})
    start = time.perf_counter()
    limits = {"train": max_stories, "validation": None if max_stories is None else max(max_stories // 20, 1)}
    splits = {}
    for split in SPLITS:
        log(f"reading and tokenizing {src.name} ({split})...")
        splits[split] = write_token_file(src.stories(split, limits[split]), directory / f"{split}.bin")
        if splits[split]["stories"] == 0:
            raise ValueError(f"{src.name}: the {split} split came out empty; give it more stories")
    meta = {
        "source": src.name, "key": src.key, "reason": reason, "seed": seed,
        "max_stories": max_stories, "tokenizer": "gpt2", "splits": splits,
        "seconds": round(time.perf_counter() - start, 2),
    }
    tmp = directory / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2))
    tmp.replace(directory / "meta.json")  # written last: its presence marks a complete cache
    log(f"tokenized {sum(s['tokens'] for s in splits.values()):,} tokens in {meta['seconds']}s -> {directory}")
    return Corpus(directory, meta)


def write_token_file(stories: Iterable[str], path: Path, chunk: int = 2048) -> dict:
    """Tokenize stories into ``path`` as uint16 ``<eot> story <eot> story ...``; returns counts.

    Written to a temporary name and renamed at the end, so a killed run leaves no half file.
    """
    tok = get_tokenizer()
    if tok.n_vocab > np.iinfo(np.uint16).max + 1:
        raise ValueError("token ids do not fit in uint16")
    counts = {"stories": 0, "tokens": 0, "bytes": 0}
    tmp = path.with_suffix(".bin.tmp")
    with open(tmp, "wb") as f:
        for batch in _chunks(stories, chunk):
            for ids in tok.encode_batch(batch):
                np.asarray([tok.eot, *ids], dtype=np.uint16).tofile(f)
                counts["tokens"] += len(ids) + 1
            counts["stories"] += len(batch)
            counts["bytes"] += sum(len(s.encode()) for s in batch)
    tmp.replace(path)
    return counts


def _chunks(items: Iterable[str], size: int) -> Iterator[list[str]]:
    items = iter(items)
    while batch := list(islice(items, size)):
        yield batch


# ----------------------------------------------------------------------------- batches


class BatchSampler:
    """Random windows of a token stream as ``(x, y)`` training pairs, ``y`` = ``x`` shifted by one.

    The batch for step ``s`` depends only on ``(seed, rank, s)``: resuming at step ``s`` needs
    no sampler state, and under data parallelism each rank draws from its own contiguous
    shard of the stream, so ranks never train on the same window in a step.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        batch_size: int,
        block_size: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        device: str | torch.device = "cpu",
    ) -> None:
        if batch_size < 1 or block_size < 1:
            raise ValueError(f"batch_size and block_size must be positive (got {batch_size}, {block_size})")
        shard = len(tokens) // world_size
        if shard < block_size + 1:
            raise ValueError(
                f"a shard of {shard:,} tokens is too short for windows of {block_size + 1} tokens; "
                "use more stories or a shorter context"
            )
        self.tokens = tokens[rank * shard:(rank + 1) * shard]
        self.batch_size, self.block_size = batch_size, block_size
        self.seed, self.rank = seed, rank
        self.device = torch.device(device)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng((self.seed, self.rank, step))
        starts = rng.integers(0, len(self.tokens) - self.block_size, size=self.batch_size)
        windows = np.stack([self.tokens[s:s + self.block_size + 1] for s in starts]).astype(np.int64)
        xy = torch.from_numpy(windows)
        if self.device.type == "cuda":
            xy = xy.pin_memory().to(self.device, non_blocking=True)
        else:
            xy = xy.to(self.device)
        return xy[:, :-1], xy[:, 1:]


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    from minillm.cli import ArgumentParser, UsageError

    parser = ArgumentParser(prog="python -m minillm.data.corpus", description="Prepare a corpus and print its statistics.")
    parser.add_argument("--data", default="auto", help="auto | tinystories | synthetic | path to .txt/.jsonl (default: auto)")
    parser.add_argument("--max-stories", type=int, default=None, help="training stories to take (default: the source's own)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic stories (default: 0)")
    parser.add_argument("--rebuild", action="store_true", help="tokenize again even if cached")
    parser.add_argument("--show", type=int, default=1, help="how many validation stories to print (default: 1)")
    args = parser.parse_args(argv)
    if args.max_stories is not None and args.max_stories < 1:
        raise UsageError(f"--max-stories must be at least 1, not {args.max_stories}")
    try:
        corpus = prepare_corpus(args.data, max_stories=args.max_stories, seed=args.seed, rebuild=args.rebuild)
    except (FileNotFoundError, CorpusUnavailable, ValueError) as err:
        raise UsageError(f"--data {args.data}: {err}") from None
    print(corpus.summary())
    tokens, tok = corpus.tokens("validation"), get_tokenizer()
    bounds = [*np.flatnonzero(np.asarray(tokens) == tok.eot), len(tokens)]  # each story's <eot>, then the end
    for i, (start, end) in enumerate(zip(bounds[:args.show], bounds[1:])):
        print(f"\n--- validation story {i + 1} ---\n{tok.decode(tokens[start + 1:end].tolist())}")
    return 0


if __name__ == "__main__":
    from minillm.cli import run

    run(main, prog="python -m minillm.data.corpus")
