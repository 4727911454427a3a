"""Section 2: a warm call through the torchrun worker pool (1 and 2 ranks) ÷ the same call in this process.

All three go through the executor interface the engine uses (`LoadedPipeline.run`): the engine itself
refuses a 1-rank pool (a tp world of 1 is pointless to a person; the pool itself loads it whole), and its own cost
is section 1's figure.
"""
from __future__ import annotations

import threading
import time
from dataclasses import replace

from ..models.catalog import get_model
from ..records import Placement, Shape, no_progress
from .figures import Figure, Spread, Target, interleaved, ratios

POOL_MISSING = "pool: not measured (pool not available)"
# The figure is the cost of the pool's path (socket, fan-out, image transfer): eager keeps every rank's start short.
POOL_MODE = "eager"
SHAPE = Shape(64, 64)


class WarmPools:
    """1- and 2-rank pools loading in background threads from now on: their start-up overlaps other sections."""

    SIZES = (1, 2)

    def __init__(self, bench):
        from ..executors.pool import PoolExecutor

        self.request = bench.request(POOL_MODE, SHAPE)
        # One executor per world size: a pool holds one world size, and every one must be warm to interleave them.
        self.executors = {size: PoolExecutor(bench.engine.settings, bench.engine.hardware) for size in self.SIZES}
        self.loaded: dict[int, tuple] = {}
        self.refused: dict[int, str] = {}
        self.threads = [threading.Thread(target=self._start, args=(size,), name=f"bench-pool-tp{size}", daemon=True)
                        for size in self.SIZES]
        for thread in self.threads:
            thread.start()

    def _start(self, size: int) -> None:
        request = self.request
        executor = self.executors[size]
        sharded = replace(request, placement=Placement.TP, tp_size=size)
        key = sharded.key(executor.hardware.get(request.hardware).device_sets(size)[0])
        try:
            loaded = executor.load(key, get_model(request.model), no_progress)
            loaded.run(sharded, True, no_progress)
        except Exception as error:  # the pool's own refusal or failure is the figure's note
            self.refused[size] = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
            return
        self.loaded[size] = (loaded, sharded)

    def wait(self) -> None:
        for thread in self.threads:
            thread.join()

    def close(self) -> None:
        for executor in self.executors.values():
            executor.close()
        self.executors = {}


def start_pools(bench) -> WarmPools | str:
    """The pools, starting; or why there is no pool to measure."""
    try:
        return WarmPools(bench)
    except ImportError as error:
        return f"{type(error).__name__}: {error}"


def measure_pool(bench, pools: WarmPools | str) -> list[Figure]:
    if isinstance(pools, str):
        return [_not_measured("pool_overhead_1_rank", f"{POOL_MISSING}: {pools}")]
    pools.wait()
    if not pools.loaded:
        return [_not_measured("pool_overhead_1_rank", f"{POOL_MISSING}: {pools.refused.get(1)}")]
    request = pools.request
    bench.engine.generate(request)
    local = next(p for k, p in bench.executor.loaded.items()
                 if k.mode == request.mode and k.placement is Placement.DEVICE)
    inside: dict[int, list[float]] = {size: [] for size in pools.SIZES}  # rank 0's own seconds of each call

    def timed(loaded, req):
        def call() -> float:
            started = time.perf_counter()
            out = loaded.run(req, False, no_progress)
            seconds = time.perf_counter() - started
            if req.placement is Placement.TP:
                inside[req.tp_size].append(out.seconds)
            return seconds
        return call

    calls = {"in_process": timed(local, request),
             **{f"tp{size}": timed(*pools.loaded[size]) for size in sorted(pools.loaded)}}
    for call in calls.values():
        call()
    for seconds in inside.values():
        seconds.clear()
    timings = dict(zip(calls, interleaved(list(calls.values()), bench.plan.pool_pairs)))
    here = timings["in_process"]
    detail = {"mode": request.mode, "shape": str(SHAPE), "refused": pools.refused,
              **{f"{name}_s": Spread.of(values).__dict__ for name, values in timings.items()}}
    figures = []
    if "tp1" in timings:
        figures.append(Figure("pool_overhead_1_rank", 2, f"warm call through a 1-rank pool ÷ in-process "
                                                         f"({request.mode} {SHAPE})", "ratio",
                              ratios(timings["tp1"], here), Target("<=", 1.10), detail=detail))
    else:
        figures.append(_not_measured("pool_overhead_1_rank", f"the pool refuses 1 rank: {pools.refused[1]}"))
    if "tp2" in timings:
        figures.append(Figure("pool_tp2_vs_in_process", 2, f"warm call, 2-rank tensor-parallel pool ÷ in-process "
                                                           f"({request.mode} {SHAPE})", "ratio",
                              ratios(timings["tp2"], here), detail=detail, note=_GLOO))
    for size in pools.SIZES:
        if f"tp{size}" in timings:
            figures.append(Figure(
                f"pool_channel_tp{size}", 2, f"{size}-rank pool: call as the app sees it ÷ rank 0's own pipeline call",
                "ratio", ratios(timings[f"tp{size}"], inside[size]),
                note="the pool's own cost (socket, pickling, fan-out to the ranks, image transfer) without the "
                     "tensor-parallel compute"))
    if "tp1" in timings and "tp2" in timings:
        figures.append(Figure("pool_tp2_vs_tp1", 2, "warm call, 2-rank tensor parallel ÷ 1-rank pool", "ratio",
                              ratios(timings["tp2"], timings["tp1"]), note=_GLOO))
    return figures


_GLOO = ("2 gloo ranks on the host's CPU cores: a tiny model gains nothing from sharding, it pays the all-reduces "
         "(and here shares 2 cores with this process)")


def _not_measured(key: str, why: str) -> Figure:
    return Figure(key, 2, "warm call through a 1-rank pool ÷ in-process", "ratio", None, Target("<=", 1.10), note=why)
