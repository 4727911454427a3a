"""Section 7: end-to-end latency through the Gradio API and the OpenAI-compatible /v1 Images API of a real app.py on
a loopback port, ÷ in-process latency.

Only loopback traffic: the server binds 127.0.0.1 on a free port, and every loop is bounded by a request count.
"""
from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from ..records import Shape
from .figures import Figure, Spread, Target, interleaved, ratios

APP = Path(__file__).resolve().parents[2] / "app.py"
START_TIMEOUT_S = 300
SHAPE = Shape(64, 64)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AppServer:
    """app.py on a free loopback port: started at once (its start-up overlaps other sections), waited for later."""

    def __init__(self, warmup: str | None, model: str | None = None, env: dict[str, str] | None = None,
                 args: tuple[str, ...] = ()):
        self.url = f"http://127.0.0.1:{_free_port()}"
        environment = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"}
        for variable in ("ACCELDEMO_AUTH", "ACCELDEMO_API_TOKEN", "ACCELDEMO_HOST", "PORT", "ACCELDEMO_WARMUP",
                         "GRADIO_SERVER_NAME", "GRADIO_SERVER_PORT"):
            environment.pop(variable, None)  # the bench's client talks to a plain loopback server
        self.log = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen([sys.executable, str(APP), "--host", "127.0.0.1", "--port",
                                         self.url.rsplit(":", 1)[1], *(["--warmup", warmup] if warmup else []),
                                         *(["--model", model] if model else []), *args],
                                        env={**environment, **(env or {})},
                                        stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def ready(self) -> str:
        """The URL, once /ready answers 200 (the start-up warm-up is done)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=2):
                    return self.url
            except (OSError, urllib.error.HTTPError):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.log.seek(0)
                    raise RuntimeError(f"app.py did not become ready: {self.log.read()[-1500:]}") from None
                time.sleep(0.5)

    def output(self) -> str:
        """What the server printed so far."""
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def serving_request(bench):
    return bench.request(bench.plan.serving_mode, SHAPE)


def start_server(bench) -> AppServer:
    request = serving_request(bench)
    return AppServer(f"{request.mode}:{SHAPE}")


@dataclass
class Burst:
    """What `burst` measured: each answered request's seconds and JSON body, the refusals and failures, the wall
    time of the whole burst."""

    answers: list[tuple[float, dict]]
    errors: list[str]
    wall: float

    @property
    def latencies(self) -> list[float]:
        return [seconds for seconds, _ in self.answers]


def burst(url: str, clients: int, each: int, body: Callable[[int, int], dict], name: str) -> Burst:
    """`clients` plain-HTTP clients released at once, each posting `each` Images API requests (`body(client, i)`) one
    after the other."""
    answers: list[tuple[float, dict]] = []
    errors: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(clients)

    def client(c: int) -> None:
        with httpx.Client(base_url=url, timeout=600) as http:
            start.wait()
            for r in range(each):
                began = time.perf_counter()
                answer = http.post("/v1/images/generations", json=body(c, r))
                seconds = time.perf_counter() - began
                with lock:
                    if answer.status_code == 200:
                        answers.append((seconds, answer.json()))
                    else:
                        errors.append(f"{answer.status_code}: {answer.text[:160]}")

    threads = [threading.Thread(target=client, args=(c,), name=f"{name}-{c}") for c in range(clients)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return Burst(answers, errors, time.perf_counter() - began)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


class _Calls:
    """One request's served calls: through the Gradio API (`gradio_client`) and /v1, each timed end to end, with the
    server's own engine seconds of each (from the answer's facts)."""

    def __init__(self, request):
        self.arguments = (request.prompt, request.model, request.hardware, request.mode, request.placement, 2,
                          str(SHAPE), request.steps, request.guidance, request.seed)
        self.body = {"prompt": request.prompt, "model": request.model, "size": str(SHAPE), "seed": request.seed,
                     "num_inference_steps": request.steps, "guidance_scale": request.guidance,
                     "hardware": request.hardware, "mode": request.mode, "placement": request.placement}
        self.engine: list[float] = []
        self.v1_engine: list[float] = []

    def api(self, client) -> float:
        started = time.perf_counter()
        _, _, facts = client.predict(*self.arguments, api_name="/generate")
        seconds = time.perf_counter() - started
        self.engine.append(facts["seconds"])
        return seconds

    def v1(self, http: httpx.Client) -> float:
        started = time.perf_counter()
        answer = http.post("/v1/images/generations", json=self.body)
        answer.raise_for_status()
        seconds = time.perf_counter() - started
        self.v1_engine.append(answer.json()["acceldemo"][0]["seconds"])
        return seconds

    def concurrently(self, url: str, clients: int, each: int) -> dict:
        """`clients` gradio_client clients at once, `each` requests apiece: latencies, errors, wall and client CPU."""
        from gradio_client import Client

        made = [Client(url, verbose=False) for _ in range(clients)]
        latencies: list[float] = []
        errors: list[str] = []
        lock = threading.Lock()
        start = threading.Barrier(len(made))

        def one_client(c) -> None:
            start.wait()
            for _ in range(each):
                try:
                    seconds = self.api(c)
                except Exception as error:  # counted, and shown in the report
                    with lock:
                        errors.append(f"{type(error).__name__}: {error}"[:200])
                    continue
                with lock:
                    latencies.append(seconds)

        threads = [threading.Thread(target=one_client, args=(c,), name=f"bench-client-{i}")
                   for i, c in enumerate(made)]
        began, client_cpu = time.perf_counter(), time.process_time()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return {"latencies": latencies, "errors": errors, "wall": time.perf_counter() - began,
                "client_cpu": time.process_time() - client_cpu}


def measure_serving(bench, server: AppServer) -> list[Figure]:
    """Section 7 against `server`, which serves `serving_request(bench)`'s mode and shape."""
    from gradio_client import Client

    plan = bench.plan
    request = serving_request(bench)
    bench.engine.generate(request)
    calls = _Calls(request)
    url = server.ready()
    client = Client(url, verbose=False)
    with httpx.Client(base_url=url, timeout=START_TIMEOUT_S) as http:
        calls.api(client)
        calls.v1(http)
        calls.engine.clear()
        calls.v1_engine.clear()
        served, v1, local = interleaved([lambda: calls.api(client), lambda: calls.v1(http),
                                         lambda: bench.timed(request, wall=True)], plan.serving_single)
    engine_single = list(calls.engine)
    many = calls.concurrently(url, plan.serving_clients, plan.serving_per_client)
    return _single_client_figures(request, served, v1, local, engine_single, calls.v1_engine) + \
        _concurrent_figures(plan.serving_clients, many, statistics.median(local))


