"""The engine in front of a fleet (replicas on other hosts): admission, counting, refusals — with a fleet whose
replicas are engines of this process, at the `Fleet` seam — and the real thing: app.py on a two-node Ray cluster
(`tests/fleet_cluster.py`, run here in a private network namespace)."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from acceldemo.bench.fleet import in_private_network_command, private_network_refusal
from acceldemo.builder import build_engine
from acceldemo.config import Settings
from acceldemo.engine import ReplicaView
from acceldemo.engine.stats import Outcome
from acceldemo.errors import ClientQueueFull, InvalidRequest, QueueFull, ReplicaLost
from acceldemo.records import GenerateParams, Phase, Progress
from tests.engines import new_manager

ROOT = Path(__file__).resolve().parents[1]


class EnginesFleet:
    """A fleet of `size` replicas that are engines of this process: each image is drawn by one of them, tagged with
    its node; `hold` keeps every run at its first denoise step until released; `lose` makes the next run fail as a
    lost replica does."""

    def __init__(self, size: int = 1):
        self.engines = [new_manager() for _ in range(size)]
        self.free = list(range(size))
        self.lock = threading.Condition()
        self.hold = threading.Event()
        self.hold.set()
        self.started = threading.Semaphore(0)
        self.lose = False
        self.runs = 0
        self.seeds: list[int] = []  # of the images run, in the order they were run

    def capacity(self, hardware: str) -> int:
        return len(self.engines) if hardware == "cpu" else 0

    def dispatch_window(self, hardware: str) -> int:
        return self.capacity(hardware)  # as a fleet of fixed replicas

    def devices_per_replica(self, hardware: str) -> int:
        return 1 if hardware == "cpu" else 0  # one CPU core each, as a Ray replica of num_cpus=1

    def run(self, request, on_progress, cancelled):
        if self.lose:
            raise ReplicaLost("pipelines-cpu", "its actor died twice")
        with self.lock:
            while not self.free:
                self.lock.wait()
            index = self.free.pop()
            self.runs += 1
            self.seeds.append(request.seed)
        try:
            def progress(value: Progress) -> None:
                if value.phase is Phase.DENOISE and value.step == 1:
                    self.started.release()
                    self.hold.wait(60)
                on_progress(value)

            result = self.engines[index].generate(request, progress, cancelled)
            return dataclasses.replace(result, node=f"host{index}/node{index}")
        finally:
            with self.lock:
                self.free.append(index)
                self.lock.notify()

    def warm_up(self, request, shapes):
        return self.engines[0].warm_up(request, [shape.shape for shape in shapes])

    def replicas(self) -> list[ReplicaView]:
        return [view for i, engine in enumerate(self.engines)
                for view in (dataclasses.replace(v, node=f"host{i}/node{i}") for v in engine.snapshot().replicas)]

    def close(self) -> None:
        for engine in self.engines:
            engine.close()


@pytest.fixture
def fleet_engine():
    made = []

    def make(size: int = 1, queue_size: int = 1):
        fleet = EnginesFleet(size)
        engine = build_engine(dataclasses.replace(Settings.from_env(), queue_size=queue_size), fleet=fleet,
                              node="ingress")
        made.append(engine)
        return engine, fleet

    yield make
    for engine in made:
        engine.close()


def _params(**fields) -> GenerateParams:
    return GenerateParams(**{"prompt": "a red circle", "resolution": "64x64", "steps": 2, "mode": "eager",
                             "hardware": "cpu", "seed": 1, **fields})


def test_images_run_on_the_fleet_with_their_node_and_are_counted_once(fleet_engine):
    engine, fleet = fleet_engine(size=2)
    result = engine.generate(_params(num_images=2))
    assert len(result.images) == 2 and all(image.size == (64, 64) for image in result.images)
    assert {facts["node"] for facts in (result.facts(0), result.facts(1))} <= {"host0/node0", "host1/node1"}
    assert fleet.runs == 2
    assert engine.snapshot().counters.requests[Outcome.OK] == 1
    assert {view.node for view in engine.snapshot().replicas} == {"host0/node0", "host1/node1"}


def test_on_a_fleet_one_clients_requests_in_flight_stop_at_the_replicas_plus_its_share(fleet_engine):
    engine, fleet = fleet_engine(size=1, queue_size=8)  # a share of 2
    fleet.hold.clear()
    alice = [engine.submit(engine.check(_params(seed=i)), client="alice") for i in range(3)]  # 1 drawing, 2 waiting
    with pytest.raises(ClientQueueFull) as refused:
        engine.submit(engine.check(_params(seed=9)), client="alice")
    assert "ACCELDEMO_CLIENT_QUEUE=2" in str(refused.value) and refused.value.retry_after_s >= 1
    bob = engine.submit(engine.check(_params(seed=10)), client="bob")  # the line has room for another client
    fleet.hold.set()
    assert all(job.result(60).images[0].size == (64, 64) for job in (*alice, bob))
    assert engine.submit(engine.check(_params(seed=11)), client="alice").result(60).images  # its share back


def test_on_a_fleet_clients_take_turns_in_the_engines_line(fleet_engine):
    engine, fleet = fleet_engine(size=1, queue_size=8)
    fleet.hold.clear()
    alice = [engine.submit(engine.check(_params(seed=i)), client="alice") for i in range(3)]  # 1 drawing, 2 waiting
    assert fleet.started.acquire(timeout=60)
    told: list[Progress] = []
    bob = engine.submit(engine.check(_params(seed=10)), told.append, client="bob")
    assert engine.snapshot().queue_depth == 3 and fleet.runs == 1  # the fleet has its window's one; the line the rest
    deadline = time.monotonic() + 30
    while not told and time.monotonic() < deadline:  # a waiting request is told its place within a poll of the line
        time.sleep(0.05)
    assert [p.message for p in told if p.phase is Phase.QUEUE] == ["1st in line for the fleet's cpu replicas"]
    fleet.hold.set()
    results = [job.result(60) for job in (*alice, bob)]
    assert all(result.images[0].size == (64, 64) for result in results)
    assert fleet.seeds == [0, 10, 1, 2]  # bob's one request before alice's second and third
    assert results[3].queue_wait > 0 and results[3].seconds > results[3].queue_wait
    assert engine.snapshot().queue_depth == 0


def test_a_full_fleet_line_is_refused_with_a_retry_after(fleet_engine):
    engine, fleet = fleet_engine(size=1, queue_size=1)
    fleet.hold.clear()
    running = engine.submit(engine.check(_params()))
    assert fleet.started.acquire(timeout=60)
    waiting = engine.submit(engine.check(_params(seed=2)))  # the line's one place
    with pytest.raises(QueueFull) as refused:
        engine.submit(engine.check(_params(seed=3)))
    assert refused.value.retry_after_s >= 1 and "ACCELDEMO_QUEUE_SIZE=1" in str(refused.value)
    assert engine.snapshot().queue_depth == 1
    fleet.hold.set()
    assert running.result(60).images[0].size == (64, 64) and waiting.result(60).images[0].size == (64, 64)
    counts = engine.snapshot().counters.requests
    assert counts[Outcome.OK] == 2 and counts[Outcome.REFUSED] == 1
    assert engine.snapshot().queue_depth == 0


def test_a_request_pinned_to_a_device_is_refused_on_a_fleet(fleet_engine):
    engine, _ = fleet_engine()
    with pytest.raises(InvalidRequest) as refused:
        engine.submit(engine.check(_params(device="cpu:0")))
    assert "device" in str(refused.value) and "Ray Serve places the replicas" in str(refused.value)


@pytest.mark.parametrize("placement", [{"placement": "tp", "tp_size": 2},
                                       {"placement": "cfg", "model": "tiny-sd3", "guidance": 4.5},
                                       {"placement": "cp", "cp_size": 2}])
def test_a_placement_wider_than_a_replica_is_refused_before_the_fleet_sees_it(fleet_engine, placement):
    engine, fleet = fleet_engine()
    request = engine.check(_params(**placement))
    with pytest.raises(InvalidRequest) as refused:
        engine.submit(request)
    assert refused.value.field == "placement" and str(refused.value).endswith(
        "a placement of at most 1 rank(s): each replica of this fleet holds 1 cpu device(s)")
    assert fleet.runs == 0 and engine.snapshot().counters.requests[Outcome.INVALID] == 1
    assert engine.generate(_params()).images[0].size == (64, 64)  # device placement: served


def test_a_lost_replica_fails_the_request_by_name(fleet_engine):
    engine, fleet = fleet_engine()
    fleet.lose = True
    with pytest.raises(ReplicaLost):
        engine.generate(_params())
    assert engine.snapshot().counters.requests[Outcome.OK] == 0
    fleet.lose = False
    assert engine.generate(_params()).images[0].size == (64, 64)  # the engine serves on


def test_ray_autoscaling_setting_is_checked():
    with pytest.raises(ValueError, match="ACCELDEMO_RAY_AUTOSCALING"):
        Settings.from_env({**os.environ, "ACCELDEMO_RAY_AUTOSCALING": "[1, 2]"})
    settings = Settings.from_env({**os.environ, "ACCELDEMO_RAY_AUTOSCALING": '{"min_replicas": 0, "max_replicas": 2}',
                                  "ACCELDEMO_RAY_ADDRESS": "auto"})
    assert settings.ray_autoscaling == {"min_replicas": 0, "max_replicas": 2} and settings.ray_address == "auto"


def _app_env(**variables: str) -> dict[str, str]:
    """This environment without any Ray or fleet setting, plus `variables`; Ray gives up on a closed port in seconds
    (one try, one second each for the GCS and its client), not minutes."""
    kept = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "ACCELDEMO_RAY_"))}
    return {**kept, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1", "RAY_gcs_server_port_wait_time_s": "1",
            "RAY_py_gcs_connect_timeout_s": "1", "RAY_gcs_rpc_server_connect_timeout_s": "1", **variables}


def _app_on_ray(address: str, **variables: str) -> tuple[int, list[str], str]:
    """app.py --ray `address`: its exit status, its `error:` lines and all it wrote to stderr. In a private network
    namespace, as everything that starts Ray here: its driver binds listeners of its own."""
    done = subprocess.run(in_private_network_command([sys.executable, "app.py", "--ray", address, "--port", "1"]),
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=_app_env(**variables),
                          stdin=subprocess.DEVNULL)
    return done.returncode, [line for line in done.stderr.splitlines() if line.startswith("error:")], done.stderr


@pytest.mark.heavy  # an app.py process of its own: outside --fast, in the full run
def test_the_app_joins_a_ray_cluster_only_with_its_token():
    status, errors, stderr = _app_on_ray("127.0.0.1:1")
    assert status == 2 and len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert errors[0].startswith("error: --ray 127.0.0.1:1: the app joins a Ray cluster only with token authentication")
    for name in ("RAY_AUTH_MODE=token", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "ACCELDEMO_RAY_INSECURE=1"):
        assert name in errors[0], errors


@pytest.mark.heavy  # an app.py process of its own: outside --fast, in the full run
def test_with_the_opt_out_the_app_warns_and_goes_on_to_connect():
    status, errors, stderr = _app_on_ray("127.0.0.1:1", ACCELDEMO_RAY_INSECURE="1")
    assert status == 2 and len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert "WARNING joining the Ray cluster at 127.0.0.1:1 WITHOUT token authentication (ACCELDEMO_RAY_INSECURE=1)" \
        in stderr, stderr[-3000:]
    assert "no Ray cluster to join (Failed to connect to Ray cluster at" in errors[0], errors
    assert "token" not in errors[0].lower(), errors


@pytest.mark.heavy  # an app.py process of its own: outside --fast, in the full run
def test_a_token_file_that_is_not_there_is_refused_by_name(tmp_path):
    missing = tmp_path / "auth_token"
    status, errors, stderr = _app_on_ray("127.0.0.1:1", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(missing))
    assert status == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert errors == [f"error: --ray 127.0.0.1:1: RAY_AUTH_TOKEN_PATH is set but file cannot be opened or is empty: "
                      f"{missing}"], stderr[-3000:]


def test_ray_auth_reads_the_mode_as_ray_does_and_names_a_mode_that_is_not_token(caplog):
    from acceldemo.fleet.ray_fleet import ray_auth

    settings = dataclasses.replace(Settings.from_env(_app_env()), ray_address="10.0.0.1:6379")
    assert ray_auth(settings, {"RAY_AUTH_MODE": "token"}) and ray_auth(settings, {"RAY_AUTH_MODE": "TOKEN"})
    with pytest.raises(ValueError, match=r"only with token authentication \(RAY_AUTH_MODE is 'disabled'\)"):
        ray_auth(settings, {"RAY_AUTH_MODE": "disabled"})
    insecure = dataclasses.replace(settings, ray_insecure=True)
    assert ray_auth(insecure, {"RAY_AUTH_MODE": "token"}) and not caplog.records  # a token, no warning
    assert not ray_auth(insecure, {})
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "10.0.0.1:6379" in caplog.records[0].message


def test_a_cluster_that_refuses_the_token_is_told_apart_from_no_cluster():
    from acceldemo.fleet.ray_fleet import join_refusal

    def failed(cause: str) -> ConnectionError:
        error = ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379")
        error.__cause__ = RuntimeError(f"Failed to connect to GCS. Last connection error: Traceback ...\n{cause}")
        return error

    refused = failed("ray.exceptions.AuthenticationError: RPC error: InvalidAuthToken: Authentication token is "
                     "missing or incorrect.")
    assert join_refusal(refused, with_token=True).startswith("the Ray cluster refused this app's token")
    assert join_refusal(refused, with_token=False).startswith("the Ray cluster asks for its token: set RAY_AUTH_MODE")
    timed_out = failed("ray.exceptions.RpcError: Timed out while waiting for GCS to become available.")
    assert join_refusal(timed_out, with_token=True) == \
        "no Ray cluster to join (Failed to connect to Ray cluster at 10.0.0.1:6379)"


def test_the_ray_opt_out_is_a_switch():
    assert not Settings.from_env(_app_env()).ray_insecure
    assert Settings.from_env(_app_env(ACCELDEMO_RAY_INSECURE="1")).ray_insecure
    with pytest.raises(ValueError, match=r"ACCELDEMO_RAY_INSECURE='maybe' is not accepted: 1 or 0"):
        Settings.from_env(_app_env(ACCELDEMO_RAY_INSECURE="maybe"))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_app_on_a_two_node_ray_cluster():
    """tests/fleet_cluster.py in a private network namespace, on a cluster that asks for its token: requests spread
    over both nodes, a killed replica's request served elsewhere and the replica replaced, a full line answered 429,
    scale to zero and back; a `ray.init` without the token refused, the app with a wrong one stopped in one line."""
    refusal = private_network_refusal()
    assert refusal is None, refusal
    done = subprocess.run(in_private_network_command(
        [sys.executable, "-m", "pytest", "tests/fleet_cluster.py", "-v", "-p", "no:cacheprovider", "-x",
         "-o", "addopts="]), cwd=ROOT, capture_output=True, text=True, timeout=1400,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    tail = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, tail
    assert "7 passed" in done.stdout, tail


@pytest.mark.slow
def test_the_app_without_a_ray_cluster_says_so_and_exits():
    done = subprocess.run(in_private_network_command(
        [sys.executable, "app.py", "--ray", "auto", "--port", "1"]), cwd=ROOT, capture_output=True, text=True,
        timeout=300, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ADDRESS": "", "RAY_AUTH_MODE": "token",
                          "RAY_AUTH_TOKEN": "a" * 64})
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--ray auto: no Ray cluster to join (Could not find any running Ray instance" in done.stderr


def test_the_fleet_plan_places_a_replica_per_device_set_of_the_cluster():
    from acceldemo.fleet.ray_fleet import plan_fleet

    settings = Settings.from_env()
    cpu = plan_fleet(settings, {"CPU": 2.0, "memory": 8e9})
    assert (cpu.hardware, cpu.devices_per_replica, cpu.replicas, cpu.capacity) == ("cpu", 1, 2, 2)
    assert cpu.actor_options == {"num_cpus": 1.0} and not cpu.found["cuda"].available
    # A GPU cluster serves CUDA; the CPU is named as not served.
    small = plan_fleet(settings, {"CPU": 32.0, "GPU": 8.0})
    assert (small.hardware, small.devices_per_replica, small.replicas) == ("cuda", 1, 8)
    assert small.actor_options == {"num_cpus": 1.0, "num_gpus": 1} and "serves cuda" in small.found["cpu"].reason
    # FLUX.2-dev does not fit one 24 GB GPU: a replica is a tensor-parallel group of T GPUs on one node.
    big = plan_fleet(dataclasses.replace(settings, device_memory_gb={"cuda": 24.0}), {"CPU": 32.0, "GPU": 8.0},
                     "flux2-dev")
    assert big.devices_per_replica > 1 and big.replicas == 8 // big.devices_per_replica
    assert big.actor_options["num_gpus"] == big.devices_per_replica and "tensor parallel" in big.reason
    neuron = plan_fleet(settings, {"CPU": 32.0, "neuron_cores": 32.0})
    assert neuron.hardware == "neuron" and neuron.actor_options["resources"] == {"neuron_cores": 1}
    autoscaled = plan_fleet(dataclasses.replace(settings, ray_autoscaling={"min_replicas": 0, "max_replicas": 5}),
                            {"CPU": 2.0})
    assert autoscaled.capacity == 5
    with pytest.raises(Exception, match="offers no devices"):
        plan_fleet(settings, {"memory": 1e9})


def test_a_routing_key_is_a_type_that_reads_back_what_a_replica_reports(manager):
    from acceldemo.fleet.replica import RoutingKey, routing_key

    request = manager.check(GenerateParams(prompt="a red circle", mode="compiled", resolution="64x128"))
    text = routing_key(request)
    key = RoutingKey.parse(text)
    assert key == RoutingKey.of(request) and str(key) == text
    assert (key.model, key.mode, key.placement, str(key.shape)) == (request.model, "compiled", "device", "64x128")
    assert RoutingKey.parse("not|a|key") is None and RoutingKey.parse("m|cpu|eager|device|big") is None
