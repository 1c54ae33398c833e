"""Where and how the engine computes: the device, the dtype, and torch's thread count."""

from __future__ import annotations

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when present, else the CPU; asking for CUDA without it is a ValueError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return torch.device(name)


def set_threads(threads: int | None) -> None:
    """Set torch's intra-op threads (None keeps torch's default: every core).

    The one place the project sets them. Call it from the thread that will run the model too:
    OpenMP's thread count is per calling thread, so a loop thread sets its own.
    """
    if threads:
        torch.set_num_threads(int(threads))
