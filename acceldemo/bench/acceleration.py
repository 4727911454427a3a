"""Section 13: what each acceleration choice buys, side by side in one run — TaylorSeer ÷ no step cache on
tiny-shapes at 128x128 (28 steps, and the model's own 4; eager and compiled), int8 weights ÷ the model's own, and a
repeated request answered from the exact-result cache ÷ drawn. Each pair draws the same held-out captions at the same
seeds: the speed ratio is run by run, the pictures' mean difference is measured, and the model's own judge
(`training.shapes.score`, run as a program: the app does not import the training code) reads every picture back.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from ..records import GenerateParams, Shape
from .figures import Figure, Spread, Target, log, ratios

if TYPE_CHECKING:
    from .plans import InProcessBench

MODEL = "tiny-shapes"
SHAPE = Shape(128, 128)
LONG_STEPS = 28
CACHE = "taylorseer"
# Held-out captions each pair draws (one image per caption and configuration), by plan.
CAPTIONS = {"full": 48, "quick": 16, "smoke": 1}
RESULT_RUNS = {"full": 30, "quick": 12, "smoke": 2}
_ROOT = Path(__file__).resolve().parents[2]


def _score(*args: str) -> object:
    """`python -m training.shapes.score ARGS` from the checkout, its JSON answer (None: no training code here)."""
    if not (_ROOT / "training" / "shapes" / "score.py").is_file():
        return None
    done = subprocess.run([sys.executable, "-m", "training.shapes.score", *args], cwd=_ROOT, capture_output=True,
                          text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"training.shapes.score {args[0]} failed: {done.stderr[-500:]}")
    return json.loads(done.stdout)


class _Pair:
    """One configuration against another on the same prompts and seeds: times run by run, the pictures kept."""

    def __init__(self, bench: InProcessBench, prompts: list[str], base: dict, other: dict):
        self.bench, self.prompts = bench, prompts
        self.requests = [[bench.engine.check(GenerateParams(prompt=prompt, model=MODEL, hardware=bench.options.hardware,
                                                            placement="device", resolution=SHAPE, seed=i,
                                                            **config))
                          for i, prompt in enumerate(prompts)] for config in (base, other)]
        self.seconds: list[list[float]] = [[], []]
        self.images: list[list] = [[], []]
        self.results: list[list] = [[], []]

    def run(self) -> None:
        for side in (0, 1):  # loads and compiles outside the timed runs
            self.bench.engine.generate(self.requests[side][0])
        for i in range(len(self.prompts)):
            for side in ((0, 1) if i % 2 == 0 else (1, 0)):
                started = self.bench.clock()
                result = self.bench.engine.generate(self.requests[side][i])
                self.seconds[side].append(self.bench.clock() - started)
                self.images[side].append(result.image)
                self.results[side].append(result)

    @property
    def speedup(self) -> Spread:
        return ratios(self.seconds[0], self.seconds[1])

    @property
    def difference(self) -> Spread:
        import numpy as np

        return Spread.of(float(np.abs(np.asarray(a, float) - np.asarray(b, float)).mean())
                         for a, b in zip(*self.images))

    def save(self, folder: Path, names: tuple[str, str]) -> None:
        for side, name in enumerate(names):
            (folder / name).mkdir(parents=True, exist_ok=True)
            for i, image in enumerate(self.images[side]):
                image.save(folder / name / f"{i}.png")


def acceleration(bench: InProcessBench) -> list[Figure]:
    plan = bench.plan.name
    captions = _score("captions", str(CAPTIONS[plan]))
    prompts = [c["text"] for c in captions] if captions else \
        ["a red circle on a blue background, top left"] * CAPTIONS[plan]
    figures: list[Figure] = []
    judged_sets: dict[str, tuple[str, str, str]] = {}  # pair name -> (base set, other set, figure title)
    with tempfile.TemporaryDirectory(prefix="bench-acceleration-") as scratch:
        folder = Path(scratch)
        if captions:
            (folder / "captions.json").write_text(json.dumps(captions))
        for mode in ("eager", "compiled"):
            for steps in (LONG_STEPS, 4):
                log(f"  {CACHE} ÷ none, {mode}, {steps} steps, {len(prompts)} captions")
                pair = _Pair(bench, prompts, {"mode": mode, "steps": steps},
                             {"mode": mode, "steps": steps, "step_cache": CACHE})
                pair.run()
                skipped = pair.results[1][0].cache
                title = f"{CACHE} ÷ no step cache ({MODEL} {SHAPE}, {steps} steps, {mode})"
                long = steps == LONG_STEPS
                figures += [
                    Figure(f"step_cache_speed_{mode}_{steps}", 13, f"speed: {title}", "ratio", pair.speedup,
                           Target(">=", 1.6) if long else None,
                           note=f"no cache ÷ {CACHE}, run by run; {skipped.skipped} of {skipped.calls} transformer "
                                "calls answered by the cache",
                           if_missed="the calls the cache skips are the transformer's share of the call; the text "
                                     "encoder and VAE run either way"),
                    Figure(f"step_cache_difference_{mode}_{steps}", 13, f"mean |difference| of the pictures: {title}",
                           "levels of 255", pair.difference, Target("<=", 3.0) if long else None)]
                names = (f"{mode}-{steps}-none", f"{mode}-{steps}-{CACHE}")
                pair.save(folder, names)
                judged_sets[f"step_cache_{mode}_{steps}"] = (*names, title)
        log(f"  int8 ÷ none, eager, 4 steps, {len(prompts)} captions")
        pair = _Pair(bench, prompts, {"mode": "eager"}, {"mode": "eager", "quantization": "int8"})
        pair.run()
        own, int8 = pair.results[0][0].weight_bytes, pair.results[1][0].weight_bytes
        title = f"int8 weights ÷ the model's own ({MODEL} {SHAPE}, 4 steps, eager)"
        figures += [
            Figure("int8_weight_bytes", 13, f"weight bytes: {title}", "ratio", Spread.of([int8 / own]),
                   Target("<=", 0.55), note=f"{int8 / 1e6:.2f} MB of {own / 1e6:.2f} MB (the pipeline's weights as "
                                            "held: torchao's int8 data and scales; the VAE and the LoRA slot stay "
                                            "float32)"),
            Figure("int8_speed", 13, f"speed: {title}", "ratio", pair.speedup,
                   note="the model's own ÷ int8, run by run: weight-only int8 dequantizes into each matmul, so on a "
                        "CPU a tiny model's speed is about even; it saves memory"),
            Figure("int8_difference", 13, f"mean |difference| of the pictures: {title}", "levels of 255",
                   pair.difference)]
        pair.save(folder, ("int8-none", "int8-int8"))
        judged_sets["int8"] = ("int8-none", "int8-int8", title)
        scored = _score("judge", str(folder)) if captions else None
    figures += _judged(scored, judged_sets, len(prompts))
    figures += _result_cache(bench)
    return figures


def _judged(scored: dict | None, judged_sets: dict[str, tuple[str, str, str]], count: int) -> list[Figure]:
    """Each pair's drop in scene accuracy (the judge: every part a caption asks for right), in points."""
    figures = []
    for key, (base, other, title) in judged_sets.items():
        bound = 3.0 if key == "int8" else 2.0 if key.endswith(f"_{LONG_STEPS}") else None
        if scored is None:
            figures.append(Figure(f"{key}_accuracy_drop", 13, f"scene accuracy lost: {title}", "points", None,
                                  note="not judged: the training code (training/shapes/score.py) is not beside the "
                                       "package"))
            continue
        before, after = scored[base]["scene"], scored[other]["scene"]
        figures.append(Figure(
            f"{key}_accuracy_drop", 13, f"scene accuracy lost: {title}", "points",
            Spread.of([(before - after) * 100]), Target("<=", bound) if bound is not None else None,
            note=f"judged right: {before:.0%} without, {after:.0%} with, of {count} held-out captions",
            detail={"without": scored[base], "with": scored[other]}))
    return figures


