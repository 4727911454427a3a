"""Replicas: copies of a pipeline on the host's devices behind the engine's one line — here two CPU replicas, each a
worker process pinned to its own core."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from acceldemo.records import DeviceSet, GenerateParams, Phase, ReplicaState, Shape
from tests.engines import new_manager, processes_started_by, settings_with

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def two_replicas():
    """An engine whose CPU is split into two replicas of one core each (its settings say so: the hardware adapter
    splits the cores by them)."""
    made = []

    def make(**overrides):
        made.append(new_manager(settings_with(replicas={"cpu": 2}, **overrides)))
        return made[-1]

    yield make
    for manager in made:
        manager.close()
    assert processes_started_by(os.getpid()) == []  # no replica outlives its manager


def request(seed: int = 0, **fields) -> GenerateParams:
    return GenerateParams(**{"prompt": "a red circle on a blue background", "hardware": "cpu", "steps": 2,
                             "seed": seed, **fields})


def replicas_of(engine) -> dict:
    return {str(r.devices): r for r in engine.snapshot().replicas}


def test_the_cpu_splits_into_one_device_per_replica_each_a_pinned_worker(two_replicas):
    cpu = two_replicas().hardware.get("cpu")
    cores = sorted(os.sched_getaffinity(0))
    half = (len(cores) + 1) // 2
    assert cpu.device_sets(1) == [DeviceSet("cpu", (0,)), DeviceSet("cpu", (1,))]
    assert [cpu.cores(s) for s in cpu.device_sets(1)] == [cores[:half], cores[half:]]
    assert not cpu.in_process(DeviceSet("cpu", (0,)))
    assert cpu.pin_env(DeviceSet("cpu", (1,))) == {"OMP_NUM_THREADS": str(len(cpu.cores(DeviceSet("cpu", (1,)))))}


@pytest.mark.slow
def test_two_replicas_serve_two_requests_at_the_same_time(two_replicas):
    m = two_replicas()
    for seed in (0, 1):  # both replicas up and warm: the timed calls below only run
        m.generate(request(seed, device=f"cpu:{seed}"))
    spans: dict[str, tuple[float, float]] = {}

    def ask(seed):
        started = time.monotonic()
        result = m.generate(request(seed, steps=30))
        spans[result.facts()["device"]] = (started, time.monotonic())

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(ask, (10, 11)))
    (a_start, a_end), (b_start, b_end) = spans["cpu:0"], spans["cpu:1"]
    assert a_start < b_end and b_start < a_end  # the intervals overlap: one request on each replica at once
    replicas = replicas_of(m)
    assert {d: (r.state, r.served) for d, r in replicas.items()} == {"cpu:0": (ReplicaState.IDLE, 2),
                                                                      "cpu:1": (ReplicaState.IDLE, 2)}
    assert replicas["cpu:0"].shapes == (Shape(64, 64),) and replicas["cpu:1"].last_latency > 0


@pytest.mark.slow
@pytest.mark.inductor
def test_a_second_replica_loads_the_shape_the_first_compiled(two_replicas, tmp_path):
    # Real inductor in the replicas (the tests' own process keeps aot_eager): mode compiled saves a package per
    # shape, which the second replica loads instead of compiling.
    m = two_replicas(cpu_compile_backend="inductor", cache_dir=tmp_path)
    first = m.generate(request(mode="compiled", device="cpu:0"))
    second = m.generate(request(mode="compiled", device="cpu:1"))
    assert (first.new_graphs, first.compile_cache_hits) == (1, 0)
    assert (second.new_graphs, second.compile_cache_hits) == (0, 1)
    assert second.compile_seconds < first.compile_seconds / 5
    assert m.artifacts.counts() == {"built": 1, "loaded": 1, "rejected": 0, "fetched": 0, "published": 0,
                                    "store_failed": 0}
    assert len(list(tmp_path.glob("aoti/*/cpu/*.pt2"))) == 1


@pytest.mark.slow
def test_warm_up_warms_every_replica(two_replicas):
    m = two_replicas()
    records = m.warm_up(request(mode="regional"), [Shape(64, 64), Shape(96, 64)])
    assert [(str(r.devices), str(r.shape), r.state) for r in records] == [
        ("cpu:0", "64x64", "ready"), ("cpu:0", "96x64", "ready"), ("cpu:1", "64x64", "ready"),
        ("cpu:1", "96x64", "ready")]
    for devices in ("cpu:0", "cpu:1"):
        assert m.generate(request(mode="regional", device=devices, resolution="96x64")).new_graphs == 0


@pytest.mark.slow
def test_a_killed_replica_loses_no_request_and_comes_back(two_replicas):
    m = two_replicas()
    for seed in (0, 1):  # both replicas up: the victim's rank is known before the clients start
        m.generate(request(seed, device=f"cpu:{seed}"))
    (victim,) = [p.ranks[0].pid for p in m.backend.executor.health() if str(p.devices) == "cpu:1"]
    killed = threading.Event()
    done: list[str] = []

    def kill_cpu1_mid_request():
        running_on = []

        def progress(event):
            # At a denoise step on cpu:1 once a few requests are through, its rank dies under the request.
            # `running on cpu:1` or, for a call shared with others, `running on cpu:1, drawn together with …`
            if event.phase is Phase.QUEUE and event.message.startswith("running on "):
                running_on.append(event.message.removeprefix("running on ").split(",")[0])
            if running_on[-1:] == ["cpu:1"] and event.phase is Phase.DENOISE and len(done) >= 4 \
                    and not killed.is_set():
                killed.set()
                os.kill(victim, signal.SIGKILL)
        return progress

    def client(c):
        for r in range(4):
            result = m.generate(request(100 * c + r, steps=3), kill_cpu1_mid_request())
            assert result.request.seed == 100 * c + r and result.image.size == (64, 64)
            done.append(result.facts()["device"])

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(client, range(8)))
    assert killed.is_set() and len(done) == 32  # every request came back with its own image
    counters = m.snapshot().counters
    assert counters.requests["ok"] == 34 and counters.replica_restarts == 1
    deadline = time.monotonic() + 120
    while (replica := replicas_of(m)["cpu:1"]).state is not ReplicaState.IDLE:
        assert time.monotonic() < deadline and replica.state is not ReplicaState.DOWN, replica
        time.sleep(0.5)
    assert replica.restarts == 1 and replica.pipelines  # restarted in the background, its pipeline loaded again
    assert m.generate(request(7, device="cpu:1")).facts()["device"] == "cpu:1"


@pytest.mark.slow
@pytest.mark.inductor
def test_two_apps_sharing_a_cache_compile_a_shape_at_once_and_leave_one_package(tmp_path):
    # The simplest scale-out: several app instances on one compile-cache folder. Both succeed; one compiles,
    # the other waits for its package and loads it.
    env = {**os.environ, "ACCELDEMO_CACHE_DIR": str(tmp_path), "ACCELDEMO_CPU_COMPILE_BACKEND": "inductor"}
    command = [sys.executable, "-m", "acceldemo", "generate", "--prompt", "a red circle", "--mode", "compiled",
               "--json"]
    runs = [subprocess.Popen([*command, "--out", str(tmp_path / f"out{i}")], cwd=ROOT, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
    facts = []
    for run in runs:
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, err[-2000:]
        facts.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted((f["new_graphs"], f["compile_cache_hits"]) for f in facts) == [(0, 1), (1, 0)]
    (package,) = tmp_path.glob("aoti/*/cpu/*.pt2")
    assert json.loads(package.with_suffix(".json").read_text())["shape"] == "64x64"
