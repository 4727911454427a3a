"""FLUX.2-klein-4B on one CUDA GPU with random weights: eager vs compiled vs regional, 1024x1024, 4 steps, bf16.

    python -m bench.device.flux2_klein_cuda [--out flux2_klein_cuda.json] [--runs 5]
    python -m bench.device.flux2_klein_cuda --dry-run     # scaled-down configs on CPU: checks the script

Run it from the repository root (or anywhere acceldemo is installed). No hub, no weights: the pipeline is the real
architecture (the configs acceldemo ships in acceldemo/models/configs/flux2-klein-4b/, each file naming where its
numbers come from; see also README.md here) with random weights, which cost the same FLOPs as trained ones. Per
variant it reports the first call (compile) and its compile seconds, warm latency by CUDA events (median, min–max)
and peak memory.
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import shutil
import statistics
import sys
import time
from importlib.resources import files
from pathlib import Path

from acceldemo.models import real_configs

VARIANTS = ("eager", "compiled", "regional")
# Opt-in (--variants ...,precompiled): the app's restart path, an AOTInductor package built, then loaded again.
EXTRA_VARIANTS = ("precompiled",)
PROMPT = "a red fox in fresh snow, soft winter light, detailed fur"
# Published figures to read the measured ones against (other stacks, other days: anchors, not targets).
ANCHORS = {
    "FLUX.2-klein-4B, 4 steps, 1024x1024, H100": "about 0.57 s",
    "FLUX.1-schnell, 4 steps, 1024x1024, H100": "about 0.72 s p50",
}

# The full-size architecture is the one acceldemo's catalog describes (acceldemo/models/configs/flux2-klein-4b/):
# Qwen3-4B as the text encoder (the pipeline reads hidden states 9, 18 and 27 of its 36 layers); the
# Flux2Transformer2DModel of klein-4B, 5 double-stream + 20 single-stream blocks, 24 heads x 128 = 3072 wide, text
# features = 3 stacked Qwen3 hidden states (3 x 2560), no guidance embedding (step-distilled); the FLUX.2 VAE (32
# latent channels, 2x2 patches -> 128 for the DiT); FLUX.2's scheduler with resolution-dependent shift.
MODEL = "flux2-klein-4b"
# The byte-level Qwen2 tokenizer of the embedded tiny model (package data of acceldemo): a prompt's token count is
# all that matters to the timings.
TOKENIZER = files("acceldemo.models.shapes") / "weights" / "tokenizer"

# --dry-run: the same architecture scaled down to run on CPU in seconds (depth of the text encoder kept: the
# pipeline reads its layer 27).
DRY_TEXT_ENCODER = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8)
DRY_TRANSFORMER = dict(num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                       joint_attention_dim=3 * 32, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4))
DRY_VAE = dict(block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4)


def _arguments(config: dict) -> dict:
    """A shipped config as constructor arguments: without its class name, and without a saved dtype (this script
    picks the dtype)."""
    return {key: value for key, value in config.items() if not key.startswith("_") and key != "torch_dtype"}


def configs(dry_run: bool) -> dict[str, dict]:
    """The component configs: the real sizes (acceldemo's shipped configs), or the --dry-run ones."""
    full = {"text_encoder": real_configs.component_config(MODEL, "text_encoder"),
            "transformer": real_configs.component_config(MODEL, "transformer"),
            "vae": real_configs.component_config(MODEL, "vae"),
            "scheduler": real_configs.scheduler_config(MODEL)}
    dry = {"text_encoder": DRY_TEXT_ENCODER, "transformer": DRY_TRANSFORMER, "vae": DRY_VAE, "scheduler": {}}
    return {name: {**_arguments(config), **(dry[name] if dry_run else {})} for name, config in full.items()}


def build_pipeline(config: dict[str, dict], device: str, dtype):
    """Flux2KleinPipeline from configs with random weights, built straight on `device` in `dtype` (fast init)."""
    import torch
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = Qwen2Tokenizer.from_pretrained(str(TOKENIZER))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            text_encoder = Qwen3ForCausalLM(Qwen3Config(**config["text_encoder"], pad_token_id=tokenizer.pad_token_id,
                                                        eos_token_id=tokenizer.eos_token_id))
            pipe = Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**config["scheduler"]),
                                      vae=AutoencoderKLFlux2(**config["vae"]), text_encoder=text_encoder,
                                      tokenizer=tokenizer, transformer=transformer_from(config), is_distilled=True)
    finally:
        torch.set_default_dtype(previous)
    pipe.set_progress_bar_config(disable=True)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    return pipe


