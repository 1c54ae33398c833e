"""GGUF -> bf16 safetensors conversion, one at a time per store (it needs the whole model in RAM)."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

DTYPE = "bfloat16"  # what a converted pack holds

Converter = Callable[[Path, Path], None]


def convert_gguf(gguf_file: Path, out_dir: Path) -> None:
    """Dequantize a GGUF into a bf16 safetensors folder (config, weights, tokenizer) with transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf_file.name}
    tok = AutoTokenizer.from_pretrained(gguf_file.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, dtype=torch.bfloat16, **kwargs)
    try:
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out_dir)
        tok.save_pretrained(out_dir)
    finally:
        del model, tok
        gc.collect()


@contextlib.contextmanager
def conversion_lock(path: Path, progress: bool) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path``; say so on stderr when waiting for another process."""
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                print(f"waiting for another conversion ({path})", file=sys.stderr)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
