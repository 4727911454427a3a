"""Section 10: what previews cost — the same call with and without them, side by side, and how many it made."""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from ..executors.previews import BUDGET
from ..records import GenerateParams, Shape
from .figures import Figure, Spread, Target, interleaved, ratios

if TYPE_CHECKING:
    from .runner import InProcessBench

# The page's default model at its default size, and the tests' model compiled (its steps are the fastest: previews
# weigh most there).
CASES = (("tiny-shapes", "eager", Shape(64, 64)), ("tiny-flux2-klein", "compiled", Shape(128, 128)))


def previews(bench: "InProcessBench") -> list[Figure]:
    figures = []
    for model, mode, shape in CASES:
        def request(with_previews: bool):
            return bench.engine.check(GenerateParams(
                prompt="a red circle on a blue background, top left", model=model, hardware=bench.options.hardware,
                mode=mode, placement="device", resolution=shape, seed=0, previews=with_previews))

        shown, plain = request(True), request(False)
        counts: list[int] = []

        def timed(checked) -> float:
            made = []  # a front end's callback either way: the previews are the only difference
            started = bench.clock()
            bench.engine.generate(checked, lambda event: made.append(event.preview) if event.preview else None)
            seconds = bench.clock() - started
            if checked.previews:
                counts.append(len(made))
            return seconds

        timed(shown), timed(plain)  # loads, compiles and fits nothing inside the timed pairs
        counts.clear()
        with_previews, without = interleaved([lambda: timed(shown), lambda: timed(plain)], bench.plan.overhead_pairs)
        figures.append(Figure(
            f"previews_{model}_{mode}_{shape}", 10, f"call with previews ÷ without ({model}, {mode} {shape}, "
                                                  f"{shown.steps} steps)", "ratio", ratios(with_previews, without),
            Target("<=", 1.05),
            note=f"{statistics.median(counts):g} preview(s) per call of {shown.steps} steps",
            detail={"previews_per_call": Spread.of(counts).__dict__, "with_s": Spread.of(with_previews).__dict__,
                    "without_s": Spread.of(without).__dict__, "budget": BUDGET},
            if_missed=f"previews are skipped while they took over {BUDGET:.0%} of the call; what exceeds it is the "
                      "per-step cost outside the decode itself (the latents' copy for the step's prediction, the "
                      "progress event), which the budget does not see"))
    return figures
