"""The torchrun worker pool: pipelines that live in N rank processes pinned to a device set, reached through rank 0.

One pool per device set (its ranks own those devices: a tensor-parallel group, or one device this process cannot
drive itself), started on the first load, holding any number of pipelines of one world size. The app talks to
rank 0 over a Unix socket in a private directory, with a fresh secret per pool handed over in the environment
(never argv) and checked by an HMAC handshake before anything is unpickled. A pool that dies or hangs fails the
request at hand with a clear message and is started again by the next one; closing the executor, the app exiting,
or the app dying (the ranks watch its pid) ends every process.
"""
from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..config import PoolLaunch, Settings
from ..errors import ReplicaLost, UnsupportedCombination
from ..hardware import Hardware, HardwareRegistry
from ..models.catalog import ModelSpec
from ..models.loading import model_source
from ..records import Batch, DeviceSet, Phase, PipelineKey, Progress, ProgressCallback, Request, RunOutput
from .replies import Broken, Done, Failed, Reported
from .worker import Cancel, Command, Load, RankInfo, Run, Shutdown, Status, Unload

log = logging.getLogger("acceldemo.pool")

TIMEOUT_SETTING = "ACCELDEMO_POOL_TIMEOUT_S"
# How long a stopping pool gets to leave by itself once rank 0 has been asked (ranks and torchrun take ~2-3 s on
# CPU), then after a SIGTERM to torchrun (which stops its ranks), before everything left is killed.
SHUTDOWN_GRACE_S = 15.0
TERMINATE_GRACE_S = 3.0
# After rank 0's channel drops, how long torchrun gets to stop the other ranks and print which one failed.
DEATH_REPORT_S = 5.0
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


@dataclass(frozen=True)
class PoolHealth:
    """One pool as the app sees it: is torchrun running, and what each rank says about itself."""

    devices: DeviceSet
    world_size: int
    alive: bool
    busy: bool
    launcher_pid: int
    channel: str  # rank 0's Unix socket
    ranks: tuple[RankInfo, ...]

    @property
    def hardware(self) -> str:
        return self.devices.hardware