def transformer_from(config: dict[str, dict]):
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(**config["transformer"]).eval()


class Clock:
    """Warm latency by CUDA events on a GPU (host timers would include launch gaps), by perf_counter on CPU."""

    def __init__(self, device: str):
        import torch

        self.torch, self.cuda = torch, device.startswith("cuda")

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def time(self, fn) -> float:
        if not self.cuda:
            started = time.perf_counter()
            fn()
            return time.perf_counter() - started
        start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000

    def reset_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> float | None:
        return self.torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None


def measure(pipe, config: dict, variant: str, backend: str, size: int, steps: int, runs: int, clock: Clock) -> dict:
    """One variant: compile as the recipe does, first call (compile) timed, then `runs` warm calls."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import compilation_time_metrics, counters

    torch._dynamo.reset()
    # A fresh transformer per variant: compile() changes the module in place, and eager must stay eager.
    pipe.transformer = None
    gc.collect()
    if clock.cuda:
        torch.cuda.empty_cache()
    device, dtype = pipe.text_encoder.device, pipe.text_encoder.dtype
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            pipe.transformer = transformer_from(config)
    finally:
        torch.set_default_dtype(previous)
    if variant == "compiled":
        pipe.transformer.compile(backend=backend, fullgraph=True, dynamic=False)
    elif variant == "regional":
        pipe.transformer.compile_repeated_blocks(backend=backend, fullgraph=True, dynamic=False)
    elif variant == "precompiled":
        packages = precompile(pipe)

    def call():
        pipe(prompt=PROMPT, height=size, width=size, num_inference_steps=steps, guidance_scale=1.0,
             generator=torch.Generator("cpu").manual_seed(0), output_type="pil")

    compile_before = sum(compilation_time_metrics.get("_compile.compile_inner", ()))
    graphs_before = counters["stats"]["unique_graphs"]
    clock.sync()
    started = time.perf_counter()
    call()
    clock.sync()
    first = time.perf_counter() - started
    compile_s = sum(compilation_time_metrics.get("_compile.compile_inner", ())) - compile_before
    graphs = counters["stats"]["unique_graphs"] - graphs_before
    extra = {}
    if variant == "precompiled":
        # The stand-in counts what it built and loaded, as the app's compile meter reads it.
        built = pipe.transformer.forward.events
        compile_s, graphs = built["build_seconds"], built["built"]
        precompile(pipe, packages)  # as after a restart: a fresh stand-in that finds the package on disk
        clock.sync()
        started = time.perf_counter()
        call()
        clock.sync()
        extra = {"packages_loaded": pipe.transformer.forward.events["loaded"],
                 "first_call_after_restart_s": time.perf_counter() - started}
        shutil.rmtree(packages, ignore_errors=True)
    call()  # a second warm-up: allocator and autotuning caches settle
    clock.reset_peak()
    warm = [clock.time(call) for _ in range(runs)]
    used = {"eager": None, "precompiled": "AOTInductor"}.get(variant, backend)
    return {"variant": variant, "backend": used, "first_call_s": first,
            "compile_s": compile_s, "graphs": graphs, "warm_s": {"median": statistics.median(warm), "min": min(warm),
                                                                 "max": max(warm), "runs": warm},
            "peak_memory_gib": clock.peak_gib(), **extra}


def precompile(pipe, folder: Path | None = None) -> Path:
    """The app's mode-compiled path on CPU/CUDA: AOTInductor packages in `folder` (a new temporary one by default)."""
    import tempfile

    from acceldemo.config import Settings
    from acceldemo.executors.artifacts import ArtifactStore, PrecompiledTransformer
    from acceldemo.hardware import HardwareRegistry

    folder = folder or Path(tempfile.mkdtemp(prefix="flux2-klein-aoti-"))
    registry = HardwareRegistry(Settings.from_env())
    hardware = registry.get("cuda" if pipe.transformer.device.type == "cuda" else "cpu")
    stand_in = PrecompiledTransformer.install(pipe, ArtifactStore(folder), "flux2-klein-4b-random", hardware)
    stand_in.label = "this size"
    return folder