def _single_client_figures(request, served, v1, local, engine_single, v1_engine) -> list[Figure]:
    in_process, engine_s = statistics.median(local), statistics.median(engine_single)
    detail = {"served_s": Spread.of(served).__dict__, "in_process_s": Spread.of(local).__dict__,
              "server_engine_s": Spread.of(engine_single).__dict__, "p50_s": _percentile(served, 0.5),
              "p95_s": _percentile(served, 0.95), "mode": request.mode, "shape": str(SHAPE), "steps": request.steps}
    return [
        Figure("serving_p50_1_client", 7, "1 client: end-to-end via Gradio API ÷ in-process (p50)", "ratio",
               ratios(served, local), detail=detail,
               note=f"{len(served)} requests interleaved with in-process calls, {request.mode} {SHAPE}: "
                    f"{statistics.median(served) * 1000:.0f} ms end to end, of which {engine_s * 1000:.0f} ms in "
                    f"the server's engine; in-process {in_process * 1000:.0f} ms"),
        Figure("serving_p95_1_client", 7, "1 client: p95 end-to-end ÷ in-process median", "ratio",
               Spread.of([_percentile(served, 0.95) / in_process])),
        Figure("serving_v1_p50_1_client", 7, "1 client: end-to-end via /v1/images/generations ÷ in-process (p50)",
               "ratio", ratios(v1, local), Target("<=", 1.3),
               detail={"served_s": Spread.of(v1).__dict__, "server_engine_s": Spread.of(v1_engine).__dict__,
                       "p50_s": _percentile(v1, 0.5), "p95_s": _percentile(v1, 0.95)},
               note=f"the same {len(v1)} rounds, beside the Gradio API's: {statistics.median(v1) * 1000:.0f} ms end "
                    f"to end, of which {statistics.median(v1_engine) * 1000:.0f} ms in the server's engine "
                    f"(end to end ÷ the server's engine: {ratios(v1, v1_engine).median:.3g}); one JSON request, the "
                    "PNG base64 in the answer",
               if_missed="the note splits the time between the server's engine and the route around it; on a loaded "
                         "host the server's engine itself runs slower than this process's"),
    ]


def _concurrent_figures(n: int, run: dict, in_process: float) -> list[Figure]:
    latencies, errors, wall = run["latencies"], run["errors"], run["wall"]
    requests = len(latencies) + len(errors)
    throughput = len(latencies) / wall
    many = {"clients": n, "requests": requests, "p50_s": None, "p95_s": None, "wall_s": wall, "errors": errors[:5],
            "client_cpu_s_per_request": run["client_cpu"] / max(requests, 1)}
    figures = []
    if latencies:
        many.update(p50_s=_percentile(latencies, 0.5), p95_s=_percentile(latencies, 0.95))
        figures += [
            Figure(f"serving_p50_{n}_clients", 7, f"{n} concurrent clients: p50 end-to-end ÷ in-process", "ratio",
                   Spread.of([many["p50_s"] / in_process]), detail=many,
                   note=f"one job at a time per device: a request waits for up to {n - 1} ahead, so "
                        f"≈{n / 2:.0f}–{n} is the floor"),
            Figure(f"serving_p95_{n}_clients", 7, f"{n} concurrent clients: p95 end-to-end ÷ in-process", "ratio",
                   Spread.of([many["p95_s"] / in_process])),
            Figure(f"serving_throughput_{n}_clients", 7, f"{n} concurrent clients: throughput", "requests/s",
                   Spread.of([throughput]),
                   note=f"device busy {throughput * in_process:.0%} of the time (throughput × in-process latency; "
                        f"100% = no serving overhead); the {n} gradio_client instances spent "
                        f"{many['client_cpu_s_per_request'] * 1000:.0f} ms of CPU per request on this same host"),
        ]
    figures.append(Figure("serving_errors", 7, "errors (1 and concurrent clients)", "errors",
                          Spread.of([len(errors)]), Target("==", 0), note="; ".join(errors[:2]),
                          if_missed="the first errors are in the note; the server's own log says more"))
    return figures
