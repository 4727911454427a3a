"""Section 14: more devices per image — a CFG-parallel pool of 2 ranks ÷ a pool of 1 on tiny-sd3 (guidance 4.5,
128x128 and 512x512, 28 steps), and a context-parallel pool of 2 ranks ÷ 1 on tiny-flux2-klein at its largest shape
(512x512), with the share of a call rank 0 spends in collectives, and for cfg the most it could buy with free
collectives (measured in this process). Every pool is real torchrun ranks with a gloo group, one torch thread each;
the calls go through the executor interface the engine uses, interleaved, timed in wall seconds (they cross
processes)."""
from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

from ..models.catalog import get_model
from ..records import CFG_RANKS, GenerateParams, Placement, Shape, no_progress
from .figures import Figure, Spread, Target, interleaved, log, ratios

if TYPE_CHECKING:
    from .plans import InProcessBench

# CFG at the 128x128 (the target) and at 512x512, where the transformer's work outweighs its fixed costs.
CASES = (("tiny-sd3", Placement.CFG, Shape(128, 128), 28), ("tiny-sd3", Placement.CFG, Shape(512, 512), 28),
         ("tiny-flux2-klein", Placement.CP, Shape(512, 512), 4))
RUNS = {"full": 10, "quick": 4, "smoke": 1}
# A smoke run checks that the section runs: each placement once, small and short.
SMOKE_CASES = (("tiny-sd3", Placement.CFG, Shape(128, 128), 4), ("tiny-flux2-klein", Placement.CP, Shape(128, 128), 4))


def cfg_ceiling(bench: InProcessBench, request, runs: int) -> Spread:
    """The most cfg over 2 ranks could buy here if its collectives cost nothing (Amdahl's bound, measured in this
    process, one thread): a guided call's seconds ÷ the same call with each transformer call's batch-2 seconds
    replaced by the seconds of the batch-1 call one rank would make. The text encoders, the scheduler and the VAE run
    whole on every rank, so they stay."""
    from ..executors.parallel import branch
    from ..executors.recipe import pipeline_kwargs
    from ..models.loading import load_pipeline

    pipe = load_pipeline(get_model(request.model), bench.engine.settings)
    pipe.set_progress_bar_config(disable=True)
    forward = pipe.transformer.forward
    clock = bench.clock
    seconds = {"batch": 0.0, "half": 0.0}

    def timed(*args, **kwargs):
        started = clock()
        output = forward(*args, **kwargs)
        seconds["batch"] += clock() - started
        batch = kwargs["hidden_states"].shape[0]
        if batch % CFG_RANKS == 0:  # rank 0's branch of the call, timed on its own
            half_args, half_kwargs = branch(args, kwargs, batch, 0, CFG_RANKS)
            started = clock()
            forward(*half_args, **half_kwargs)
            seconds["half"] += clock() - started
        return output

    pipe.transformer.forward = timed
    bounds = []
    for _ in range(runs + 1):  # the first warms
        seconds.update(batch=0.0, half=0.0)
        started = clock()
        pipe(**pipeline_kwargs(request, output_type="np"))
        call = clock() - started - seconds["half"]
        bounds.append(call / (call - seconds["batch"] + seconds["half"]))
    return Spread.of(bounds[1:])


def parallel(bench: InProcessBench) -> list[Figure]:
    from ..executors.pool import PoolExecutor

    figures = []
    for model, placement, shape, steps in SMOKE_CASES if bench.plan.name == "smoke" else CASES:
        request = bench.engine.check(GenerateParams(prompt="a red circle on a blue background", model=model,
                                                    hardware=bench.options.hardware, placement=placement,
                                                    resolution=shape, steps=steps, seed=0))
        alone = replace(request, placement=Placement.TP, tp_size=1, cp_size=1)  # the whole pipeline on one rank
        executors = [PoolExecutor(bench.engine.settings, bench.engine.hardware) for _ in range(2)]
        try:
            devices = bench.hardware.device_sets(2)[0]
            loaded = [executor.load(call.key(devices), get_model(request.model), no_progress)
                      for executor, call in zip(executors, (alone, request))]
            for pipeline, call in zip(loaded, (alone, request)):
                pipeline.run(call, False, no_progress)  # warm: each rank's first call
            log(f"  {placement} 2 ranks vs 1 rank: {model} {shape}, {steps} steps")
            shares: list[float] = []

            def timed(pipeline, call, profile: bool = False):
                def run() -> float:
                    started = time.perf_counter()
                    out = pipeline.run(call, False, no_progress, profile=profile)
                    seconds = time.perf_counter() - started
                    if profile:
                        shares.append(out.collective_seconds / out.seconds)
                    return seconds
                return run

            one, two = interleaved([timed(loaded[0], alone), timed(loaded[1], request)], RUNS[bench.plan.name])
            for _ in range(min(3, RUNS[bench.plan.name])):
                timed(loaded[1], request, profile=True)()
        finally:
            for executor in executors:
                executor.close()
        title = f"{placement} over 2 ranks ÷ 1 rank ({model} {shape}, {steps} steps)"
        # The case keeps the plain key; CFG at another size is named by it.
        key = f"parallel_{placement}" + ("" if placement is Placement.CP or shape == CASES[0][2] else f"_{shape}")
        if placement is Placement.CFG:
            ceiling = cfg_ceiling(bench, request, RUNS[bench.plan.name])
            figures.append(Figure(f"{key}_ceiling", 14, f"most cfg could buy, collectives free: {title}", "ratio",
                                  ceiling, note="Amdahl's bound, in this process: each transformer call's batch of 2 "
                                                "replaced by one rank's batch of 1; the text encoders and the VAE "
                                                "stay whole"))
            figures.append(Figure(key, 14, f"speed: {title}", "ratio", ratios(one, two),
                                  Target(">=", 1.5) if shape == CASES[0][2] else None,
                                  note="one rank per guidance branch: each computes half the transformer's batch; "
                                       "the text encoders and the VAE run on both",
                                  if_missed=f"even with free collectives cfg could buy {ceiling.median:.2f}× here "
                                            "(the figure above): the transformer's batch-2 call costs less than twice "
                                            "its batch-1 call on a tiny model, and the text encoders and the VAE run "
                                            "whole on both ranks; each step's gather and Stop flag cross processes "
                                            "on 2 shared cores"))
        else:
            figures.append(Figure(key, 14, f"speed: {title}", "ratio", ratios(one, two),
                                  note="Ulysses attention: each rank holds half the tokens; two all-to-alls per "
                                       "attention"))
        figures.append(Figure(f"{key}_collectives", 14, f"share of the call in collectives: {title}",
                              "ratio", Spread.of(shares),
                              note="the time rank 0 had a collective in flight, launch to completion (waiting for the "
                                   "other rank included), torch.profiler around the call"))
    return figures
