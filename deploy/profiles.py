"""Cluster profiles: what an overlay's cluster needs besides the application settings.

An overlay ``k8s/overlays/<name>/`` pairs its ``settings.yaml`` (the application's settings) with
the profile of the same name here: the image tag, the pods' sizes, their placement (node selectors,
tolerations) and environment that is not a ``SPECSERVE_*`` setting. Change a profile, then
re-render: ``python -m deploy.kuberay --all --write``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PodSize:
    """Requests = limits (Guaranteed QoS: Ray's resource view matches what the pod really has)."""

    cpu: str
    memory: str
    gpus: int = 0

    def resources(self) -> dict[str, Any]:
        amounts: dict[str, Any] = {"cpu": self.cpu, "memory": self.memory}
        if self.gpus:
            amounts["nvidia.com/gpu"] = self.gpus
        return {"requests": dict(amounts), "limits": dict(amounts)}


@dataclass(frozen=True)
class ClusterProfile:
    """What an overlay's cluster needs besides the application settings (which are in its
    ``settings.yaml``): image tag, pod sizes, placement, extra (non-``SPECSERVE_``) environment."""

    name: str
    description: str
    image_tag_suffix: str
    head: PodSize
    worker_memory: str
    fetch: PodSize
    gpus_per_replica: int = 0
    head_node_selector: Mapping[str, str] = field(default_factory=dict)
    worker_node_selector: Mapping[str, str] = field(default_factory=dict)
    worker_tolerations: tuple[Mapping[str, Any], ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()


_LINUX = {"kubernetes.io/os": "linux"}

PROFILES: dict[str, ClusterProfile] = {
    "cpu": ClusterProfile(
        name="cpu",
        description="the Qwen pair on CPU nodes (x86, AVX2 or AVX-512 VNNI), as `make serve` runs it",
        image_tag_suffix="",
        head=PodSize(cpu="2", memory="4Gi"),
        # the Qwen pair on their GGUF blocks with float32 activations, embeddings and KV cache of
        # 8 slots x 4096 tokens: a replica measured 6.4 GB resident; room to spare
        worker_memory="12Gi",
        # converting the 1.5B pack peaks near 9 GB (README, "Model packs")
        fetch=PodSize(cpu="2", memory="12Gi"),
        head_node_selector={**_LINUX, "kubernetes.io/arch": "amd64"},
        worker_node_selector={**_LINUX, "kubernetes.io/arch": "amd64"},
    ),
    "gpu": ClusterProfile(
        name="gpu",
        description=(
            "Llama 3.3 70B target, Llama 3.2 1B draft (one tokenizer), one 192 GB B200 per replica: "
            "the engine runs a model on one device and the 70B bf16 weights alone are 141 GB"
        ),
        image_tag_suffix="-cuda",
        head=PodSize(cpu="4", memory="16Gi"),
        worker_memory="240Gi",
        fetch=PodSize(cpu="4", memory="16Gi"),
        gpus_per_replica=1,
        head_node_selector=_LINUX,
        worker_node_selector={**_LINUX, "nvidia.com/gpu.product": "NVIDIA-B200"},
        worker_tolerations=({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},),
        env=(
            # the Llama checkpoints are gated: a Secret `hf-token` with key `token` (optional)
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token", "optional": True}},
            },
        ),
    ),
}
