"""`specserve train-heads` on a real pack (SmolLM2): tiny heads trained for real, written with
their manifest, served by the eagle / medusa proposers with output equal to plain decoding."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from serve_app.engine.engine import SpecEngine
from serve_app.engine.engine_config import EngineConfig
from serve_app.engine.heads.head_file import HeadMismatchError
from serve_app.engine.params import SamplingParams, SpecOverride
from serve_app.engine.proposers.registry import proposer_specs

ROOT = Path(__file__).resolve().parents[2]
KINDS = [s.name for s in proposer_specs() if s.trained]
PROMPTS = ["def parse_args(argv):", "import os\n\ndef list_files(folder):\n    return"]


@pytest.mark.slow
@pytest.mark.pack("smollm2-135m-instruct")
def test_train_heads_on_smollm2_and_serve_them_exactly(smollm2_path: Path, qwen_pair, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "specserve", "train-heads", "--model", str(smollm2_path),
               "--threads", "2", "--tokens", "4096", "--held-out-tokens", "1024", "--epochs", "1",
               "--answers", "64", "--answer-tokens", "48",
               "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "heads")]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["tokens"] > 4096 and set(summary["heads"]) == set(KINDS)  # files + the answers
    for kind in KINDS:
        for split in ("held_out", "held_out_answers"):
            held_out = {k: v for k, v in summary[split].items() if k.startswith(kind)}
            assert held_out and all(v >= 0.0 for v in held_out.values())
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=4, ignore_eos=True)
    for kind in KINDS:
        options = {
            kind: {"path": summary["heads"][kind], "min_confidence": 0.0}
        }  # heads this small are unsure
        config = EngineConfig(max_slots=4, max_seq_len=256, spec_method=kind, spec_depth=3,
                              proposer_options=options)  # fmt: skip
        engine = SpecEngine.from_path(smollm2_path, config, "bfloat16", "cpu")
        prompts = [engine.encode_prompt(p) for p in PROMPTS]
        for params in (greedy, seeded):
            plain = engine.generate(prompts, params, SpecOverride(mode="off"))
            spec = engine.generate(prompts, params, SpecOverride(mode=kind))
            assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
            assert sum(c.spec_stats.drafted for c in spec) > 0
        # a head trained for SmolLM2 is refused for the Qwen target, naming both
        with pytest.raises(HeadMismatchError, match="trained for target"):
            other = EngineConfig(max_slots=1, max_seq_len=64, spec_method=kind, proposer_options=options)
            SpecEngine.from_path(qwen_pair[1], other, "bfloat16", "cpu")
