"""Section 16: a fair share per client — while client A's request draws and two more of A's wait, client B sends
one: how long B waits for a device ÷ one call's time, with the line taking turns across clients (A and B named)
and, side by side in the same run, in arrival order (both unnamed: the engine's own tickets, one turn for all).

In-process, on this process's engine (one device): tiny-flux2-klein 64x64 eager, so no call compiles; each request
of a different step count, so none is drawn in another's call (batching would blur the order being measured).
"""
from __future__ import annotations

import dataclasses
import statistics
import threading

from ..records import Phase, Request
from .figures import Figure, Spread, Target, interleaved
from .serving import SHAPE

# A's burst: one drawing and this many waiting (ACCELDEMO_CLIENT_QUEUE's default lets 2 wait on a line of 8).
A_WAITING = 2


def _b_waits(engine, request: Request, named: bool) -> float:
    """B's seconds in line: its request sent as soon as A's first draws, behind A's waiting ones."""
    a_client, b_client = ("bench-a", "bench-b") if named else ("", "")
    drawing = threading.Event()
    a = [engine.submit(dataclasses.replace(request, steps=request.steps + i, seed=10 + i),
                       (lambda event: drawing.set() if event.phase is Phase.DENOISE else None) if i == 0
                       else (lambda event: None), client=a_client)
         for i in range(1 + A_WAITING)]
    assert drawing.wait(600), "A's first request never started drawing"
    b = engine.submit(_b_request(request), client=b_client)
    waited = b.result(600).queue_wait
    for job in a:
        job.result(600)
    return waited


def _b_request(request: Request) -> Request:
    return dataclasses.replace(request, steps=request.steps + A_WAITING + 1, seed=99)


def fairness(bench) -> list[Figure]:
    engine = bench.engine
    request = bench.request("eager", SHAPE)
    lone = []
    for _ in range(2):  # loads the pipeline, untimed
        engine.submit(request).result(600)
    for _ in range(max(3, bench.plan.mcp_pairs)):  # one call of B's request, alone
        result = engine.submit(_b_request(request)).result(600)
        lone.append(result.seconds - result.queue_wait)
    call = statistics.median(lone)
    fair, arrival = interleaved([lambda: _b_waits(engine, request, True), lambda: _b_waits(engine, request, False)],
                                max(2, bench.plan.mcp_pairs // 2))
    title = f"{request.model} {request.mode} {SHAPE}, {request.steps} steps, A: 1 drawing + {A_WAITING} waiting"
    return [
        Figure("fair_share_wait", 16, f"B's wait ÷ one call, turns across clients ({title})", "ratio",
               Spread.of(w / call for w in fair), Target("<=", 1.5),
               note=f"one call {call * 1000:.0f} ms (median of {len(lone)} lone requests); B waited "
                    f"{statistics.median(fair) * 1000:.0f} ms: the rest of A's call, then B's turn",
               detail={"call_s": Spread.of(lone).__dict__, "b_wait_s": Spread.of(fair).__dict__},
               if_missed="B should go next when A's call ends: admission.Line._in_turn orders waiting tickets by "
                         "turn, and B's first turn is the line's current one"),
        Figure("arrival_order_wait", 16, f"B's wait ÷ one call, arrival order ({title})", "ratio",
               Spread.of(w / call for w in arrival),
               note=f"the same requests unnamed, measured alternately with the figure above: B waited "
                    f"{statistics.median(arrival) * 1000:.0f} ms, behind all of A's",
               detail={"b_wait_s": Spread.of(arrival).__dict__}),
    ]
