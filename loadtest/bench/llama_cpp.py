"""The strongest peer on a CPU: llama.cpp (through ``llama-cpp-python``) on the very GGUF file our
pack was converted from, greedy, one request at a time, with the benchmark's thread count.

Present only where ``llama-cpp-python`` is installed (``pip install llama-cpp-python``; it builds
llama.cpp for this CPU); otherwise the method is skipped with a message. On a VM that lists AMX in
its CPU flags without letting processes use the tiles (this workplace's Sapphire Rapids slices), a
``GGML_NATIVE`` build dies in its AMX kernel (``ldtilecfg``, a general protection fault); build it
with AMX off (BENCHMARKS.md, tenth session, gives the flags). The prompt is fed as our
token ids (the GGUF carries the same vocabulary), so both engines see the same prompt; EOS does
not stop it, as it does not stop our methods.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from loadtest.bench.results import Method, Run

NAME = "llama.cpp-plain"


def llama_cpp_method(store: Any, pack: str, n: int, threads: int, context: int) -> Method | None:
    """The method, or None (with a message on stderr) where llama.cpp or the GGUF is unavailable."""
    try:
        import llama_cpp
    except ImportError:
        print(f"[bench] skipping {NAME}: llama-cpp-python is not installed", file=sys.stderr)
        return None
    if pack not in store.packs:
        print(
            f"[bench] skipping {NAME}: {pack} is not a model pack (no GGUF to give llama.cpp)",
            file=sys.stderr,
        )
        return None
    path = store.gguf(pack)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, verbose=False)  # fmt: skip

    def run(ids: list[int]) -> Run:
        llm.reset()
        start = time.perf_counter()
        first = None
        tokens: list[int] = []
        for token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            first = first or time.perf_counter()
            tokens.append(int(token))
            if len(tokens) == n:
                break
        end = time.perf_counter()
        return Run(tokens, end - start, None if first is None else end - first)

    version = getattr(llama_cpp, "__version__", "?")
    note = f"llama.cpp (llama-cpp-python {version}) on {path.name}, greedy, {threads} threads"
    return Method(NAME, run, close=llm.close, description=note)
