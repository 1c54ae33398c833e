"""The machine under ``specserve bench``: what it is (CPU, threads, versions), how fast it copies
memory, and what decoding one token must read from it (the roofline).

Roofline: decoding one token reads every decoder weight once. With tied embeddings the tensor is
both the embedding (one row read) and the output head (read in full), and ``weight_bytes`` counts
it once; untied, the embedding table is not read per token, so its bytes are subtracted. The KV
cache read (at most a few MB at these lengths) is reported but not counted. Bandwidth is a
``b.copy_(a)`` of 1 GiB, counted as bytes read + bytes written. A speculative method can beat the
roofline: it emits several tokens per read of the weights.
"""

from __future__ import annotations

import platform
import re
import statistics
import time
from pathlib import Path
from typing import Any

import torch


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Median bytes/s of ``b.copy_(a)`` for an ``nbytes`` tensor, counting read + write (2 x nbytes)."""
    a = torch.ones(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(repeats + 1):  # the first one faults the pages in
        start = time.perf_counter()
        b.copy_(a)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times[1:])


def bytes_per_token(model: Any) -> int:
    """Weight bytes read per decoded token (see the module docstring)."""
    embed = model.embed.numel() * model.embed.element_size()
    return model.weight_bytes - (0 if model.lm_head is model.embed else embed)


def kv_bytes_per_position(model: Any) -> int:
    """KV cache bytes read per context position per decoded token."""
    cfg = model.cfg
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize


def machine_info() -> dict[str, Any]:
    """CPU model, torch threads, library versions and the date, for the JSON record."""
    import transformers
    from transformers.utils import is_sklearn_available

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    return {"cpu": cpu.group(1) if cpu else platform.processor(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "sklearn": is_sklearn_available(),  # transformers adapts its assistant's threshold with it
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}  # fmt: skip
