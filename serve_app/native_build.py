"""`python -m serve_app.native_build`: compile our C++ kernels (``serve_app/engine/kernels``).

Run by ``make install``. Uses torch's extension builder (ninja, g++) and writes the library into
``serve_app/engine/kernels/_build/``, where the engine loads it. Compiled for AVX2 + FMA + F16C when
the CPU has them, else as portable scalar code (also exact in the rows). A failed build says why
and exits non-zero; the dense weight formats work without it.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from serve_app.engine.kernels import BUILD_DIR, Q8_NAME, Q8_SOURCE


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build(verbose: bool = False) -> Path:
    """Compile the Q8 kernel; returns the library's path."""
    from torch.utils.cpp_extension import load

    vectorized = {"avx2", "fma", "f16c"} <= cpu_flags()
    # Exactly the instructions the kernel uses (not -march=native): an image built here runs on any
    # AVX2 host.
    flags = ["-O3", "-mavx2", "-mfma", "-mf16c"] if vectorized else ["-O3"]
    work = BUILD_DIR / "work"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    load(Q8_NAME, [str(Q8_SOURCE)], extra_cflags=flags, build_directory=str(work), verbose=verbose)
    built = next(work.glob(f"{Q8_NAME}*.so"))
    target = BUILD_DIR / built.name
    shutil.copy2(built, target)
    shutil.rmtree(work)
    return target


def main() -> int:
    try:
        path = build(verbose="-v" in sys.argv)
    except Exception as exc:  # the dense formats still work; say why this one will not
        print(f"specserve: building the q8 kernel failed ({type(exc).__name__}: {exc}); "
              "runtime.weight_format q8 stays unavailable", file=sys.stderr)  # fmt: skip
        return 1
    print(f"specserve: q8 kernel built: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
