"""Section 12: LoRA styles and edits — the first image after a style switch ÷ a warm call that switches nothing, the
graphs a switch compiles (none), and an edit ÷ a generation of the same size and steps; tiny-shapes 64x64, 4 steps,
compiled and eager side by side.

The section's engine is the in-process bench's own kind (`InProcessBench`) with a LoRA folder of two styles made
here: random rank-4 LoRAs over the attention and feed-forward layers of tiny-shapes' transformer, in diffusers' key
format. Its pipelines get the engine's one hot-swap slot; a switch loads the other style's file into it in place or
only rewrites its strength (see `executors.styles`).
"""
from __future__ import annotations

import dataclasses
import io
import statistics
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from ..records import GenerateParams, Mode, Shape
from .figures import Figure, Spread, Target, interleaved, log, ratios

if TYPE_CHECKING:
    from .plans import InProcessBench

MODEL = "tiny-shapes"
SHAPE = Shape(64, 64)
STEPS = 4
MODES = ("compiled", "eager")
PROMPT = "a red circle on a blue background, top left"
STYLES = ("ink", "neon")
RANK = 4
# The switches, in turn (each differs from the one before it, the last from the first): a style file swapped in,
# another, no style (strength 0), the first again at half strength, only its strength, the second at half.
SWITCHES = (("ink", 1.0), ("neon", 1.0), (None, None), ("ink", 0.5), ("ink", 1.0), ("neon", 0.5))
# Warm calls that switch nothing before each switch.
WARM_PER_SWITCH = 2
# Rounds (a switch and its warm calls) and interleaved edit/generation runs, by plan.
ROUNDS = {"full": 24, "quick": 12, "smoke": 1}
EDIT_RUNS = {"full": 15, "quick": 8, "smoke": 1}


def make_styles(folder: Path, names: tuple[str, ...] = STYLES, rank: int = RANK, seed: int = 0) -> list[str]:
    """`folder/<MODEL>/<name>.safetensors` for each name: a diffusers-format LoRA state dict over every attention and
    feed-forward `Linear` of the model's transformer (random weights, × 0.3); the layers' names."""
    import diffusers
    import torch
    from safetensors.torch import save_file

    from ..models.shapes import trained_model_dir

    transformer = diffusers.Flux2KleinPipeline.from_pretrained(trained_model_dir()).transformer
    layers = [(name, module) for name, module in transformer.named_modules()
              if isinstance(module, torch.nn.Linear) and (".attn." in name or ".ff" in name)]
    generator = torch.Generator().manual_seed(seed)
    (folder / MODEL).mkdir(parents=True, exist_ok=True)
    for style in names:
        state = {}
        for name, module in layers:
            state[f"transformer.{name}.lora_A.weight"] = torch.randn(rank, module.in_features,
                                                                     generator=generator) * 0.3
            state[f"transformer.{name}.lora_B.weight"] = torch.randn(module.out_features, rank,
                                                                     generator=generator) * 0.3
        save_file(state, str(folder / MODEL / f"{style}.safetensors"))
    return [name for name, _ in layers]


def scene_png() -> bytes:
    """The picture the edits start from, a red circle at top left on blue (as tiny-shapes draws one), as PNG bytes
    (drawn here: the app does not import the training code)."""
    from PIL import Image, ImageDraw

    picture = Image.new("RGB", (SHAPE.width, SHAPE.height), (0, 0, 255))
    x, y = SHAPE.width / 6, SHAPE.height / 6
    ImageDraw.Draw(picture).ellipse((x - 11, y - 11, x + 11, y + 11), fill=(255, 0, 0))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def styles(bench: InProcessBench) -> list[Figure]:
    rounds, edit_runs = ROUNDS.get(bench.plan.name, 6), EDIT_RUNS.get(bench.plan.name, 5)
    figures: list[Figure] = []
    with tempfile.TemporaryDirectory(prefix="acceldemo-bench-styles-") as folder:
        layers = make_styles(Path(folder))
        styled = type(bench)(bench.options, dataclasses.replace(bench.engine.settings, lora_dir=Path(folder)))
        try:
            picture = scene_png()
            for mode in MODES:
                log(f"  {mode}: {len(STYLES)} styles of rank {RANK} over {len(layers)} layers")
                figures += _mode_figures(styled, mode, picture, rounds, edit_runs)
        finally:
            styled.close()
    return figures


