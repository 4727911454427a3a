"""The ZeroGPU path on a real CUDA GPU: the real `spaces` package (SPACES_ZERO_GPU on) against a stand-in of the
platform's device API on loopback (tests/fakes/zerogpu_api.py) that lends this machine's own GPU — no patches.

    python -m bench.device.zerogpu_cuda [--model tiny-flux2-klein] [--size 512x512] [--steps 4] [--draws 4]
                                        [--mode eager|compiled]
                                        [--out bench-results/zerogpu_cuda.json]
    python -m bench.device.zerogpu_cuda --dry-run --out /tmp/dry.json   # CPU, seconds: checks the script

Run it from the repository root, in an environment with requirements-cuda.txt installed. The parent never touches
CUDA (as on ZeroGPU); each draw goes through `spaces.GPU`: schedule, the fork (the first draw; the stand-in then says
the GPU stayed idle, so later draws reuse the child), the move of the pipeline to the GPU, the draw, release. It
prints and writes per draw: the seconds asked and used, the pipeline call's own seconds inside the child, and so what
the lending cost (used − call): the first draw pays the fork and the move, the next ones only the round trip.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def gpu_uuid() -> str:
    """The first GPU's UUID, from nvidia-smi: asking torch would initialise CUDA in the parent (ZeroGPU forbids it)."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True, text=True,
                         check=True).stdout
    return out.split()[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-flux2-klein")
    parser.add_argument("--size", default="512x512")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--draws", type=int, default=4)
    parser.add_argument("--mode", default="eager", choices=("eager", "compiled"),
                        help="compiled: a warm-up builds the shape's AOTInductor package in a lent call first")
    parser.add_argument("--out", type=Path, default=Path("bench-results/zerogpu_cuda.json"))
    parser.add_argument("--dry-run", action="store_true",
                        help="on a CPU-only torch, with the tests' patches and the CPU as the lent device")
    args = parser.parse_args(argv)

    from tests.fakes import zerogpu_api

    api = zerogpu_api.ZeroGpuApi(reuse=True, uuid="GPU-standin" if args.dry_run else gpu_uuid())
    os.environ.update(SPACES_ZERO_GPU="true", SPACES_ZERO_DEVICE_API_URL=api.url,
                      ZEROGPU_OFFLOAD_DIR=tempfile.mkdtemp(prefix="zerogpu-offload-"))
    if args.dry_run:
        zerogpu_api.patch_cpu_torch_for_spaces()
    from acceldemo.config import Settings
    from acceldemo.hardware import prepare_process

    settings = Settings.from_env()
    prepare_process(settings)  # imports spaces before torch (here: after the dry run's patches)
    import torch

    if args.dry_run:
        zerogpu_api.keep_tensors_on_cpu_in_the_child()
        zerogpu_api.lend_the_cpu()

    from acceldemo.builder import build_engine
    from acceldemo.records import GenerateParams

    assert not torch.cuda.is_initialized(), "the parent must not initialise CUDA on ZeroGPU"
    engine = build_engine(settings)
    ask = dict(prompt="a red fox in fresh snow", model=args.model, hardware="zerogpu", mode=args.mode,
               resolution=args.size, steps=args.steps)
    warm_up_s = None
    if args.mode == "compiled":
        started = time.perf_counter()
        engine.warm_up(GenerateParams(**ask))
        warm_up_s = round(time.perf_counter() - started, 2)
        print(json.dumps({"warm_up_s": warm_up_s}), flush=True)
    rows = []
    for i in range(args.draws):
        result = engine.generate(GenerateParams(**ask, seed=i))
        lease = result.gpu_lease
        rows.append({"draw": i, "asked_s": lease.asked_seconds, "used_s": round(lease.used_seconds, 4),
                     "pipeline_call_s": round(lease.call_seconds, 4),
                     "lending_s": round(lease.used_seconds - lease.call_seconds, 4),
                     "child_pid": lease.pid, "load_s": round(result.load_seconds, 4),
                     "new_graphs": result.new_graphs, "packages": dict(result.package_events),
                     "size": list(result.image.size)})
        print(json.dumps(rows[-1]), flush=True)
    engine.close()
    report = {"model": args.model, "mode": args.mode, "warm_up_s": warm_up_s, "dry_run": args.dry_run,
              "size": args.size, "steps": args.steps,
              "torch": torch.__version__, "device_api_calls": [path for path, _ in api.calls], "draws": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    api.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
