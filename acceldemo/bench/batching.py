"""Section 10: batching — 8 concurrent clients through the served Images API on one replica of one core, with the
engine drawing waiting requests together in one pipeline call (the default) ÷ one call per request
(ACCELDEMO_MAX_BATCH=1): throughput and p50/p99 latency for tiny-shapes 64x64 eager and compiled and tiny-flux2-klein
128x128 eager; and one client alone, batched ÷ unbatched (batching must not slow a lone visitor).

Both apps run side by side, each a real app.py on a loopback port whose one replica is a worker pinned to the first
core; only one of them is asked for images at a time. Their compile cache is shared and cold when the section starts.
"""
from __future__ import annotations

import tempfile
import time

import httpx

from .figures import Figure, Spread, Target, interleaved, ratios
from .serving import AppServer, _percentile, burst

# What each workload asks for (the /v1 body, without prompt and seed).
WORKLOADS = {
    "tiny-shapes 64x64 eager": {"model": "tiny-shapes", "size": "64x64", "mode": "eager"},
    "tiny-shapes 64x64 compiled": {"model": "tiny-shapes", "size": "64x64", "mode": "compiled"},
    "tiny-flux2-klein 128x128 eager": {"model": "tiny-flux2-klein", "size": "128x128", "mode": "eager"},
}
PROMPTS = ("a red circle on a blue background, top left", "green square in the bottom right corner",
           "blue triangle, upper right", "a yellow disc on a black background", "a white square",
           "red triangle on a green background, bottom left", "a blue circle, lower left", "black square, top right")
# One replica of one core (the CPU split into two devices, the replica on the first): the other core runs the app
# and the clients. The start-up warm-up compiles tiny-shapes 64x64 at every bucket a call of 8 clients may use.
ONE_CORE = {"ACCELDEMO_REPLICAS": "cpu=1", "ACCELDEMO_CPU_DEVICES": "2"}
WARMUP = "compiled:64x64@1,2,4"
CONFIGS = {"batched": {}, "unbatched": {"ACCELDEMO_MAX_BATCH": "1"}}


def _body(workload: str, client: int, request: int) -> dict:
    return {**WORKLOADS[workload], "hardware": "cpu", "prompt": PROMPTS[(client + request) % len(PROMPTS)],
            "seed": 1000 * client + request}


def _calls(url: str) -> tuple[int, int]:
    """Pipeline calls and the images they drew, from the app's own counters."""
    counters = httpx.get(url + "/status", timeout=60).json()["counters"]
    return counters["calls"], counters["drawn"]


def _burst(url: str, workload: str, clients: int, each: int) -> dict:
    """`clients` clients at once, each sending `each` requests one after the other: throughput, latencies, errors,
    and the images per pipeline call the app drew meanwhile."""
    calls_before, drawn_before = _calls(url)
    done = burst(url, clients, each, lambda c, r: _body(workload, c, r), "bench-batching-client")
    calls, drawn = _calls(url)
    return {"throughput": len(done.answers) / done.wall, "latencies": done.latencies, "errors": done.errors,
            "images_per_call": (drawn - drawn_before) / max(calls - calls_before, 1)}


def _lone(url: str, workload: str, count: list[int]) -> float:
    """One request of a client that is alone: its wall seconds."""
    count[0] += 1
    began = time.perf_counter()
    httpx.post(url + "/v1/images/generations", json=_body(workload, 0, count[0]), timeout=600).raise_for_status()
    return time.perf_counter() - began


