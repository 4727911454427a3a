"""Section 8: replicas — 8 concurrent clients through the served Images API on 2 CPU replicas of one core each, ÷ 1
replica of one core (beside it, 1 replica using both cores), and a second replica's first call at a shape the first
compiled ÷ the first's cold first call.

Each configuration is a real app.py on a loopback port; its clients are plain HTTP (httpx), which cost this process
little CPU beside the server's. The replicas use a compile cache of their own, cold when the section starts.
"""
from __future__ import annotations

import tempfile

from .figures import Figure, Spread, Target
from .serving import AppServer, _percentile, burst

MODEL = "tiny-shapes"
SIZE = "64x64"
MODE = "compiled"
STEPS = 16
# What a configuration asks of the app; the CPU's two cores split into two devices except where one replica takes
# them both.
CONFIGS = {
    "1 replica, 1 core": {"ACCELDEMO_REPLICAS": "cpu=1", "ACCELDEMO_CPU_DEVICES": "2"},
    "2 replicas, 1 core each": {"ACCELDEMO_REPLICAS": "cpu=2"},
    "1 replica, 2 cores": {"ACCELDEMO_REPLICAS": "cpu=1"},
}


def _serve(name: str, cache_dir: str, bench) -> dict:
    """One configuration: its server warmed (every replica), then `replica_clients` clients at once, each sending
    `replica_per_client` requests; latencies, throughput and what /status says of the replicas' warm-up."""
    import httpx

    plan = bench.plan
    server = AppServer(f"{MODE}:{SIZE}", MODEL, {**CONFIGS[name], "ACCELDEMO_CACHE_DIR": cache_dir})
    try:
        url = server.ready()
        with httpx.Client(base_url=url, timeout=600) as http:
            status = http.get("/status").json()
            body = {"model": MODEL, "prompt": "a red circle on a blue background, top left", "size": SIZE,
                    "num_inference_steps": STEPS, "mode": MODE, "hardware": "cpu"}
            http.post("/v1/images/generations", json={**body, "seed": 0}).raise_for_status()
        done = burst(url, plan.replica_clients, plan.replica_per_client,
                     lambda c, r: {**body, "seed": 1000 * c + r}, "bench-replica-client")
    finally:
        server.close()
    latencies, devices = done.latencies, [answer["acceldemo"][0]["device"] for _, answer in done.answers]
    errors, wall = done.errors, done.wall
    first_calls = {p["device"]: p["shapes"][0]["first_call_seconds"] for p in status["pipelines"]
                   if p["mode"] == MODE and p["shapes"]}
    return {"throughput": len(latencies) / wall, "p50_s": _percentile(latencies, 0.5) if latencies else None,
            "p95_s": _percentile(latencies, 0.95) if latencies else None, "requests": len(latencies),
            "errors": errors, "wall_s": wall, "by_device": {d: devices.count(d) for d in sorted(set(devices))},
            "warm_up_first_call_s": first_calls}


def replicas(bench) -> list[Figure]:
    """Section 8: the three configurations one after the other (the first one on a cold compile cache)."""
    plan = bench.plan
    with tempfile.TemporaryDirectory(prefix="acceldemo-bench-replicas-") as cache_dir:
        runs = {name: _serve(name, cache_dir, bench) for name in ("2 replicas, 1 core each", "1 replica, 1 core",
                                                                  "1 replica, 2 cores")}
    two, one, both = runs["2 replicas, 1 core each"], runs["1 replica, 1 core"], runs["1 replica, 2 cores"]
    n, each = plan.replica_clients, plan.replica_per_client
    detail = {name: {k: v for k, v in run.items() if k != "errors"} | {"errors": run["errors"][:3]}
              for name, run in runs.items()}
    figures = [
        Figure("replicas_throughput", 8, f"{n} clients: throughput, 2 replicas of 1 core ÷ 1 replica of 1 core",
               "ratio", Spread.of([two["throughput"] / one["throughput"]]), Target(">=", 1.6), detail=detail,
               note=f"{MODEL} {MODE} {SIZE}, {STEPS} steps, {n}×{each} requests through /v1/images/generations: "
                    f"{two['throughput']:.2f} vs {one['throughput']:.2f} images/s; 1 replica on both cores "
                    f"{both['throughput']:.2f}/s; requests per replica {two['by_device']}",
               if_missed="the limit on 2 cores is 2; the app process and the clients share those cores with the "
                         "replicas, so serving overhead per request lowers it"),
        Figure("replicas_throughput_both_cores", 8, f"{n} clients: throughput, 1 replica on 2 cores ÷ 1 replica of "
                                                    "1 core", "ratio",
               Spread.of([both["throughput"] / one["throughput"]]),
               note="one process, torch's threads on both cores: what splitting the cores into replicas is weighed "
                    "against"),
    ]
    if two["p50_s"] and one["p50_s"]:
        figures.append(Figure("replicas_p50", 8, f"{n} clients: p50 latency, 2 replicas ÷ 1 replica (1 core each)",
                              "ratio", Spread.of([two["p50_s"] / one["p50_s"]]), Target("<=", 0.65),
                              note=f"p50 {two['p50_s'] * 1000:.0f} vs {one['p50_s'] * 1000:.0f} ms; 1 replica on 2 "
                                   f"cores {both['p50_s'] * 1000:.0f} ms"))
    first = two["warm_up_first_call_s"]
    if len(first) == 2:
        cold, loaded = first["cpu:0"], first["cpu:1"]
        figures.append(Figure(
            "replicas_compile_once", 8, "second replica's first call at a shape the first compiled ÷ the first's "
                                        "cold first call", "ratio", Spread.of([loaded / cold]), Target("<=", 0.15),
            note=f"start-up warm-up of {SIZE} on a cold cache: cpu:0 {cold:.2f} s (compiles, saves the package), "
                 f"cpu:1 {loaded:.2f} s (loads it)"))
    errors = sum(len(run["errors"]) for run in runs.values())
    figures.append(Figure("replicas_errors", 8, "errors (every configuration)", "errors", Spread.of([errors]),
                          Target("==", 0), note="; ".join(e for run in runs.values() for e in run["errors"][:1])))
    return figures