def _result_cache(bench: InProcessBench) -> list[Figure]:
    """A repeated request answered from the exact-result cache ÷ the same request drawn (a new seed each run)."""
    from ..builder import build_engine

    runs = RESULT_RUNS[bench.plan.name]
    engine = build_engine(dataclasses.replace(bench.engine.settings, result_cache=runs + 1))
    try:
        def request(seed: int):
            return engine.check(GenerateParams(prompt="a red circle on a blue background, top left", model=MODEL,
                                               hardware=bench.options.hardware, mode="eager", placement="device",
                                               resolution=Shape(64, 64), seed=seed))

        engine.generate(request(10_000))  # loads the pipeline
        drawn, answered = [], []
        for seed in range(runs):
            for times in (drawn, answered):
                started = bench.clock()
                result = engine.generate(request(seed))
                times.append(bench.clock() - started)
            assert result.from_cache, "the repeated request was drawn again"
    finally:
        engine.close()
    return [Figure("result_cache", 13, f"a repeated request from the result cache ÷ drawn ({MODEL} 64x64, 4 steps, "
                                       "eager)", "ratio", ratios(answered, drawn), Target("<=", 0.05),
                   note=f"ACCELDEMO_RESULT_CACHE: {Spread.of(answered).median * 1000:.2f} ms answered vs "
                        f"{Spread.of(drawn).median * 1000:.0f} ms drawn")]
