"""llama.cpp's batch-1 decode on the same GGUF, through llama-cpp-python (a bench-only extra).

    pip install '.[bench]'      # builds llama.cpp from source (minutes); on a CPU without AVX-512:
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF" \\
        pip install '.[bench]'

Greedy (top_k 1), the prompt evaluated first; ms per step is measured from the first generated
token to the last, like pdserve's batch-1 figure in bench/offline.py.
"""
from __future__ import annotations

import logging
import time

logger = logging.getLogger("bench.llamacpp")


def llamacpp_unavailable() -> str | None:
    """Why llama.cpp cannot run here, or None."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        return f"llama-cpp-python is not installed ({exc}); pip install '.[bench]'"
    return None


def bench_llamacpp(prompt: list[int], output_len: int, threads: int, runs: int = 3) -> dict:
    """Batch-1 greedy decode of `output_len` tokens after `prompt`; the best of `runs` runs (the
    first also warms up). Returns llamacpp_batch1_ms_per_step, its system info and version."""
    import llama_cpp
    from engine.loading.loader import resolve_model_path
    path = resolve_model_path("smollm2")
    llm = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads,
                          n_ctx=len(prompt) + output_len + 8, n_batch=512, verbose=False)
    best = float("inf")
    for _ in range(runs):
        stamps = []
        for tok in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) == output_len:
                break
        best = min(best, (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1000)
    info = llama_cpp.llama_print_system_info().decode().strip()
    logger.info("llama.cpp %s: batch-1 %.2f ms/step (%s)", llama_cpp.__version__, best, info)
    return {"llamacpp_batch1_ms_per_step": best, "llamacpp_version": llama_cpp.__version__,
            "llamacpp_system_info": info}