class _Pool:
    """One torchrun launch: `world_size` ranks pinned to a device set; rank 0 answers on a private Unix socket."""

    _serial = itertools.count(1)

    def __init__(self, hardware: Hardware, devices: DeviceSet, world_size: int, settings: Settings,
                 timeout_s: Callable[[], float]):
        # Read at each command, so an operator (or a test) can change the executor's limit on a running pool.
        self.hardware, self.devices, self.world_size, self.timeout_s = hardware, devices, world_size, timeout_s
        self.settings = settings
        self.name = f"{world_size}-rank pool on {devices} #{next(self._serial)}"
        self.lock = threading.Lock()
        self.pipelines: set[str] = set()
        self.ranks: tuple[RankInfo, ...] = ()
        self.proc: subprocess.Popen | None = None
        self.conn = None
        self.folder: str | None = None
        self.address = ""
        self.dead: str | None = None  # why, once it is

    # --- life ----------------------------------------------------------------------------------------------

    def start(self, on_progress: ProgressCallback) -> None:
        # A one-rank pool drives one device of this host; only a tensor-parallel pool spans the pool's nodes.
        nodes = self.settings.pool_nnodes if self.world_size > 1 else 1
        per_node = self.world_size // nodes  # validation keeps tp_size a multiple of the nodes
        started = time.perf_counter()
        on_progress(Progress(Phase.LOAD, f"starting {self.world_size} rank(s) on {self.devices} (torchrun)"))
        rendezvous = _rendezvous_args(nodes, self.settings.pool_rdzv_endpoint)
        authkey = secrets.token_bytes(32)
        launch = PoolLaunch(authkey, os.getpid(), self.settings)
        # A one-rank pool (a replica on one device) is a lone process to the backend: no launcher topology, so its
        # pin holds (torch-tpu's runtime resets TPU_VISIBLE_DEVICES to the local rank under its launch env).
        launcher = self.hardware.launcher_env(per_node) if self.world_size > 1 else {}
        env = {**os.environ, **launcher, **self.hardware.pin_env(self.devices),
               **launch.environment(),
               "PYTHONPATH": os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)}
        self.folder = tempfile.mkdtemp(prefix="acceldemo-pool-")  # mode 0700: only this user reaches the socket
        self.address = address = os.path.join(self.folder, "rank0.sock")
        # torchrun's per-run folder goes in the pool's own (torch's default is a fresh /tmp/torchelastic_* that nothing
        # removes): it goes with the pool when it stops.
        command = [sys.executable, "-m", "torch.distributed.run", *rendezvous, f"--nproc-per-node={per_node}",
                   f"--log-dir={os.path.join(self.folder, 'torchelastic')}", "-m", "acceldemo.executors.worker",
                   "--hardware", self.hardware.name, "--devices", str(self.devices), "--socket", address]
        with open(os.path.join(self.folder, "torchrun.log"), "wb") as log_file:
            # Its own session: a Ctrl-C at the app's terminal reaches the app, which stops the pool in order.
            self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        _LIVE.add(self)
        self.conn = self._connect(address, authkey, time.monotonic() + self.timeout_s())
        self.ranks = tuple(self.call(Status(), on_progress))
        on_progress(Progress(Phase.LOAD, f"{self.world_size} ranks up in {time.perf_counter() - started:.1f} s (pids "
                                     f"{', '.join(str(r.pid) for r in self.ranks)})",
                             elapsed=time.perf_counter() - started))

    def _connect(self, address: str, authkey: bytes, deadline: float):
        from multiprocessing.connection import Client

        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise ReplicaLost(str(self.devices), f"the {self.name} exited while starting (code "
                                                     f"{self.proc.returncode}): {self._log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise ReplicaLost(str(self.devices),
                                  f"the {self.name} did not come up within {self.timeout_s():.0f} s "
                                  f"({TIMEOUT_SETTING}): {self._log_tail()}")
            if os.path.exists(address):
                try:
                    return Client(address, family="AF_UNIX", authkey=authkey)
                except (ConnectionRefusedError, FileNotFoundError):
                    pass
            time.sleep(0.1)

    def alive(self) -> bool:
        return self.dead is None and self.proc is not None and self.proc.poll() is None

    def stop(self, polite: bool = True) -> None:
        """End torchrun and every rank: ask rank 0, then SIGTERM torchrun (it stops its ranks), then SIGKILL all."""
        self.dead = self.dead or "stopped"
        _LIVE.discard(self)
        if self.proc is not None and self.proc.poll() is None:
            # Asked only when idle: a command in flight owns the channel (and a busy rank 0 would not listen).
            if polite and self.conn is not None and self.lock.acquire(blocking=False):
                try:
                    self.conn.send(Shutdown())
                    self._wait(SHUTDOWN_GRACE_S)
                except (OSError, ValueError):
                    pass
                finally:
                    self.lock.release()
            if self.proc.poll() is None:
                _signal_group(self.proc.pid, signal.SIGTERM)
                self._wait(TERMINATE_GRACE_S)
            if self.proc.poll() is None:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # Ranks run in sessions of their own (torchrun starts them so): stragglers and their children go by group.
        for rank in self.ranks:
            if _is_rank_process(rank.pid, self.folder):
                _signal_group(rank.pid, signal.SIGKILL)
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _wait(self, seconds: float) -> None:
        try:
            self.proc.wait(seconds)
        except subprocess.TimeoutExpired:
            pass

    # --- commands ------------------------------------------------------------------------------------------

    def call(self, command: Command, on_progress: ProgressCallback, cancelled=lambda: False):
        """Send one command and wait for its answer, passing progress on; a dead or hung pool is ReplicaLost."""
        with self.lock:
            if not self.alive():
                raise ReplicaLost(str(self.devices), f"the {self.name} is not running ({self.dead or 'exited'}); "
                                                     "it restarts on the next request")
            limit = self.timeout_s()
            deadline = time.monotonic() + limit
            callback_error = None
            self._send(command)
            cancel_sent = False
            while True:
                reply = self._receive(command, deadline, limit)
                if isinstance(reply, Reported):
                    try:
                        on_progress(reply.event)
                    except Exception as error:  # the answer still has to be read, or the channel desyncs
                        callback_error = callback_error or error
                    if not cancel_sent and cancelled():
                        self._send(Cancel())
                        cancel_sent = True
                    continue
                if callback_error is not None:
                    raise callback_error
                if isinstance(reply, Done):
                    return reply.value
                if isinstance(reply, Failed):
                    raise reply.error
                why = reply.why if isinstance(reply, Broken) else f"an unknown answer {type(reply).__name__}"
                raise self._died(command, f"rank 0 reports the process group broken {why}")

    def _send(self, command: Command | Cancel) -> None:
        try:
            self.conn.send(command)
        except (OSError, ValueError) as error:
            raise self._died(command, f"rank 0's channel is closed ({type(error).__name__})") from None

    def _receive(self, command: Command, deadline: float, limit: float):
        """The next message from rank 0; watches torchrun and the deadline meanwhile."""
        while True:
            try:
                if self.conn.poll(0.1):
                    return self.conn.recv()
            except (EOFError, OSError) as error:
                raise self._died(command, f"rank 0's channel closed ({type(error).__name__})") from None
            if self.proc.poll() is not None:
                raise self._died(command, f"torchrun exited with code {self.proc.returncode}")
            if time.monotonic() > deadline:
                self.dead = "hung"
                self.stop(polite=False)
                raise ReplicaLost(str(self.devices),
                                  f"the {self.name} did not answer {_doing(command)} within {limit:.0f} s "
                                  f"({TIMEOUT_SETTING}); it was stopped and restarts on the next request")

    def _died(self, command: Command, seen: str) -> ReplicaLost:
        """Stop what is left and say which rank failed, as torchrun reports it once it has stopped the others."""
        self.dead = "a rank died"
        self._wait(DEATH_REPORT_S)
        cause = _root_cause(self._log_text()) or seen
        log.error("%s died %s: %s; torchrun's log ends:\n%s", self.name, _doing(command), cause,
                  self._log_tail(lines=40, separator="\n"))
        self.stop(polite=False)
        return ReplicaLost(str(self.devices), f"the {self.name} lost a rank {_doing(command)}: {cause}; "
                                              "the pool restarts on the next request")

    def _log_text(self) -> str:
        try:
            return Path(self.folder, "torchrun.log").read_text(errors="replace")
        except (OSError, TypeError):
            return ""

    def _log_tail(self, lines: int = 3, separator: str = " | ") -> str:
        kept = [line for line in self._log_text().splitlines() if line.strip()]
        return separator.join(kept[-lines:]) or "no output"


