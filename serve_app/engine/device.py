"""Where and how the engine computes: the device, the dtype, and torch's thread count."""

from __future__ import annotations

import torch

from serve_app.engine.weights import QUANTIZED_FORMATS

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
AUTO_DTYPE = "auto"


def resolve_dtype(requested: str, weight_format: str, device: str | torch.device = "cpu") -> str:
    """``requested``, or for ``auto``: float32 where the weights are quantized (q8, gguf) on a CPU,
    else bfloat16.

    Our kernels quantize float32 activations; with bf16 activations every product and every small
    op between them converts, which measured 20% slower per decoded token on the 1.5B pack (AVX-512
    host, 71.7 against 59.9 ms) and ~10% on an AVX2-only one. Dense weights stay bf16: half the
    bytes of float32, and bf16 products are native on AMX / AVX-512 BF16 CPUs.
    """
    if requested != AUTO_DTYPE:
        if requested not in DTYPES:
            raise ValueError(f"dtype must be one of {(*DTYPES, AUTO_DTYPE)}, got {requested!r}")
        return requested
    cpu = str(device).startswith("cpu")
    return "float32" if cpu and weight_format in QUANTIZED_FORMATS else "bfloat16"


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
