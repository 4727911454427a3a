"""Section 3: time to the first image in a fresh process, with empty compile caches and after a restart.

The parent runs `python -m acceldemo.bench.restart` as child processes, each with its own ACCELDEMO_CACHE_DIR
(and so its own TORCHINDUCTOR_CACHE_DIR, see `acceldemo.config`): "cold" children get empty cache folders,
"restart" children reuse the folder a cold child filled. The tiny model itself is shared through a link,
so both pay the same load and only the compile caches differ. With ACCELDEMO_PRECOMPILE=auto (the product's
default) mode compiled saves AOTInductor packages there; with off, only inductor's own caches.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .figures import Figure, Spread, Target, ratios

CHILD_TIMEOUT_S = 900


def _first_image(model: str, hardware: str, mode: str, size: str) -> dict:
    """In the child: import, load, compile and run once; what each part cost, as one JSON-able dict."""
    from ..config import Settings
    from ..hardware import prepare_process

    started = time.perf_counter()
    settings = Settings.from_env()
    prepare_process(settings)  # its own cache dir's compiler caches, before torch loads

    from ..builder import build_engine
    from ..models.catalog import get_model
    from ..records import GenerateParams

    # Imports cost the same with or without caches: resolve the pipeline's lazy imports before the clock starts.
    get_model(model).family.pipeline_class()
    imported = time.perf_counter()
    engine = build_engine(settings)
    try:
        result = engine.generate(GenerateParams(prompt="restart", model=model, hardware=hardware, mode=mode,
                                                resolution=size, seed=0))
        packages_loaded = engine.artifacts.counts()["loaded"]
        packages_fetched = engine.artifacts.counts()["fetched"]
    finally:
        engine.close()
    from torch._dynamo.utils import compilation_time_metrics

    def spent(phase: str) -> float:
        return sum(compilation_time_metrics.get(phase, ()))

    # Where compile time went: dynamo tracing the Python code, and the backend (code generation, or on a cache hit
    # loading the cached graph and its compiled kernels).
    return {"import_s": imported - started, "first_image_s": time.perf_counter() - imported,
            "load_s": result.load_seconds, "compile_s": result.compile_seconds, "new_graphs": result.new_graphs,
            "compile_cache_hits": result.compile_cache_hits, "dynamo_trace_s": spent("bytecode_tracing"),
            "backend_s": spent("OutputGraph.call_user_compiler"), "packages_loaded": packages_loaded,
            "packages_fetched": packages_fetched}


def _run_child(cache_dir: Path, model: str, hardware: str, mode: str, backend: str, size: str,
               precompile: str, extra_env: dict[str, str] | None = None) -> dict:
    env = {**os.environ, "ACCELDEMO_CACHE_DIR": str(cache_dir), "ACCELDEMO_CPU_COMPILE_BACKEND": backend,
           "ACCELDEMO_PRECOMPILE": precompile, **(extra_env or {})}
    # The child's own cache dir decides every compiler cache; an inherited override would defeat the test.
    for variable in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCH_NEURONX_NEFF_CACHE_DIR",
                     "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"):
        env.pop(variable, None)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "acceldemo.bench.restart", "--model", model, "--hardware", hardware,
                           "--mode", mode, "--size", size], env=env, capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT_S, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"restart child failed ({done.returncode}): {done.stderr.strip()[-600:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "process_s": wall}


def new_cache(work: Path, name: str, models_dir: Path) -> Path:
    """An empty cache folder `work/name` for a host started afresh, sharing the bench's downloaded models."""
    folder = work / name
    folder.mkdir()
    (folder / "models").symlink_to(models_dir.resolve(), target_is_directory=True)
    return folder


