"""The line's limit holds at every door: the page (gradio_client) and /v1 admit a request into the engine's line as
it arrives, or refuse it at once with the engine's message; no door keeps a queue of its own."""
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from gradio_client import Client

from acceldemo.errors import QueueFull
from acceldemo.records import GenerateParams, Shape
from acceldemo.ui.server import create_app
from tests.engines import DeviceHolder, free_port, new_manager, serving, settings_with

ROOT = Path(__file__).resolve().parents[1]


def status(url: str) -> dict:
    with urllib.request.urlopen(url + "/status", timeout=30) as response:
        return json.load(response)


class Watch:
    """/status read again and again while a burst runs: the most requests it ever showed waiting."""

    def __init__(self, url: str):
        self.url, self.most, self._stop = url, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.most = max(self.most, status(self.url)["queue_depth"])
            time.sleep(0.05)

    def stop(self) -> int:
        self._stop.set()
        self.thread.join(30)
        return self.most


def test_a_full_line_is_refused_at_once_with_the_expected_wait(fresh_manager):
    m = fresh_manager(queue_size=1)
    holder = DeviceHolder(m)
    holder.start()
    try:
        m.submit(m.check(GenerateParams(prompt="waits", hardware="cpu", steps=1)))
        started = time.monotonic()
        with pytest.raises(QueueFull) as refused:
            m.submit(m.check(GenerateParams(prompt="one too many", hardware="cpu", steps=1)))
        assert time.monotonic() - started < 1  # refused, not kept waiting
        assert refused.value.retry_after_s >= 1 and refused.value.ahead == 1
        assert str(refused.value).endswith(f"try again in about {refused.value.retry_after_s} s")
        assert m.queue_depth() == 1 and m.snapshot().counters.requests["refused"] == 1
    finally:
        holder.release()


def test_the_expected_wait_follows_the_line_and_the_recent_latency(fresh_manager):
    m = fresh_manager(queue_size=2)
    m.generate(GenerateParams(prompt="measured", hardware="cpu", steps=1))  # a latency for its model and shape
    latency = m.backend.ledger.latency("tiny-flux2-klein", Shape(64, 64))
    holder = DeviceHolder(m)
    holder.start()
    try:
        for _ in range(2):
            m.submit(m.check(GenerateParams(prompt="waits", hardware="cpu", steps=1)))
        with pytest.raises(QueueFull) as refused:
            m.submit(m.check(GenerateParams(prompt="refused", hardware="cpu", steps=1)))
        # Two ahead of it for the one device, plus the one running: at least 1 s, never less.
        assert refused.value.retry_after_s == max(1, -(-3 * latency // 1))
    finally:
        holder.release()


@pytest.mark.slow
def test_no_door_queues_past_the_engines_limit_on_two_replicas():
    # ACCELDEMO_QUEUE_SIZE=2 on two one-core replicas: 24 simultaneous /v1 requests, then 12 gradio_client ones.
    m = new_manager(settings_with(queue_size=2, replicas={"cpu": 2}))
    try:
        with serving(create_app(m)) as url:
            for device in ("cpu:0", "cpu:1"):  # both replicas up and their pipeline loaded
                m.generate(GenerateParams(prompt="warm", hardware="cpu", device=device, steps=1, seed=0))
            body = {"prompt": "a red circle", "num_inference_steps": 12}

            async def burst() -> list[httpx.Response]:
                async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                    return await asyncio.gather(*(client.post("/v1/images/generations", json={**body, "seed": i})
                                                  for i in range(24)))

            watch = Watch(url)
            answers = asyncio.run(burst())
            most_waiting = watch.stop()
            codes = [answer.status_code for answer in answers]
            assert set(codes) <= {200, 429} and codes.count(429) >= 1, codes
            refused = [answer for answer in answers if answer.status_code == 429]
            assert all(int(answer.headers["retry-after"]) >= 1 for answer in refused)
            assert all(answer.json()["error"]["code"] == "queue_full" for answer in refused)
            assert most_waiting <= 2
            counted = status(url)["counters"]["requests"]
            assert (counted["refused"], counted["ok"]) == (codes.count(429), codes.count(200) + 2), counted

            def through_the_page(seed: int) -> str:
                try:
                    Client(url + "/", verbose=False).predict(
                        "a red circle", "tiny-flux2-klein", "cpu", "eager", "auto", 2, "64x64", 12, 1.0, seed,
                        api_name="/generate")
                    return "served"
                except Exception as error:
                    return str(error)

            watch = Watch(url)
            with ThreadPoolExecutor(12) as pool:
                outcomes = list(pool.map(through_the_page, range(12)))
            most_waiting = watch.stop()
            full = [o for o in outcomes if o != "served"]
            assert full and all(o.startswith("the queue is full: 2 request(s) are already waiting for a device "
                                             "(ACCELDEMO_QUEUE_SIZE=2); try again in about") for o in full), outcomes
            assert most_waiting <= 2
            assert status(url)["counters"]["requests"]["refused"] == codes.count(429) + len(full)
    finally:
        m.close()


def _rss_mib(pid: int) -> float:
    line = next(line for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


@pytest.mark.slow
def test_a_burst_of_200_against_a_line_of_8_is_answered_within_a_minute_in_bounded_memory(tmp_path):
    port = free_port()
    env = {**os.environ, "ACCELDEMO_QUEUE_SIZE": "8"}
    with open(tmp_path / "app.log", "w") as log:
        app = subprocess.Popen([sys.executable, "app.py", "--port", str(port)], cwd=ROOT, env=env, stdout=log,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.post(url + "/v1/images/generations", json={"prompt": "warm", "num_inference_steps": 1},
                           timeout=60).raise_for_status()
                break
            except httpx.HTTPError:
                assert app.poll() is None and time.monotonic() < deadline, (tmp_path / "app.log").read_text()[-2000:]
                time.sleep(0.5)
        before = _rss_mib(app.pid)

        async def burst() -> list[tuple[int, float]]:
            limits = httpx.Limits(max_connections=250)
            async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
                async def one(i: int) -> tuple[int, float]:
                    started = time.monotonic()
                    answer = await client.post("/v1/images/generations",
                                               json={"prompt": "a red circle", "num_inference_steps": 4, "seed": i})
                    return answer.status_code, time.monotonic() - started
                return await asyncio.gather(*(one(i) for i in range(200)))

        answers = asyncio.run(burst())
        grown = _rss_mib(app.pid) - before
        codes = [code for code, _ in answers]
        print(f"200 requests at once against a line of 8: {codes.count(200)} served, {codes.count(429)} refused, "
              f"slowest answer {max(s for _, s in answers):.1f} s; app RSS {before:.0f} MiB, {grown:+.0f} MiB")
        assert set(codes) <= {200, 429} and codes.count(429) >= 150
        assert max(seconds for _, seconds in answers) < 60
        assert grown < 100
    finally:
        app.terminate()
        app.wait(30)