class PoolPipeline:
    """A tensor-parallel pipeline living in the pool; it loads itself again into a restarted pool."""

    _serial = itertools.count(1)

    def __init__(self, executor: PoolExecutor, key: PipelineKey, spec: ModelSpec):
        self.executor, self.key, self.spec = executor, key, spec
        self.id = f"{key} #{next(self._serial)}"
        self.pool: _Pool | None = None
        # Per rank, per sharded component: how many of its parameters that rank holds as shards.
        self.sharded: list[list] = []

    def ensure_loaded(self, on_progress: ProgressCallback) -> _Pool:
        pool = self.executor.pool_for(self.key.devices, self.key.world_size, on_progress)
        if pool is self.pool and self.id in pool.pipelines:
            return pool
        if self.pool is not None:
            on_progress(Progress(Phase.LOAD, f"the pool was restarted: loading {self.spec.title} again"))
        try:
            self.sharded = pool.call(Load(self.id, self.key, self.spec), on_progress)
        except Exception:
            # Ranks that did load free it again, and a pool that holds nothing gives its devices back.
            self.executor.unload(pool, self.id)
            raise
        pool.pipelines.add(self.id)
        self.pool = pool
        return pool

    def run(self, call: Request | Batch, expect_compile: bool, on_progress: ProgressCallback,
            cancelled=lambda: False, output_type: str = "pil", profile: bool = False) -> RunOutput:
        """One call (a request, or requests drawn together) on every rank, as one pipeline call; rank 0's images come
        back (PIL, or float arrays for output_type "np"); `profile`: rank 0 also times its collectives."""
        before = self.pool
        pool = self.ensure_loaded(on_progress)
        if before is not None and pool is not before and self.key.mode.compiles:
            expect_compile = True  # a restarted pool's ranks have compiled nothing yet: say so while they do
        out = pool.call(Run(self.id, Batch.of(call), expect_compile, output_type, profile), on_progress, cancelled)
        if output_type == "pil":
            from PIL import Image

            out = dataclasses.replace(out, images=[Image.fromarray(pixels) for pixels in out.images])
        return out

    def close(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None and self.id in pool.pipelines:
            self.executor.unload(pool, self.id)


class PoolExecutor:
    """Loads pipelines into torchrun worker pools, one pool per device set; `close()` ends them all."""

    def __init__(self, settings: Settings, hardware: HardwareRegistry, timeout_s: float | None = None):
        self.hardware = hardware
        self.timeout_s = timeout_s or settings.pool_timeout_s
        # The ranks' process-group timeout is the executor's own limit: the two sides of a pool never disagree.
        self.settings = dataclasses.replace(settings, pool_timeout_s=self.timeout_s)
        self._pools: dict[DeviceSet, _Pool] = {}
        self._lock = threading.Lock()

    def load(self, key: PipelineKey, spec: ModelSpec, on_progress: ProgressCallback) -> PoolPipeline:
        # The embedded models are built here, once: ranks building them side by side would race, and
        # transformers writes a checkpoint only from rank 0 of a process group.
        model_source(spec, self.settings)
        pipeline = PoolPipeline(self, key, spec)
        pipeline.ensure_loaded(on_progress)
        return pipeline

    def pool_for(self, devices: DeviceSet, world_size: int, on_progress: ProgressCallback) -> _Pool:
        """The running pool on these devices with this many ranks, starting it (again) if there is none."""
        with self._lock:
            pool = self._pools.get(devices)
            if pool is not None and pool.alive() and pool.world_size == world_size:
                return pool
            if pool is not None:
                why = f"it has {pool.world_size} ranks" if pool.alive() else (pool.dead or "it exited")
                on_progress(Progress(Phase.LOAD, f"replacing the {pool.name} ({why})"))
                pool.stop()
            pool = self._pools[devices] = _Pool(self.hardware.get(devices.hardware), devices, world_size,
                                                self.settings, lambda: self.timeout_s)
        pool.start(on_progress)
        return pool

    def unload(self, pool: _Pool, pipeline: str) -> None:
        """Free a pipeline on every rank; a pool left holding nothing is stopped, giving its devices back."""
        pool.pipelines.discard(pipeline)
        if pool.alive() and pool.pipelines:
            try:
                pool.call(Unload(pipeline), lambda event: None)
            except Exception as error:  # freeing is best effort: a broken pool is stopped below anyway
                log.warning("unloading %s failed: %s", pipeline, error)
        if not pool.pipelines or not pool.alive():
            with self._lock:
                if self._pools.get(pool.devices) is pool:
                    del self._pools[pool.devices]
            pool.stop()

    def health(self) -> list[PoolHealth]:
        """Every pool: alive, busy, and each rank's own report (asked now when the pool is idle)."""
        found = []
        for pool in list(self._pools.values()):
            ranks, busy = pool.ranks, pool.lock.locked()
            if pool.alive() and not busy:
                try:
                    ranks = pool.ranks = tuple(pool.call(Status(), lambda event: None))
                except Exception as error:
                    log.warning("health check of the %s failed: %s", pool.name, error)
            found.append(PoolHealth(pool.devices, pool.world_size, pool.alive(), busy,
                                    pool.proc.pid if pool.proc else 0, pool.address, ranks))
        return found

    def close(self) -> None:
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.stop()


def _rendezvous_args(nodes: int, endpoint: str | None) -> list[str]:
    if nodes == 1:
        # A private rendezvous on a free local port: several pools (or apps) never collide.
        return ["--standalone"]
    if not endpoint:
        raise UnsupportedCombination("placement", f"ACCELDEMO_POOL_NNODES={nodes} needs "
                                                  "ACCELDEMO_POOL_RDZV_ENDPOINT=HOST:PORT (this host, which serves "
                                                  "as node 0)")
    # torchrun's static rendezvous: this host is node 0, so global rank 0 (the app's proxy) runs here.
    return [f"--nnodes={nodes}", "--node-rank=0", f"--rdzv-endpoint={endpoint}"]


def _doing(command: Command) -> str:
    return {Load: "while loading", Run: "during the request", Status: "while starting"}.get(
        type(command), f"during {type(command).__name__}")


_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)", re.S)


def _root_cause(log_text: str) -> str | None:
    """torchrun's own account of the first rank that failed, in one line."""
    match = _ROOT_CAUSE.search(log_text)
    if not match:
        return None
    rank, code, pid = int(match[1]), int(match[2]), match[3]
    if code >= 0:
        how = f"exited with code {code}"
    elif -code in signal.valid_signals():
        how = f"was killed by {signal.Signals(-code).name}"
    else:
        how = f"got signal {-code}"
    return f"rank {rank} (pid {pid}) {how}"


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _is_rank_process(pid: int, folder: str | None) -> bool:
    """A pid still running this pool's worker (pids are reused, so never signal one on trust)."""
    try:
        return bool(folder) and folder.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


_LIVE: weakref.WeakSet[_Pool] = weakref.WeakSet()


@atexit.register
def _stop_live_pools() -> None:
    """An app that exits without closing its engine still takes its pools with it."""
    for pool in list(_LIVE):
        pool.stop()
