"""Section 9, the fleet: app.py on a real local Ray cluster (`ray start` nodes of one CPU each), measured against
itself on fewer nodes and against the single-host app. Also the helpers the fleet tests use: a private network with
only loopback (Ray binds some listeners on every interface), a local cluster that asks for its token, an app on it.

Run it with `python -m acceldemo bench --sections fleet`; outside a private network the section re-runs itself in
one (`unshare --net`, as root), or says why it cannot.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from .figures import Figure, Spread, Target, ratios
from .serving import AppServer, _percentile

NODE_MEMORY = 300_000_000  # each node's object store: images are small
# What every Ray process of the bench and the tests sees: no usage reports. Token authentication is each cluster's
# own (`LocalCluster.auth_env`).
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0"}


def in_private_network() -> bool:
    """Whether this process's network namespace has only the loopback interface (and it is up)."""
    return {name for _, name in socket.if_nameindex()} == {"lo"}


def private_network_refusal() -> str | None:
    """Why this host cannot give a command a private network namespace, or None when it can."""
    if in_private_network():
        return None
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare and ip (util-linux, iproute2) are needed to run Ray in a private network namespace"
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare --net is refused here ({probe.stderr.strip()[:200]}): run as root"
    return None


def in_private_network_command(argv: list[str]) -> list[str]:
    """`argv` run in a new network namespace with only loopback, up."""
    if in_private_network():
        return argv
    return ["unshare", "--net", "bash", "-c", 'ip link set lo up && exec "$@"', "bash", *argv]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalCluster:
    """A Ray cluster of `ray start` nodes on 127.0.0.1, each with `cpus` CPUs, no dashboard, a small object store;
    its own temp dir. Run in a private network namespace. `add_node()` adds one more; `close()` stops them all.

    It asks for its token (RAY_AUTH_MODE=token), a fresh random one in a 0600 file of its temp dir: `auth_env` is what
    a process that joins it needs (the file's path, never the token itself, so no environment, command line or log
    holds the secret; and it goes with the temp dir)."""

    def __init__(self, nodes: int = 2, cpus: int = 1):
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.temp = tempfile.mkdtemp(prefix="acceldemo-ray-")
        token_path = Path(self.temp) / "auth_token"
        with os.fdopen(os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as token:
            token.write(secrets.token_hex(32))  # as `ray get-auth-token --generate` makes one
        self.auth_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}
        # RAY_AUTH_TOKEN would win over the file: one inherited from this process's environment must not.
        self.env = {**{k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"}, **RAY_ENV, **self.auth_env,
                    "RAY_ADDRESS": self.address}
        self.cpus = cpus
        self._ray = str(Path(sys.executable).with_name("ray"))
        try:
            self._start(["--head", f"--port={self.port}", f"--temp-dir={self.temp}", "--include-dashboard=false"])
            for _ in range(nodes - 1):
                self.add_node()
        except BaseException:
            self.close()
            raise

    def _start(self, role: list[str]) -> None:
        done = subprocess.run([self._ray, "start", *role, "--node-ip-address=127.0.0.1", f"--num-cpus={self.cpus}",
                               "--num-gpus=0", f"--object-store-memory={NODE_MEMORY}", "--disable-usage-stats"],
                              env=self.env, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"ray start {' '.join(role)} failed: {(done.stdout + done.stderr)[-1500:]}")

    def add_node(self) -> None:
        self._start([f"--address={self.address}"])

    def close(self) -> None:
        subprocess.run([self._ray, "stop", "--force"], env=self.env, capture_output=True, timeout=120,
                       stdin=subprocess.DEVNULL)
        shutil.rmtree(self.temp, ignore_errors=True)


def fleet_app(cluster: LocalCluster, env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> AppServer:
    """app.py serving on `cluster` (its replicas one CPU each, joined with the cluster's token), on a free loopback
    port. An inherited RAY_AUTH_TOKEN is emptied: Ray would prefer it to the cluster's file, and ignores it empty."""
    return AppServer(None, env={**RAY_ENV, **cluster.auth_env, "RAY_AUTH_TOKEN": "", "OMP_NUM_THREADS": "1",
                                "ACCELDEMO_CPU_COMPILE_BACKEND": "aot_eager", **(env or {})},
                     args=("--ray", cluster.address, *args))


def _v1(url: str, body: dict, timeout: float = 300) -> dict:
    answer = httpx.post(url + "/v1/images/generations", json=body, timeout=timeout)
    answer.raise_for_status()
    return answer.json()


def _throughput(url: str, body: dict, clients: int, per_client: int) -> tuple[float, list[str], list[str]]:
    """Images per second of `clients` threads each sending `per_client` requests; the nodes that drew them."""
    nodes: list[str] = []
    errors: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(clients)

    def one() -> None:
        start.wait()
        for _ in range(per_client):
            try:
                node = _v1(url, body)["acceldemo"][0]["node"]
            except Exception as error:  # counted and shown
                with lock:
                    errors.append(f"{type(error).__name__}: {error}"[:200])
                continue
            with lock:
                nodes.append(node)

    threads = [threading.Thread(target=one) for _ in range(clients)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(nodes) / (time.perf_counter() - began), nodes, errors


def measure_fleet(clients: int = 8, per_client: int = 3, single: int = 15) -> list[Figure]:
    """§9 in this (private) network: throughput on two nodes ÷ one, and the Ray ingress's 1-client p50 ÷ the
    single-host /v1's, each pair measured in this one run."""
    body = {"prompt": "a red circle on a blue background", "size": "64x64", "seed": 1, "mode": "eager"}
    figures = []
    cluster = LocalCluster(nodes=2)
    try:
        per_nodes = {}
        for replicas in (1, 2):
            app = fleet_app(cluster, {"ACCELDEMO_QUEUE_SIZE": str(clients * per_client)},
                            args=("--replicas", str(replicas)))
            try:
                url = app.ready()
                for _ in range(replicas * 2):  # every replica has loaded the model before the clock starts
                    _v1(url, body)
                per_nodes[replicas] = _throughput(url, body, clients, per_client)
                if replicas == 1:
                    fleet_single = _latencies(url, body, single)
            finally:
                app.close()
    finally:
        cluster.close()
    host = AppServer(None, env={"OMP_NUM_THREADS": "1"})
    try:
        url = host.ready()
        _v1(url, body)
        host_single = _latencies(url, body, single)
    finally:
        host.close()
    (one, _, errors_1), (two, nodes, errors_2) = per_nodes[1], per_nodes[2]
    spread = {node: nodes.count(node) for node in sorted(set(nodes))}
    figures.append(Figure(
        "fleet_throughput_2_nodes", 9, f"{clients} clients: throughput on two one-CPU nodes ÷ one node", "ratio",
        Spread.of([two / one]), Target(">=", 1.6),
        detail={"one_node_images_per_s": one, "two_nodes_images_per_s": two, "images_by_node": spread,
                "errors": (errors_1 + errors_2)[:5]},
        note=f"64x64 eager through /v1, {clients}×{per_client} requests: {one:.2f} → {two:.2f} images/s; "
             f"images by node {json.dumps(spread)}",
        if_missed="the two nodes share this host's two cores with the app and the clients"))
    figures.append(Figure(
        "fleet_ingress_p50", 9, "1 client: p50 through the Ray fleet ÷ the single-host /v1", "ratio",
        ratios([statistics.median(fleet_single)], [statistics.median(host_single)]), Target("<=", 1.3),
        detail={"fleet_p50_s": _percentile(fleet_single, 0.5), "host_p50_s": _percentile(host_single, 0.5),
                "fleet_s": Spread.of(fleet_single).__dict__, "host_s": Spread.of(host_single).__dict__},
        note=f"{single} requests each, 64x64 eager: {statistics.median(fleet_single) * 1000:.0f} ms through Ray "
             f"Serve, {statistics.median(host_single) * 1000:.0f} ms on the single host"))
    return figures


def _latencies(url: str, body: dict, count: int) -> list[float]:
    seconds = []
    for _ in range(count):
        started = time.perf_counter()
        _v1(url, body)
        seconds.append(time.perf_counter() - started)
    return seconds


def fleet(bench) -> list[Figure]:
    """The runner's §9: measured here when this process has a private network, else in a child that has one."""
    if in_private_network():
        return measure_fleet()
    refusal = private_network_refusal()
    if refusal:
        return [Figure("fleet_throughput_2_nodes", 9, "fleet: not measured", "ratio", None, note=refusal)]
    code = ("import json, sys; from acceldemo.bench.fleet import measure_fleet; "
            "print(json.dumps([f.as_dict() for f in measure_fleet()]))")
    done = subprocess.run(in_private_network_command([sys.executable, "-c", code]), capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the fleet section failed: {(done.stdout + done.stderr)[-2000:]}")
    return [Figure.from_dict(d) for d in json.loads(done.stdout.strip().splitlines()[-1])]
