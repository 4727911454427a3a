"""Devices with an index: requests run one per device at the same time, a fifth hardware plugs in as one file."""
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from acceldemo.hardware import register, unregister
from acceldemo.records import GenerateParams, Phase
from tests.engines import free_port
from tests.fakes.fifth_hardware import TwinAccelerator, write_plugin
from tests.fakes.standin_packages import python_path

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def twin():
    """The two-device fake hardware, registered in this process for one test (engines made meanwhile know it)."""
    register(TwinAccelerator)
    yield TwinAccelerator
    unregister("twin")


def test_two_devices_run_two_requests_at_once_and_a_third_waits(twin, fresh_manager):
    from acceldemo.ui.server import create_app

    m = fresh_manager()
    release = threading.Event()
    running: set[int] = set()  # seeds that reached their first denoise step
    queued: dict[int, list[str]] = {0: [], 1: [], 2: []}

    def ask(seed: int, results: dict) -> None:
        def progress(event):
            if event.phase is Phase.QUEUE and event.message.endswith("in line for twin:0 or twin:1"):
                queued[seed].append(event.message)
            if event.phase is Phase.DENOISE and seed not in running:
                running.add(seed)
                release.wait(120)
        results[seed] = m.generate(GenerateParams(prompt="a red circle", hardware="twin", steps=2, seed=seed),
                                   progress)

    results: dict = {}
    threads = [threading.Thread(target=ask, args=(seed, results)) for seed in range(2)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120
    while len(running) < 2:
        assert time.monotonic() < deadline, running
        time.sleep(0.05)
    third = threading.Thread(target=ask, args=(2, results))
    third.start()
    while not queued[2]:
        assert time.monotonic() < deadline, queued
        time.sleep(0.05)
    # Without `with`, the app's lifespan (which closes the manager at its end) does not run.
    devices = {d["device"]["device"]: d for d in TestClient(create_app(m)).get("/status").json()["devices"]}
    assert devices["twin:0"]["running"] and devices["twin:1"]["running"]
    assert devices["twin:0"]["running"].startswith("64x64") and devices["twin:1"]["waiting"] == 1
    assert queued[2] == ["1st in line for twin:0 or twin:1"] and 2 not in running and m.queue_depth() == 1
    release.set()
    for thread in (*threads, third):
        thread.join(120)
    used = {results[seed].facts()["device"] for seed in (0, 1)}
    assert used == {"twin:0", "twin:1"}  # the first two ran side by side, one on each device
    assert results[2].facts()["device"] in used and results[2].image.size == (64, 64)
    # Each device keeps its own resident pipeline; the third request went to one that already held it.
    snapshot = m.snapshot()
    assert sorted(str(p.key.devices) for p in snapshot.pipelines) == ["twin:0", "twin:1"]
    assert snapshot.counters.loads == 2, snapshot


def test_a_request_can_name_its_device_and_a_wrong_one_is_refused(twin, fresh_manager):
    from acceldemo.errors import InvalidRequest, UnsupportedCombination

    m = fresh_manager()
    result = m.generate(GenerateParams(prompt="a red circle", hardware="twin", device="twin:1", steps=1))
    assert result.facts()["device"] == "twin:1"
    with pytest.raises(InvalidRequest, match=r"device='twin:2' is not accepted: one of twin:0, twin:1 here"):
        m.generate(GenerateParams(prompt="x", device="twin:2"))
    with pytest.raises(UnsupportedCombination, match="device twin:0 is not a cpu device"):
        m.generate(GenerateParams(prompt="x", hardware="cpu", device="twin:0"))
    with pytest.raises(InvalidRequest, match="device='gpu one' is not accepted: a device as hardware:index"):
        m.generate(GenerateParams(prompt="x", device="gpu one"))


def _with_plugin(tmp_path) -> dict:
    return {**os.environ, "PYTHONPATH": python_path(write_plugin(tmp_path / "site"))}


@pytest.mark.slow
def test_a_fifth_hardware_in_one_file_shows_in_info_cli_bench_and_page(tmp_path):
    env = _with_plugin(tmp_path)

    def run(*args) -> str:
        done = subprocess.run([sys.executable, "-m", "acceldemo", *args], capture_output=True, text=True, cwd=ROOT,
                              env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    info = json.loads(run("info", "--json"))
    twin = next(h for h in info["hardware"] if h["name"] == "twin")
    assert [d["device"] for d in twin["devices"]] == ["twin:0", "twin:1"]
    klein = next(m for m in info["models"] if m["name"] == "tiny-flux2-klein")
    assert next(o for o in klein["offers"] if o["hardware"] == "twin")["proposal"]["placement"] == "device"
    assert "{cpu,cuda,neuron,tpu,twin,zerogpu}" in run("generate", "--help")
    assert "{cpu,cuda,neuron,tpu,twin,zerogpu}" in run("bench", "--help")
    facts = json.loads(run("generate", "--prompt", "a red circle", "--hardware", "twin", "--device", "twin:1",
                           "--out", str(tmp_path / "out"), "--json").splitlines()[-1])
    assert facts["device"] == "twin:1" and Path(facts["path"]).exists()

    port = free_port()
    app = subprocess.Popen([sys.executable, "app.py", "--port", str(port)], cwd=ROOT, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        config = _json_when_up(f"http://127.0.0.1:{port}/config", app)
        dropdown = next(c for c in config["components"] if c.get("props", {}).get("elem_id") == "hardware")
        assert "twin" in [value for _, value in dropdown["props"]["choices"]]
    finally:
        app.terminate()
        app.wait(30)


def _json_when_up(url: str, process: subprocess.Popen) -> dict:
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return json.load(response)
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()[-2000:]
            time.sleep(0.5)
