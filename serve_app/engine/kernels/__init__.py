"""Our compiled kernels: the Q8 product (``q8_linear.cpp``), built once by the install step.

``serve_app.native_build`` compiles the C++ source with torch's extension builder into
``_build/`` beside it (``make install`` runs it); this package only loads what was built, so the
engine never compiles or shells out. ``q8_module()`` is None when the library is not built (a
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
Q8_NAME = "specserve_q8"
Q8_SOURCE = SOURCE_DIR / "q8_linear.cpp"
BUILD_COMMAND = "python -m serve_app.native_build"


@cache
def q8_module() -> ModuleType | None:
    """The built Q8 extension, or None when it has not been built here."""
    import torch  # noqa: F401  (the extension links against torch's libraries)

    built = sorted(BUILD_DIR.glob(f"{Q8_NAME}*.so"))
    if not built:
        return None
    spec = importlib.util.spec_from_file_location(Q8_NAME, built[-1])
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules[Q8_NAME] = module
    spec.loader.exec_module(module)
    return module


def require_q8() -> ModuleType:
    """The Q8 extension, or a RuntimeError saying how to build it."""
    module = q8_module()
    if module is None:
        message = f"the q8 weight format needs its kernel, which is not built here: run `{BUILD_COMMAND}`"
        raise RuntimeError(message + " (`make install` does)")
    return module