def _mode_figures(bench: InProcessBench, mode: str, picture: bytes, rounds: int, edit_runs: int) -> list[Figure]:
    engine = bench.engine

    def request(lora=None, scale=None, image=None, strength=None):
        return engine.check(GenerateParams(
            prompt=PROMPT, model=MODEL, hardware=bench.options.hardware, mode=mode, placement="device",
            resolution=SHAPE, steps=STEPS, seed=0, lora=lora, lora_scale=scale, image=image, strength=strength))

    graphs: list[int] = []  # every call's new graphs after the warm-up

    def timed(checked) -> float:
        started = bench.clock()
        result = engine.generate(checked)
        seconds = bench.clock() - started
        graphs.append(result.new_graphs)
        return seconds

    switches = [request(name, scale) for name, scale in SWITCHES]
    plain = request()
    edits = {strength: request(image=picture, strength=strength) for strength in (1.0, 0.5)}
    # The warm-up: the first call compiles the shape; every style, the edits and no style once each.
    first = engine.generate(switches[0])
    for checked in (*switches[1:], plain, *edits.values()):
        engine.generate(checked)

    # 1. A switch ÷ a warm call: rounds of WARM_PER_SWITCH calls holding the slot's style, then one switching it.
    warm_s, switch_s, by_kind = [], [], {"file": [], "strength": []}
    held = len(switches) - 1  # the warm-up's last style call
    engine.generate(switches[held])
    for _ in range(rounds):
        warm_s.append(statistics.median(timed(switches[held]) for _ in range(WARM_PER_SWITCH)))
        following = (held + 1) % len(switches)
        switch_s.append(timed(switches[following]))
        before, after = SWITCHES[held][0], SWITCHES[following][0]
        by_kind["file" if after not in (None, before) else "strength"].append(switch_s[-1] / warm_s[-1])
        held = following
    switch_graphs = sum(graphs)

    # 2. An edit ÷ a generation: all steps (strength 1.0) and half of them (0.5), interleaved with generations.
    generated, whole, half = interleaved([lambda: timed(plain), lambda: timed(edits[1.0]),
                                          lambda: timed(edits[0.5])], edit_runs)
    title = f"({MODEL}, {mode} {SHAPE}, {STEPS} steps)"
    log(f"  {mode}: switch {Spread.of(switch_s)} s, warm {Spread.of(warm_s)} s; graphs after the first call "
        f"{sum(graphs)} (first call {first.new_graphs})")
    ms = lambda values: f"{statistics.median(values) * 1000:.0f} ms"  # noqa: E731
    kinds = "; ".join(f"{kind} switches {Spread.of(values)}" for kind, values in by_kind.items() if values)
    figures = [
        Figure(f"styles_switch_{mode}", 12, f"first image after a LoRA switch ÷ a warm call with none {title}",
               "ratio", ratios(switch_s, warm_s), Target("<=", 1.2),
               note=f"{ms(switch_s)} vs {ms(warm_s)}; {kinds} (file: the other style's weights swapped in; "
                    f"strength: the slot's up weights rewritten)",
               detail={"switch_s": Spread.of(switch_s).__dict__, "warm_s": Spread.of(warm_s).__dict__,
                       "by_kind": {kind: Spread.of(v).__dict__ for kind, v in by_kind.items() if v},
                       "switches": [f"{name}@{scale}" if name else "none" for name, scale in SWITCHES],
                       "styles": list(STYLES), "rank": RANK, "first_call_graphs": first.new_graphs,
                       "first_call_compile_s": round(first.compile_seconds, 3)},
               if_missed="a switch copies the style's kept weights into the slot (diffusers' hot-swap) and "
                         "rewrites the slot's up weights at the strength; a compiled package also takes the changed "
                         "tensors again (load_constants)")]
    if Mode(mode).compiles:  # eager compiles nothing at all: no row
        figures.append(Figure(
            f"styles_new_graphs_{mode}", 12, f"graphs compiled after the first call, over {rounds} switches, their "
                                             f"warm calls and {3 * edit_runs} edit/generation calls {title}",
            "graphs", Spread.of([sum(graphs)]), Target("==", 0),
            note=f"the first call compiled {first.new_graphs} graph(s) in {first.compile_seconds:.1f} s "
                 f"({first.compile_cache_hits} from a cache); the switches and their warm calls {switch_graphs}",
            detail={"per_call": graphs},
            if_missed="a style or strength changed something a compiled graph guards on (a Python float in the "
                      "LoRA scaling, a new module): run with TORCH_LOGS=recompiles"))
    return figures + [
        Figure(f"styles_edit_{mode}", 12, f"edit at strength 1.0 (all steps) ÷ generation {title}", "ratio",
               ratios(whole, generated),
               note=f"{ms(whole)} vs {ms(generated)}; the picture is encoded by the VAE and noised first",
               detail={"edit_s": Spread.of(whole).__dict__, "generate_s": Spread.of(generated).__dict__}),
        Figure(f"styles_edit_half_{mode}", 12, f"edit at strength 0.5 ({edits[0.5].denoise_steps} of {STEPS} "
                                               f"steps) ÷ generation {title}", "ratio", ratios(half, generated),
               note=f"{ms(half)} vs {ms(generated)}",
               detail={"edit_s": Spread.of(half).__dict__, "generate_s": Spread.of(generated).__dict__}),
    ]
