"""Tests for serve_app.engine.detokenizer.IncrementalDetokenizer.

Two tiny tokenizers are built in memory (byte-level BPE like GPT-2/Llama 3/SmolLM, and
SentencePiece-style BPE with byte fallback like Llama 2/Mistral), so most tests need no model pack;
one test also runs on the real SmolLM2 tokenizer when its pack is in the model store.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from serve_app.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world, this is a plain ASCII sentence.",
    "Café crème brûlée — naïve façade, São Paulo, Zürich.",
    "你好，世界！今天天气很好。",
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧 plus flags 🇫🇷🇯🇵.",
    "Mixed: ÅÄÖ ĳ ñ → ∑ x² ≠ ∞; русский текст; ελληνικά; עברית; 🙂 ok 😺.",
    "  leading spaces\n\nnewlines\ttabs   and trailing  ",
]

CORPUS = [
    "hello world the quick brown fox jumps over the lazy dog",
    "the world is big and the dog is lazy hello again",
    "café naïve 你好 世界 😀",
] * 20


def _byte_level_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def _sentencepiece_style_bpe() -> PreTrainedTokenizerFast:
    """Llama-2-like: '▁' marks spaces, a '▁' is prepended, unknown characters fall back to bytes."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS[:2], trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    sp = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    sp.normalizer = tok.normalizer
    sp.pre_tokenizer = None
    sp.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    sp.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=sp, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def byte_bpe() -> PreTrainedTokenizerFast:
    return _byte_level_bpe()


@pytest.fixture(scope="module")
def sp_bpe() -> PreTrainedTokenizerFast:
    return _sentencepiece_style_bpe()


def _smollm2_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "specserve" / "models" / "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smollm2() -> PreTrainedTokenizerBase:
    path = _smollm2_dir()
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"SmolLM2 model pack not in the store ({path}); fetch it with `specserve models`")
    return AutoTokenizer.from_pretrained(str(path))


def _stream(tokenizer, ids: list[int], chunk_sizes=None, **kwargs) -> list[str]:
    """Push `ids` through a detokenizer (one at a time, or in the given chunk sizes); return chunks."""
    detok = IncrementalDetokenizer(tokenizer, kwargs.pop("prompt", []), **kwargs)
    chunks, i = [], 0
    sizes = iter(chunk_sizes or [])
    while i < len(ids):
        n = next(sizes, 1)
        chunks.append(detok.push(ids[i : i + n]))
        i += n
    chunks.append(detok.flush())
    return chunks


def _check_texts(tokenizer) -> None:
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        chunks = _stream(tokenizer, ids)
        assert not any("\ufffd" in c for c in chunks), (text, chunks)
        assert "".join(chunks) == tokenizer.decode(ids, skip_special_tokens=True) == text


def test_byte_level_bpe_multibyte_one_token_at_a_time(byte_bpe) -> None:
    # Sanity: the tiny vocab really splits characters into several tokens.
    pieces = [byte_bpe.decode([i]) for i in byte_bpe.encode("😀", add_special_tokens=False)]
    assert len(pieces) > 1 and "\ufffd" in "".join(pieces)
    _check_texts(byte_bpe)


def test_sentencepiece_style_multibyte_and_leading_space(sp_bpe) -> None:
    _check_texts(sp_bpe)
    ids = sp_bpe.encode("hello world", add_special_tokens=False)
    assert sp_bpe.convert_ids_to_tokens(ids[:1])[0].startswith("▁")
    # The decoder drops the first token's leading space; so does the stream by default ...
    assert "".join(_stream(sp_bpe, ids)) == "hello world"
    # ... and keeps it when continuing the prompt (a completion appended to its prompt).
    prompt = sp_bpe.encode("the dog", add_special_tokens=False)
    assert "".join(_stream(sp_bpe, ids, prompt=prompt, continue_prompt=True)) == " hello world"


def test_multi_token_pushes(byte_bpe) -> None:
    # Speculation pushes several accepted tokens at once.
    rng = random.Random(0)
    for text in TEXTS:
        ids = byte_bpe.encode(text, add_special_tokens=False)
        sizes = [rng.randint(1, 5) for _ in ids]
        chunks = _stream(byte_bpe, ids, sizes)
        assert "".join(chunks) == text and not any("\ufffd" in c for c in chunks)


def test_special_tokens_skipped(byte_bpe) -> None:
    eos = byte_bpe.eos_token_id
    ids = byte_bpe.encode("hello 😀", add_special_tokens=False)
    ids = [eos, *ids[:2], eos, *ids[2:], eos]
    assert "".join(_stream(byte_bpe, ids)) == "hello 😀"
    keep = IncrementalDetokenizer(byte_bpe, skip_special_tokens=False)
    assert keep.push([eos]) + keep.flush() == "<eos>"


def test_flush_releases_incomplete_character(byte_bpe) -> None:
    ids = byte_bpe.encode("ok 😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_bpe, [])
    out = "".join(detok.push([i]) for i in ids[:-1])  # the emoji's last byte never comes
    assert "\ufffd" not in out
    assert out + detok.flush() == byte_bpe.decode(ids[:-1])
    assert detok.flush() == ""


def test_continue_prompt_same_text_for_byte_level(byte_bpe) -> None:
    prompt = byte_bpe.encode("the lazy dog 你", add_special_tokens=False)
    ids = byte_bpe.encode(" 好 hello 😀", add_special_tokens=False)
    assert "".join(_stream(byte_bpe, ids, prompt=prompt, continue_prompt=True)) == " 好 hello 😀"


def test_random_byte_level_streams_equal_full_decode(byte_bpe) -> None:
    # A model may emit any ids, including byte sequences that are not valid UTF-8. Byte-level
    # decoding replaces invalid bytes locally, so the stream still matches the full decode.
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(len(byte_bpe)) for _ in range(rng.randint(1, 40))]
        sizes = [rng.randint(1, 4) for _ in ids]
        assert "".join(_stream(byte_bpe, ids, sizes)) == byte_bpe.decode(ids, skip_special_tokens=True)


def test_random_text_sentencepiece_style(sp_bpe) -> None:
    alphabet = list("abcdefghij     ,.!?") + list("éüñ你好世界😀🎉ж")
    rng = random.Random(3)
    for _ in range(100):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        ids = sp_bpe.encode(text, add_special_tokens=False)
        sizes = [rng.randint(1, 3) for _ in ids]
        chunks = _stream(sp_bpe, ids, sizes)
        assert "".join(chunks) == sp_bpe.decode(ids, skip_special_tokens=True)
        assert not any("\ufffd" in c for c in chunks)


def test_real_smollm2_tokenizer(smollm2) -> None:
    _check_texts(smollm2)
    rng = random.Random(2)
    for _ in range(20):
        ids = [rng.randrange(len(smollm2)) for _ in range(rng.randint(1, 60))]
        assert "".join(_stream(smollm2, ids)) == smollm2.decode(ids, skip_special_tokens=True)
