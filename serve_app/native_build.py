"""`python -m serve_app.native_build`: compile our C++ kernels (``serve_app/engine/kernels``).

Run by ``make install``. Uses torch's extension builder (ninja, g++) and writes the library into
``serve_app/engine/kernels/_build/``, where the engine loads it. Compiled for AVX2 + FMA + F16C when
the CPU has them, else as portable scalar code (also exact in the rows); the AVX-512 VNNI functions
carry their own target attribute and are chosen at run time where the CPU has them, so one build
serves both kinds of host (``kernels/isa.cpp``). A failed build says why
and exits non-zero; the dense weight formats work without it.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from serve_app.engine.kernels import BUILD_DIR, MODULE_NAME, SOURCES


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build(verbose: bool = False) -> Path:
    """Compile the kernels into one library; returns its path."""
    from torch.utils.cpp_extension import load

    vectorized = {"avx2", "fma", "f16c"} <= cpu_flags()
    # Exactly the instructions the kernel uses (not -march=native): an image built here runs on any
    # AVX2 host.
    flags = ["-O3", "-mavx2", "-mfma", "-mf16c"] if vectorized else ["-O3"]
    # at::parallel_for splits the output features over torch's threads only when compiled with
    # OpenMP; the library then shares torch's own libgomp (same soname, loaded first), one pool.
    flags.append("-fopenmp")
    work = BUILD_DIR / "work"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    sources = [str(s) for s in SOURCES]
    load(MODULE_NAME, sources, extra_cflags=flags, extra_ldflags=["-fopenmp"], build_directory=str(work),
         verbose=verbose)  # fmt: skip
    built = next(work.glob(f"{MODULE_NAME}*.so"))
    for stale in BUILD_DIR.glob("*.so"):  # an earlier build's library (or an older module name)
        stale.unlink()
    target = BUILD_DIR / built.name
    shutil.copy2(built, target)
    shutil.rmtree(work)
    return target


def main() -> int:
    try:
        path = build(verbose="-v" in sys.argv)
    except Exception as exc:  # the dense formats still work; say why this one will not
        print(f"specserve: building the kernels failed ({type(exc).__name__}: {exc}); "
              "the q8 and gguf weight formats stay unavailable", file=sys.stderr)  # fmt: skip
        return 1
    print(f"specserve: kernels built: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