def batching(bench) -> list[Figure]:
    plan = bench.plan
    clients, each, rounds = plan.batch_clients, plan.batch_per_client, plan.batch_rounds
    with tempfile.TemporaryDirectory(prefix="acceldemo-bench-batching-") as cache_dir:
        servers = {name: AppServer(WARMUP, "tiny-shapes", {**ONE_CORE, **env, "ACCELDEMO_CACHE_DIR": cache_dir})
                   for name, env in CONFIGS.items()}
        try:
            urls = {name: server.ready() for name, server in servers.items()}
            runs: dict[str, dict[str, list[dict]]] = {w: {name: [] for name in CONFIGS} for w in WORKLOADS}
            for workload in WORKLOADS:
                for name in CONFIGS:  # the first visit of each workload loads its pipeline: not measured
                    _burst(urls[name], workload, clients, 1)
                for turn in range(rounds):
                    for name in (("batched", "unbatched") if turn % 2 == 0 else ("unbatched", "batched")):
                        runs[workload][name].append(_burst(urls[name], workload, clients, each))
            lone_workload = next(iter(WORKLOADS))
            count = [0]
            lone = interleaved([lambda: _lone(urls["batched"], lone_workload, count),
                                lambda: _lone(urls["unbatched"], lone_workload, count)], plan.batch_single)
        finally:
            for server in servers.values():
                server.close()
    return [*(figure for workload, by_config in runs.items() for figure in _workload_figures(workload, by_config,
                                                                                             clients, each)),
            Figure("batching_lone_client", 10, f"one client alone: latency batched ÷ unbatched ({lone_workload})",
                   "ratio", ratios(*lone), Target("<=", 1.05),
                   note=f"p50 {Spread.of(lone[0]).median * 1000:.0f} vs {Spread.of(lone[1]).median * 1000:.0f} ms; "
                        "nothing waits for a lone request, so it is drawn alone",
                   if_missed="a lone request is never held back (ACCELDEMO_BATCH_WAIT_MS=0): what is left is the "
                             "line's bookkeeping of sharing, and the noise of a shared host"),
            Figure("batching_errors", 10, "errors (every workload and configuration)", "errors",
                   Spread.of([sum(len(run["errors"]) for by_config in runs.values() for config in by_config.values()
                                  for run in config)]), Target("==", 0),
                   note="; ".join(e for by_config in runs.values() for config in by_config.values()
                                  for run in config for e in run["errors"][:1]))]


def _workload_figures(workload: str, by_config: dict[str, list[dict]], clients: int, each: int) -> list[Figure]:
    """Throughput batched ÷ unbatched per round, and p50 and p99 of all rounds side by side."""
    batched, unbatched = by_config["batched"], by_config["unbatched"]
    latencies = {name: [s for run in runs for s in run["latencies"]] for name, runs in by_config.items()}
    ms = {name: {q: _percentile(values, q) * 1000 for q in (0.5, 0.99)} for name, values in latencies.items()
          if values}
    sizes = Spread.of(run["images_per_call"] for run in batched)
    target = Target(">=", 1.4) if workload == "tiny-shapes 64x64 eager" else None
    detail = {name: {"throughput": [round(run["throughput"], 2) for run in runs], "ms": ms.get(name),
                     "images_per_call": [round(run["images_per_call"], 2) for run in runs]}
              for name, runs in by_config.items()}
    figures = [Figure(
        f"batching_throughput_{workload}", 10, f"{clients} clients, 1 replica of 1 core: throughput batched ÷ "
                                               f"unbatched ({workload})", "ratio",
        ratios([run["throughput"] for run in batched], [run["throughput"] for run in unbatched]), target,
        detail=detail,
        note=f"{clients}×{each} requests through /v1/images/generations per round: "
             f"{Spread.of(run['throughput'] for run in batched).median:.1f} vs "
             f"{Spread.of(run['throughput'] for run in unbatched).median:.1f} images/s; {sizes.median:.1f} images "
             "per pipeline call batched",
        if_missed="the call drawing 4 images costs more than a quarter of 4 calls only where the model's per-op "
                  "overhead is small against its work (larger shapes); and the app's own per-request cost (HTTP, "
                  "PNG, base64) is not shared by batching")]
    if "batched" in ms and "unbatched" in ms:
        for q, label in ((0.5, "p50"), (0.99, "p99")):
            figures.append(Figure(
                f"batching_{label}_{workload}", 10, f"{clients} clients: {label} latency batched ÷ unbatched "
                                                    f"({workload})", "ratio",
                Spread.of([ms["batched"][q] / ms["unbatched"][q]]),
                note=f"{label} {ms['batched'][q]:.0f} vs {ms['unbatched'][q]:.0f} ms"))
    return figures
