"""Our compiled kernels, built once by the install step: the Q8 product (``q8_linear.cpp``), the
Q4_K and Q6_K products (``q4k_linear.cpp``, ``q6k_linear.cpp``), a layer's small float32 steps
(``layer_ops.cpp``: RMS norm, the attention of few queries; ``cached_attention.cpp``: a step's rotary
embedding, cache write and attention in one call), a step's decoder layers in one call
(``decoder_layers.cpp``), one Python module (``module.cpp``).

``serve_app.native_build`` compiles the C++ sources with torch's extension builder into
``_build/`` beside them (``make install`` runs it); this package only loads what was built, so the
engine never compiles or shells out. ``kernels_module()`` is None when the library is not built (a
clear error then names the command that builds it).
"""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

SOURCE_DIR = Path(__file__).resolve().parent
BUILD_DIR = SOURCE_DIR / "_build"
MODULE_NAME = "specserve_kernels"
SOURCES = tuple(
    SOURCE_DIR / name
    for name in (
        "isa.cpp",
        "q8_linear.cpp",
        "q4k_linear.cpp",
        "q6k_linear.cpp",
        "layer_ops.cpp",
        "cached_attention.cpp",
        "decoder_layers.cpp",
        "module.cpp",
    )
)
BUILD_COMMAND = "python -m serve_app.native_build"


@cache
def kernels_module() -> ModuleType | None:
    """The built extension, or None when it has not been built here."""
    import torch  # noqa: F401  (the extension links against torch's libraries)

    built = sorted(BUILD_DIR.glob(f"{MODULE_NAME}*.so"))
    if not built:
        return None
    spec = importlib.util.spec_from_file_location(MODULE_NAME, built[-1])
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE_NAME] = module
    spec.loader.exec_module(module)
    return module


def require_kernels(weight_format: str) -> ModuleType:
    """The extension, or a RuntimeError saying that ``weight_format`` needs it and how to build it."""
    module = kernels_module()
    if module is None:
        message = f"the {weight_format} weight format needs our kernels, which are not built here"
        raise RuntimeError(f"{message}: run `{BUILD_COMMAND}` (`make install` does)")
    return module