def measure_restart(models_dir: Path, model: str, hardware: str, mode: str, backend: str, size: str,
                    cold_runs: int, restart_runs: int, precompile: str = "auto", log=print) -> list[Figure]:
    """Cold starts (each in empty cache folders) and restarts (on the first cold start's folders), interleaved."""
    work = Path(tempfile.mkdtemp(prefix="acceldemo-bench-restart-"))
    try:
        def fresh_cache(name: str) -> Path:
            return new_cache(work, name, models_dir)

        kept = fresh_cache("kept")
        cold = [_run_child(kept, model, hardware, mode, backend, size, precompile)]
        log(f"  cold start {cold[-1]['first_image_s']:.1f} s to the first image")
        restart = []
        for i in range(max(cold_runs, restart_runs)):
            if i < restart_runs:
                restart.append(_run_child(kept, model, hardware, mode, backend, size, precompile))
                log(f"  restart {restart[-1]['first_image_s']:.1f} s ({restart[-1]['compile_cache_hits']} cache hits, "
                    f"{restart[-1]['packages_loaded']} precompiled packages loaded)")
            if len(cold) < cold_runs:
                cold.append(_run_child(fresh_cache(f"cold{i + 1}"), model, hardware, mode, backend, size,
                                       precompile))
                log(f"  cold start {cold[-1]['first_image_s']:.1f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def spread(runs: list[dict], field: str) -> dict:
        return Spread.of(r[field] for r in runs).__dict__

    detail = {"backend": backend, "mode": mode, "size": size, "precompile": precompile,
              **{f"{name}_{field}": spread(runs, field) for name, runs in (("cold", cold), ("restart", restart))
                 for field in ("first_image_s", "compile_s", "dynamo_trace_s", "backend_s", "load_s", "import_s",
                               "process_s")},
              "restart_cache_hits": [r["compile_cache_hits"] for r in restart],
              "restart_packages_loaded": [r["packages_loaded"] for r in restart],
              "cold_first_image_runs": [c["first_image_s"] for c in cold]}
    # Each restart against the cold start just before it: both ran under the machine's load of that moment.
    before = [cold[min(i, len(cold) - 1)] for i in range(len(restart))]
    ratio = ratios([r["first_image_s"] for r in restart], [c["first_image_s"] for c in before])
    whole = ratios([r["process_s"] for r in restart], [c["process_s"] for c in before])
    kept = {field: detail[f"restart_{field}"]["median"]
            for field in ("first_image_s", "compile_s", "dynamo_trace_s", "backend_s", "load_s")}
    packaged = min(detail["restart_packages_loaded"]) > 0
    if packaged:
        if_missed = (f"a restart loaded its AOTInductor package instead of compiling ({kept['compile_s']:.1f} s of "
                     f"compile left); of its {kept['first_image_s']:.1f} s, loading the pipeline takes "
                     f"{kept['load_s']:.1f} s, which a restart cannot skip")
    elif backend == "inductor":
        if_missed = (f"of a restart's {kept['first_image_s']:.1f} s, {kept['compile_s']:.1f} s are still compile: "
                     f"dynamo traces the transformer again ({kept['dynamo_trace_s']:.1f} s) and inductor loads its "
                     f"cached graph and kernels ({kept['backend_s']:.1f} s); loading the pipeline takes "
                     f"{kept['load_s']:.1f} s. The inductor cache removes code generation only; the AOTInductor "
                     "packages of ACCELDEMO_PRECOMPILE=auto remove the tracing too")
    else:
        if_missed = f"the {backend} backend keeps no persistent compile cache: a restart is a cold start"
    caches = "AOTInductor packages" if precompile == "auto" else "inductor's caches only"
    suffix = "" if precompile == "auto" else "_inductor_cache"
    return [
        Figure(f"restart_vs_cold{suffix}", 3,
               f"restart ÷ cold start, time to first image ({mode} {size}, {backend}, {caches})", "ratio", ratio,
               Target("<=", 0.10) if precompile == "auto" else None,
               note="after imports: load + compile (or cache hit) + 1 image; fresh processes, own cache dirs",
               detail=detail, if_missed=if_missed),
        Figure(f"restart_vs_cold_process{suffix}", 3,
               f"restart ÷ cold start, whole process (with Python imports; {caches})", "ratio",
               whole, note="imports of torch/diffusers are the same in both and the cache cannot shorten them"),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m acceldemo.bench.restart", description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--hardware", required=True)
    parser.add_argument("--mode", required=True)
    parser.add_argument("--size", required=True)
    args = parser.parse_args(argv)
    print(json.dumps(_first_image(args.model, args.hardware, args.mode, args.size)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
