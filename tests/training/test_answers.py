"""The target's own answers as training data: questions from documented functions, greedy answers
recorded with the features a prefill would give, packed into resumable shards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from serve_app.engine.engine import SpecEngine
from serve_app.engine.engine_config import EngineConfig
from serve_app.engine.model import DecoderModel
from serve_app.engine.params import SamplingParams
from tests.conftest import make_tiny_hf_model
from training.answers import GROUP, answer, answer_shards, chat_prompt, pack, questions
from training.corpus import CorpusSpec
from training.features import read_shard, target_features

SOURCE = '''
def area(width, height):
    """Return the area of a rectangle given its width and height."""
    return width * height


def _private(x):
    """Never asked about: private."""


def undocumented(x):
    return x


class Box:
    def volume(self, depth):
        """Compute the volume of the box for a depth."""
'''


@pytest.fixture()
def target(tmp_path: Path, tiny_tokenizer) -> Path:
    folder = tmp_path / "target"
    make_tiny_hf_model(len(tiny_tokenizer), arch="qwen2", hidden=64).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


def test_questions_come_from_documented_public_functions(tmp_path: Path) -> None:
    root = tmp_path / "src"
    root.mkdir()
    for i in range(4):
        (root / f"shapes{i}.py").write_text(SOURCE * 3)
    spec = CorpusSpec(seed=1, roots=(str(root),))
    asked = list(questions(spec))
    assert asked and asked == list(questions(spec))  # deterministic
    assert all("_private" not in q and "undocumented" not in q for q in asked)
    assert any("area(width, height)" in q or "`area`" in q for q in asked)
    assert any("volume(depth)" in q or "`volume`" in q for q in asked)  # self is not a parameter


def test_answers_are_plain_greedy_decoding_with_the_features_of_a_prefill(target, tiny_tokenizer) -> None:
    model = DecoderModel.from_pretrained(target, torch.float32)
    prompts = [chat_prompt(tiny_tokenizer, q) for q in ("def add", "the quick fox", "for i in", "tags")]
    conversations = answer(model, prompts, eos_ids=[0], max_new=12, batch=3)  # 4 prompts over 3 slots
    engine = SpecEngine.from_path(target, EngineConfig(max_slots=2, max_seq_len=128), dtype="float32")
    for prompt, conversation in zip(prompts, conversations, strict=True):
        (plain,) = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))
        assert conversation.tokens[: len(prompt)].tolist() == prompt
        answered = [*conversation.tokens[len(prompt) :].tolist(), int(conversation.choices[-1])]
        assert answered == plain.token_ids  # its last choice is the EOS or the 12th token
        features, choices = target_features(model, [conversation.tokens.tolist()])
        torch.testing.assert_close(conversation.features, features[0], atol=1e-4, rtol=1e-4)
        assert conversation.choices.tolist() == choices[0].tolist()


def test_answer_shards_pack_conversations_and_resume(target, tiny_tokenizer, tmp_path: Path) -> None:
    model = DecoderModel.from_pretrained(target, torch.float32)
    root = tmp_path / "src"
    root.mkdir()
    for i in range(8):
        (root / f"shapes{i}.py").write_text(SOURCE * 12)
    spec = CorpusSpec(seed=0, chunk_tokens=16, roots=(str(root),))
    assert len(list(questions(spec))) >= GROUP
    work = tmp_path / "answers"
    shards = answer_shards(model, tiny_tokenizer, spec, [0], work, 1, max_new=6, batch=8)
    assert len(shards) == 1
    data = read_shard(shards[0])
    assert data["tokens"].shape[1] == 16 and data["features"].shape[1:] == (16, 64)
    mtime = shards[0].stat().st_mtime_ns
    assert answer_shards(model, tiny_tokenizer, spec, [0], work, 1, max_new=6) == shards
    assert shards[0].stat().st_mtime_ns == mtime  # resumed, not recomputed
    packed = pack(answer(model, [[1, 2, 3]] * 2, [0], 6), 4)
    assert packed["tokens"].shape[1] == 4 and packed["tokens"][0, :3].tolist() == [1, 2, 3]
