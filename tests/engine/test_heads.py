"""Draft heads (EAGLE, Medusa): runtimes equal to the trained modules, files checked against their
target, and proposers whose output is plain decoding's, token for token (tiny random heads)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from serve_app.engine.engine import SpecEngine
from serve_app.engine.engine_config import EngineConfig
from serve_app.engine.heads.eagle_head import EagleHead, dense_output_head
from serve_app.engine.heads.head_file import (
    HeadManifest,
    HeadMismatchError,
    head_paths,
    load_head,
    save_head,
    target_fingerprint,
)
from serve_app.engine.heads.medusa_heads import MedusaHeads
from serve_app.engine.model import DecoderModel
from serve_app.engine.params import SamplingParams, SpecOverride
from tests.conftest import make_tiny_hf_model
from training.networks import EagleNet, MedusaNet

KINDS = ("eagle", "medusa")


def _jitter(module: torch.nn.Module, scale: float, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * scale)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("tiny-target")
    make_tiny_hf_model(len(tiny_tokenizer), arch="qwen2", hidden=64).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_target(tiny_folder: Path) -> DecoderModel:
    return DecoderModel.from_pretrained(tiny_folder, torch.float32)


@pytest.fixture(scope="module")
def nets(tiny_target: DecoderModel) -> dict[str, torch.nn.Module]:
    eagle = EagleNet(tiny_target.cfg, tiny_target.hf_config, 128)
    _jitter(eagle, 0.05, 1)
    medusa = MedusaNet(tiny_target.cfg.hidden_size, 3)
    _jitter(medusa, 0.1, 2)
    return {"eagle": eagle, "medusa": medusa}


@pytest.fixture(scope="module")
def stored(tiny_folder: Path, nets) -> Path:
    fingerprint = target_fingerprint(tiny_folder)
    save_head(tiny_folder, HeadManifest("eagle", {"intermediate_size": 128}, "tiny", fingerprint),
              nets["eagle"].state_tensors())  # fmt: skip
    save_head(tiny_folder, HeadManifest("medusa", {"num_heads": 3}, "tiny", fingerprint),
              nets["medusa"].state_tensors())  # fmt: skip
    return tiny_folder


def test_eagle_runtime_computes_what_the_trained_module_does(tiny_target, tiny_folder, nets) -> None:
    net = nets["eagle"]
    tokens = torch.randint(0, tiny_target.cfg.vocab_size, (2, 9))
    features = torch.randn(2, 9, tiny_target.cfg.hidden_size)
    (expected,) = net(tokens, features, tiny_target.embed)
    head = EagleHead(tiny_target, net.state_tensors(), 128, None, dense_output_head(tiny_target, tiny_folder),
                     "dense")  # fmt: skip
    cache = head.new_cache(2, 32)
    slots = [cache.allocate(), cache.allocate()]
    got = head.forward(tokens, cache, slots, features=features)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_eagle_unrolled_training_steps_are_the_runtime_drafting_on_its_own_predictions(
    tiny_target, tiny_folder, nets
) -> None:
    """Step s of ``EagleNet.forward(steps=...)`` at row r must be what the runtime computes when it
    has the true pairs up to r - s in its cache and drafts s rows on its own predictions."""
    net = nets["eagle"]
    length, steps = 8, 3
    tokens = torch.randint(0, tiny_target.cfg.vocab_size, (1, length))
    features = torch.randn(1, length, tiny_target.cfg.hidden_size)
    preds = net(tokens, features, tiny_target.embed, steps)
    head = EagleHead(tiny_target, net.state_tensors(), 128, None, dense_output_head(tiny_target, tiny_folder),
                     "dense")  # fmt: skip
    cache = head.new_cache(1, 32)
    slot = cache.allocate()
    for row in range(steps - 1, length):
        first = row - steps + 1  # the true pairs 0 .. first are in the cache; rows after it are drafted
        cache.set_length(slot, 0)
        out = head.forward(tokens[:, : first + 1], cache, [slot], features=features[:, : first + 1])
        predicted = out[:, -1]
        torch.testing.assert_close(predicted, preds[0][:, first], atol=1e-5, rtol=1e-5)
        for step in range(1, steps):
            cache.set_length(slot, first + step)
            at = first + step
            predicted = head.forward(tokens[:, at : at + 1], cache, [slot], features=predicted[:, None])[:, 0]
            torch.testing.assert_close(predicted, preds[step][:, at], atol=1e-5, rtol=1e-5)


def test_medusa_runtime_computes_what_the_trained_module_does(tiny_target, tiny_folder, nets) -> None:
    net = nets["medusa"]
    output_head = dense_output_head(tiny_target, tiny_folder)
    heads = MedusaHeads(tiny_target, net.state_tensors(), 3, [0, 5, 7, 9], output_head, "dense")
    features = torch.randn(2, tiny_target.cfg.hidden_size)
    expected = net(features) @ output_head.T  # [B, K, V]
    got = heads.logits(features)
    kept = torch.tensor([0, 5, 7, 9])
    torch.testing.assert_close(got[..., kept], expected[..., kept], atol=1e-5, rtol=1e-5)
    outside = torch.ones(got.shape[-1], dtype=torch.bool)
    outside[kept] = False
    assert torch.isinf(got[..., outside]).all()  # a restricted head never proposes other tokens


def test_a_head_is_refused_for_another_target_altered_or_of_another_kind(stored, tmp_path, tiny_tokenizer):
    weights, manifest = head_paths(stored, "eagle")
    load_head(weights, "eagle", stored)  # its own target: fine
    with pytest.raises(HeadMismatchError, match="not a medusa head"):
        load_head(weights, "medusa", stored)
    other = tmp_path / "other"
    make_tiny_hf_model(len(tiny_tokenizer), arch="qwen2", hidden=64, seed=7).save_pretrained(other)
    with pytest.raises(HeadMismatchError, match=r"trained for target tiny .* not for the other one"):
        load_head(weights, "eagle", other, "the other one")
    altered = tmp_path / "eagle.safetensors"
    altered.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    (tmp_path / "eagle.json").write_text(manifest.read_text())
    with pytest.raises(HeadMismatchError, match="sha256"):
        load_head(altered, "eagle", stored)
    with pytest.raises(FileNotFoundError, match="specserve train-heads"):
        load_head(tmp_path / "missing.safetensors", "eagle", stored)


def _engine(folder: Path, kind: str, slots: int = 4) -> SpecEngine:
    config = EngineConfig(max_slots=slots, max_seq_len=128, spec_method=kind, spec_depth=3,
                          proposer_options={kind: {}})  # fmt: skip
    return SpecEngine.from_path(folder, config, dtype="float32")


@pytest.mark.parametrize("kind", KINDS)
def test_head_output_is_plain_output_greedy_seeded_and_mixed(stored, tiny_tokenizer, kind) -> None:
    engine = _engine(stored, kind)
    prompts = [tiny_tokenizer(t)["input_ids"] for t in ("def add(a, b):", "The quick brown", '{"name":')]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.9, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.7, top_p=0.9, seed=3, ignore_eos=True)]  # fmt: skip
    plain = engine.generate(prompts, params, SpecOverride(mode="off"))
    # one batch, requests of every mode side by side: the head's and plain ones
    modes = [SpecOverride(mode=kind), SpecOverride(mode="off"), SpecOverride(mode=kind)]
    spec = engine.generate(prompts, params, modes)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    drafted = sum(c.spec_stats.drafted for c in spec if c.spec_stats is not None)
    assert drafted > 0  # the head really proposed
    assert engine.scheduler.num_running == 0 if hasattr(engine.scheduler, "num_running") else True
    proposer = engine.proposers[kind]
    assert not getattr(proposer, "_slots", getattr(proposer, "_last", {}))  # nothing kept after release


def test_eagle_cache_holds_the_verified_pairs_only(stored, tiny_tokenizer) -> None:
    engine = _engine(stored, "eagle", slots=2)
    prompt = tiny_tokenizer("for i in range(10):")["input_ids"]
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                                    speculation=SpecOverride(mode="eagle"))  # fmt: skip
    proposer = engine.proposers["eagle"]
    for _ in range(4):
        engine.step()
        request = engine._requests.get(request_id)
        if request is None:
            break
        state = proposer._slots[request.slot]
        # every verified token's pair is in the head's cache or waiting to be fed
        cached = proposer.cache.lengths[request.slot]
        assert cached + state.pending == engine.cache.lengths[request.slot]


@pytest.mark.parametrize("kind", KINDS)
def test_head_trees_are_plain_output_greedy_and_coupled(stored, tiny_tokenizer, monkeypatch, kind) -> None:
    """The runner-up at each drafted position joins beside the chain (a tree per row), and the
    walked trees emit plain decoding's tokens: greedy and coupled rows, tree, chain and plain rows in
    one batch. The floor is 0 (every budgeted runner-up joins): random heads' would not pass a priced one."""
    monkeypatch.setattr("serve_app.engine.planner.alternative_floor", lambda *args: 0.0)
    engine = _engine(stored, kind, slots=6)
    prompts = [tiny_tokenizer(t)["input_ids"] for t in ("def add(a, b):", "The quick brown", '{"name":')] * 2
    params = [SamplingParams(max_tokens=20, temperature=0.0 if i % 2 == 0 else 0.9, seed=i, ignore_eos=True)
              for i in range(len(prompts))]  # fmt: skip
    plain = engine.generate(prompts, params, SpecOverride(mode="off"))
    proposer = engine.proposers[kind]
    drafted, trees = proposer.propose, []

    def watch(rows):
        drafts = drafted(rows)
        trees.extend(d.tree for d in drafts if d.tree is not None)
        return drafts

    proposer.propose = watch
    modes = [SpecOverride(mode=kind, tree_nodes=n) for n in (3, 2, 0, 1)]
    modes += [SpecOverride(mode="off"), SpecOverride(mode=kind, tree_nodes=3)]
    spec = engine.generate(prompts, params, modes)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert trees and max(len(t) - t.chain for t in trees) > 0  # alternatives were verified
    assert engine.cache.num_free == 6 and not getattr(proposer, "_slots", getattr(proposer, "_last", {}))
