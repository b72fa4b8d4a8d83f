import os
import shutil
import subprocess
import sys

import pytest

from minillm.data.tokenizer import bpe_files, get_tokenizer, load_encoding


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer()


def test_known_gpt2_ids(tok):
    assert tok.encode("hello world") == [31373, 995]
    assert tok.encode("Hello, world!") == [15496, 11, 995, 0]
    assert tok.encode(" the") == [262]


def test_vocabulary_and_end_of_text(tok):
    assert tok.n_vocab == 50257
    assert tok.eot == 50256
    assert tok.decode([tok.eot]) == "<|endoftext|>"


@pytest.mark.parametrize("text", [
    "", "a", "Once upon a time, there was a little girl named Lily.",
    "  leading and trailing spaces  ", "tabs\tand\nnewlines\r\n\n\n",
    "naïve café, Ünïcödé", "日本語のテキスト", "emoji: 🦕🙂👨‍👩‍👧 and flags 🇫🇷",
    "x" * 1000, "mixed 123 numbers 4.56e-7 and symbols <>{}[]",
])
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_multibyte_characters_split_across_tokens(tok):
    ids = tok.encode(" 🦕")
    assert len(ids) > 1  # no single token: the emoji's four bytes are spread over pieces
    assert b"".join(tok.token_bytes(i) for i in ids) == " 🦕".encode()
    assert "\ufffd" in tok.decode(ids[:1])  # half a character is not a character


def test_batch_encode_matches_single(tok):
    texts = ["one story", "another, longer story with 🦕", ""]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_special_token_only_when_allowed(tok):
    assert tok.encode("<|endoftext|>", allow_special=True) == [tok.eot]
    plain = tok.encode("<|endoftext|>")
    assert tok.eot not in plain and tok.decode(plain) == "<|endoftext|>"


def test_corrupted_bpe_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    vocab, encoder = bpe_files()
    bad_vocab = tmp_path / "vocab.bpe"
    shutil.copy(vocab, bad_vocab)
    with open(bad_vocab, "a") as f:
        f.write("x y\n")
    with pytest.raises(ValueError, match="[Hh]ash"):
        load_encoding(bad_vocab, encoder)


def test_tiktoken_writes_only_inside_the_project_cache(tmp_path):
    code = (
        "import os; from minillm.data.tokenizer import get_tokenizer; get_tokenizer(); "
        "print(os.environ['TIKTOKEN_CACHE_DIR'])"
    )
    env = {k: v for k, v in os.environ.items() if k != "TIKTOKEN_CACHE_DIR"}
    env["MINILLM_HOME"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    cache = out.stdout.strip()
    assert cache.startswith(str(tmp_path))
    assert len(os.listdir(cache)) == 2  # the two BPE files, keyed by tiktoken
