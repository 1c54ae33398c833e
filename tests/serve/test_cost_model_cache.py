"""Where a replica's cost model comes from: the cluster, this machine's disk, or a profile."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from serve_app.cost_model_cache import disk_path, hardware_key, share_cost_model
from tests.conftest import make_tiny_engine, make_tiny_hf_model


class ClusterStats:
    """The two SharedStats calls the cost model uses, on a dict (the Redis side is tested elsewhere)."""

    def __init__(self) -> None:
        self.models: dict[tuple[str, str], dict[str, Any]] = {}

    def get_cost_model(self, hardware: str, pair: str) -> dict[str, Any] | None:
        return self.models.get((hardware, pair))

    def put_cost_model(self, hardware: str, pair: str, data: dict[str, Any]) -> None:
        self.models[(hardware, pair)] = data


def counting_profiles(engine) -> list[int]:
    calls: list[int] = []
    profile = engine.profile_cost_model

    def counted(*args, **kwargs):
        calls.append(1)
        return profile(*args, **kwargs)

    engine.profile_cost_model = counted
    return calls


def test_profiled_once_then_from_disk_then_from_the_cluster(tiny_tokenizer, tmp_path: Path) -> None:
    engine = make_tiny_engine(
        make_tiny_hf_model(tiny_tokenizer.vocab_size), tiny_tokenizer, proposers=["draft"]
    )
    profiles = counting_profiles(engine)
    cluster = ClusterStats()
    assert share_cost_model(engine, cluster, "tiny|tiny", 2, tmp_path) == "profiled"
    hardware = hardware_key(engine, 2)
    assert disk_path(tmp_path, hardware, "tiny|tiny").is_file()
    assert (hardware, "tiny|tiny") in cluster.models

    empty = ClusterStats()  # a new cluster (Redis restarted) on the same machine: from disk
    assert share_cost_model(engine, empty, "tiny|tiny", 2, tmp_path) == "disk"
    assert (hardware, "tiny|tiny") in empty.models  # and shared with the cluster
    assert share_cost_model(engine, empty, "tiny|tiny", 2, tmp_path) == "cluster"
    assert len(profiles) == 1
    assert engine.planner.cost is not None and "draft" in engine.planner.cost.draft

    # other threads or another pair are other hardware / pairs: profiled again
    assert share_cost_model(engine, ClusterStats(), "tiny|tiny", 1, tmp_path) == "profiled"
    assert share_cost_model(engine, ClusterStats(), "tiny|other", 2, tmp_path) == "profiled"
    assert len(profiles) == 3


def test_a_cached_model_without_this_engines_draft_is_not_used(tiny_tokenizer, tmp_path: Path) -> None:
    plain = make_tiny_engine(
        make_tiny_hf_model(tiny_tokenizer.vocab_size), tiny_tokenizer, proposers=["ngram"]
    )
    assert share_cost_model(plain, ClusterStats(), "tiny|-", 2, tmp_path) == "profiled"
    drafting = make_tiny_engine(
        make_tiny_hf_model(tiny_tokenizer.vocab_size), tiny_tokenizer, proposers=["draft"]
    )
    # same hardware key and pair, but the cached model prices no draft: profile instead
    assert share_cost_model(drafting, ClusterStats(), "tiny|-", 2, tmp_path) == "profiled"


def test_an_unwritable_cache_only_loses_the_cache(tiny_tokenizer, tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    engine = make_tiny_engine(
        make_tiny_hf_model(tiny_tokenizer.vocab_size), tiny_tokenizer, proposers=["ngram"]
    )
    assert share_cost_model(engine, ClusterStats(), "tiny|-", 2, blocked) == "profiled"
