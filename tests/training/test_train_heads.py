"""Training heads end to end on a tiny target: features, training, files the proposers load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from serve_app.engine.engine import SpecEngine
from serve_app.engine.engine_config import EngineConfig
from serve_app.engine.heads.eagle_head import dense_output_head
from serve_app.engine.heads.head_file import HeadManifest, save_head, target_fingerprint
from serve_app.engine.model import DecoderModel
from serve_app.engine.params import SamplingParams, SpecOverride
from tests.conftest import TINY_CORPUS, make_tiny_hf_model
from training.corpus import CorpusSpec, corpus_files, token_chunks
from training.features import extract_shards, read_shard
from training.trainer import HeadTrainer, TrainSpec, head_index, train


@pytest.fixture()
def corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(6):
        (root / f"file{i}.py").write_text("".join(TINY_CORPUS[i % 4 :] * 3))
    return root


def test_corpus_is_deterministic_and_held_out_files_are_apart(corpus, tiny_tokenizer) -> None:
    spec = CorpusSpec(seed=3, chunk_tokens=32, roots=(str(corpus),), chat_every=0)
    held = CorpusSpec(seed=3, chunk_tokens=32, roots=(str(corpus),), held_out=True)
    assert not set(corpus_files(spec)) & set(corpus_files(held))
    first = list(token_chunks(tiny_tokenizer, spec))
    assert first and first == list(token_chunks(tiny_tokenizer, spec))
    assert all(len(c) == 32 for c in first)


def test_training_learns_and_resumes_and_the_heads_serve_exactly(corpus, tiny_tokenizer, tmp_path) -> None:
    folder = tmp_path / "target"
    make_tiny_hf_model(len(tiny_tokenizer), arch="qwen2", hidden=64).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    model = DecoderModel.from_pretrained(folder, torch.float32)
    spec = CorpusSpec(seed=0, chunk_tokens=32, roots=(str(corpus),), chat_every=0)
    work = tmp_path / "work"
    shards = extract_shards(model, token_chunks(tiny_tokenizer, spec), work, 2, 4, batch=2)
    assert len(shards) == 2
    data = read_shard(shards[0])
    assert data["features"].shape == (4, 32, 64) and data["choices"].shape == (4, 32)
    mtimes = [p.stat().st_mtime_ns for p in shards]
    assert extract_shards(model, token_chunks(tiny_tokenizer, spec), work, 2, 4) == shards  # resumed
    assert [p.stat().st_mtime_ns for p in shards] == mtimes  # kept, not recomputed

    def trainer(epochs: int) -> HeadTrainer:
        spec = TrainSpec(
            epochs=epochs, batch_chunks=2, lr=3e-3, eagle_intermediate=128, warmup_steps=2, eagle_steps=2
        )
        rows = dense_output_head(model, folder)
        index = head_index(None, rows.shape[0])
        return HeadTrainer(spec, model.cfg, model.hf_config, model.embed, rows, index)

    fresh = trainer(6)
    before = fresh.evaluate(shards)
    after = train(fresh, shards, work / "checkpoint.pt")
    assert after["eagle.top1.0"] > before["eagle.top1.0"] + 0.1
    assert after["eagle.top1.1"] > before["eagle.top1.1"] + 0.1  # drafting on its own predictions too
    assert after["medusa.loss"] < before["medusa.loss"] - 1.0
    resumed = trainer(6)
    assert resumed.load_checkpoint(work / "checkpoint.pt", shards) == (6, 0)  # resumes at its end
    assert resumed.load_checkpoint(work / "checkpoint.pt", shards[:1]) is None  # other shards: start over
    torch.testing.assert_close(resumed.nets["eagle"].state_tensors()["fc.weight"],
                               fresh.nets["eagle"].state_tensors()["fc.weight"])  # fmt: skip

    fingerprint = target_fingerprint(folder)
    for kind, net in fresh.nets.items():
        config = {"intermediate_size": 128} if kind == "eagle" else {"num_heads": 3}
        save_head(folder, HeadManifest(kind, config, "tiny", fingerprint), net.state_tensors())
    prompt = tiny_tokenizer("def add(a, b):\n")["input_ids"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for kind in ("eagle", "medusa"):
        config = EngineConfig(max_slots=2, max_seq_len=128, spec_method=kind, spec_depth=3,
                              proposer_options={kind: {}})  # fmt: skip
        engine = SpecEngine.from_path(folder, config, dtype="float32")
        (plain,) = engine.generate([prompt], params, SpecOverride(mode="off"))
        (spec_run,) = engine.generate([prompt], params, SpecOverride(mode=kind))
        assert spec_run.token_ids == plain.token_ids
        assert spec_run.spec_stats.accepted > 0  # trained on text like this: it guesses right sometimes