def environment(device: str) -> dict:
    import diffusers
    import torch
    import transformers

    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else None
    return {"python": platform.python_version(), "torch": torch.__version__, "diffusers": diffusers.__version__,
            "transformers": transformers.__version__, "device": device, "gpu": gpu,
            "cuda": torch.version.cuda if gpu else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        help="scaled-down configs on CPU with dynamo's eager backend: checks the script, no figures")
    parser.add_argument("--out", type=Path, default=Path("flux2_klein_cuda.json"))
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--runs", type=int, default=5, help="warm calls per variant (default 5)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS + EXTRA_VARIANTS)} (default: the first three)")
    args = parser.parse_args(argv)

    import torch

    if args.dry_run:
        device, backend, size, steps, runs = "cpu", "eager", 64, 1, 2
    elif not torch.cuda.is_available():
        parser.error("no CUDA device here; --dry-run checks the script on CPU")
    else:
        device, backend, size, steps, runs = "cuda", "inductor", args.size, args.steps, args.runs
    started = time.perf_counter()
    config = configs(args.dry_run)
    pipe = build_pipeline(config, device, torch.bfloat16)
    built = time.perf_counter() - started
    print(f"built the pipeline in {built:.1f} s "
          f"(transformer {sum(p.numel() for p in pipe.transformer.parameters()) / 1e9:.2f} B parameters, "
          f"text encoder {sum(p.numel() for p in pipe.text_encoder.parameters()) / 1e9:.2f} B)", flush=True)
    clock = Clock(device)
    results = []
    for variant in args.variants.split(","):
        results.append(measure(pipe, config, variant, backend, size, steps, runs, clock))
        r = results[-1]
        memory = f", peak {r['peak_memory_gib']:.1f} GiB" if r["peak_memory_gib"] is not None else ""
        restart = f", after a restart {r['first_call_after_restart_s']:.2f} s" if variant == "precompiled" else ""
        print(f"{variant:>9}: first call {r['first_call_s']:.2f} s (compile {r['compile_s']:.1f} s, {r['graphs']} "
              f"graphs), warm {r['warm_s']['median']:.3f} s ({r['warm_s']['min']:.3f}–{r['warm_s']['max']:.3f})"
              f"{memory}{restart}", flush=True)
    by = {r["variant"]: r for r in results}
    ratios = {}
    if "eager" in by:
        ratios.update({f"{v}_vs_eager_warm": by[v]["warm_s"]["median"] / by["eager"]["warm_s"]["median"]
                       for v in ("compiled", "regional", "precompiled") if v in by})
    if "precompiled" in by:
        ratios["precompiled_restart_vs_first_call"] = by["precompiled"]["first_call_after_restart_s"] \
            / by["precompiled"]["first_call_s"]
    if "compiled" in by and "regional" in by and by["compiled"]["compile_s"]:
        ratios["regional_vs_compiled_compile_s"] = by["regional"]["compile_s"] / by["compiled"]["compile_s"]
    report = {"dry_run": args.dry_run, "size": size, "steps": steps, "dtype": "bfloat16", "configs": config,
              "environment": environment(device), "build_s": built, "results": results, "ratios": ratios,
              "anchors": ANCHORS, "seconds": time.perf_counter() - started}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, value in ratios.items():
        print(f"{name}: {value:.3f}")
    print("published anchors (other stacks; read, don't compare blindly):")
    for what, value in ANCHORS.items():
        print(f"  {what}: {value}")
    print(f"wrote {args.out} in {report['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
