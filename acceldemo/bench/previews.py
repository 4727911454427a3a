"""Section 10: what previews cost — the same call with and without them, side by side, and how many it made."""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from ..executors.previews import BUDGET
from ..records import GenerateParams, Shape
from .figures import Figure, Spread, Target, interleaved, ratios

if TYPE_CHECKING:
    from .plans import InProcessBench

# The page's default model at its default size, and the tests' model compiled (its steps are the fastest: previews
# weigh most there).
# Calls timed together as one run of a pair, by plan (a smoke run's figures are not compared: one call checks the
# section).
CALLS_PER_RUN = {"full": 5, "quick": 5, "smoke": 1}
CASES = (("tiny-shapes", "eager", Shape(64, 64)), ("tiny-flux2-klein", "compiled", Shape(128, 128)))


def previews(bench: InProcessBench) -> list[Figure]:
    figures = []
    for model, mode, shape in CASES:
        def request(with_previews: bool):
            return bench.engine.check(GenerateParams(
                prompt="a red circle on a blue background, top left", model=model, hardware=bench.options.hardware,
                mode=mode, placement="device", resolution=shape, seed=0, previews=with_previews))

        shown, plain = request(True), request(False)
        counts: list[int] = []
        shares: list[float] = []

        def timed(checked) -> float:
            """Seconds per call of the plan's calls in a row: the difference sought (a few %) is small beside a
            shared host's call-to-call noise."""
            started = bench.clock()
            calls = CALLS_PER_RUN[bench.plan.name]
            for _ in range(calls):
                made = []  # a front end's callback either way: the previews are the only difference
                result = bench.engine.generate(checked, lambda event: made.append(event.preview) if event.preview
                                               else None)
                if checked.previews:
                    counts.append(len(made))
                    shares.append(result.preview_seconds / (result.seconds - result.queue_wait))
            return (bench.clock() - started) / calls

        timed(shown), timed(plain)  # loads, compiles and fits nothing inside the timed pairs
        counts.clear(), shares.clear()
        with_previews, without = interleaved([lambda: timed(shown), lambda: timed(plain)], bench.plan.overhead_pairs)
        share = Spread.of(shares)
        title = f"({model}, {mode} {shape}, {shown.steps} steps)"
        figures += [
            Figure(f"previews_{model}_{mode}_{shape}", 11, f"call with previews ÷ without {title}", "ratio",
                   ratios(with_previews, without), Target("<=", 1.05),
                   note=f"{statistics.median(counts):g} preview(s) per call of {shown.steps} steps",
                   detail={"previews_per_call": Spread.of(counts).__dict__,
                           "with_s": Spread.of(with_previews).__dict__, "without_s": Spread.of(without).__dict__},
                   if_missed=f"the previews' own time is {share.median:.1%} of the call (the next row); the rest "
                             "is run-to-run noise of a shared host unless it persists over runs"),
            Figure(f"previews_share_{model}_{mode}_{shape}", 11, f"previews' own time ÷ the call {title}", "ratio",
                   share, Target("<=", BUDGET),
                   note=f"measured inside the call (the decodes, timed as they run); a preview is skipped while "
                        f"they took over {BUDGET:.0%}")]
    return figures
