"""The torchrun worker pool: sharded images equal one-process images, bad requests and dead ranks are survived,
the channel admits only its secret's holder, and no process outlives the app."""
import json
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from acceldemo.config import Settings
from acceldemo.engine.validation import check_request
from acceldemo.errors import GenerationFailed
from acceldemo.executors.local import LocalExecutor
from acceldemo.executors.pool import PoolExecutor, _root_cause
from acceldemo.executors.recipe import run_pipeline
from acceldemo.executors.worker import Run
from acceldemo.hardware import HardwareRegistry
from acceldemo.models.catalog import get_model
from acceldemo.records import (
    Batch,
    DeviceSet,
    GenerateParams,
    Phase,
    PipelineKey,
    Placement,
    Request,
    RunOutput,
    Shape,
    no_progress,
)
from tests.engines import processes_started_by

REPO = Path(__file__).resolve().parents[1]
SETTINGS = Settings.from_env()
HARDWARE = HardwareRegistry(SETTINGS)


def tp_request(model: str = "tiny-flux2-klein", **kw) -> Request:
    return check_request(GenerateParams(**{
        "prompt": "a red circle on a blue background", "model": model, "hardware": "cpu", "placement": "tp",
        "tp_size": 2, "resolution": "64x64", "seed": 0, **kw}), SETTINGS, HARDWARE)


def key_of(request: Request) -> PipelineKey:
    return request.key(DeviceSet("cpu", (0,)))


def one_process_image(request: Request) -> np.ndarray:
    """The same request on the same weights, unsharded, in this process (float pixels)."""
    local = LocalExecutor(SETTINGS, HARDWARE).load(replace(key_of(request), placement=Placement.DEVICE, tp_size=1),
                                                   get_model(request.model), no_progress)
    return run_pipeline(local.prepared, HARDWARE.get("cpu"), request, False, no_progress, output_type="np").images[0]


def pool_processes(channel: str) -> list[int]:
    """Running processes whose command line names this pool's channel: torchrun's agent and every rank."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and channel.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except OSError:
            pass
    return found


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return "gone"


def wait_until_gone(channel: str, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := pool_processes(channel)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.fixture(scope="module")
def pool():
    executor = PoolExecutor(SETTINGS, HARDWARE, timeout_s=180)
    yield executor
    executor.close()


@pytest.fixture(scope="module")
def klein(pool):
    """Tiny FLUX.2-klein loaded into the pool, eager, transformer and Qwen3 text encoder sharded."""
    events = []
    pipeline = pool.load(key_of(tp_request()), get_model("tiny-flux2-klein"), events.append)
    pipeline.load_events = events
    return pipeline


# --- fast: no pool needed -------------------------------------------------------------------------------------


def test_after_a_pool_restart_a_compiled_pipeline_announces_its_compile_again():
    from acceldemo.executors.pool import PoolPipeline

    class FakePool:
        def __init__(self):
            self.pipelines, self.runs = set(), []

        def call(self, command, on_progress, cancelled=None):
            if isinstance(command, Run):
                self.runs.append(command.expect_compile)  # as sent to the ranks
                return RunOutput(images=[], seconds=0.0, new_graphs=0, compile_seconds=0.0)
            return []

    class FakeExecutor:
        settings, pool = None, FakePool()

        def pool_for(self, devices, tp_size, on_progress):
            return self.pool

    executor = FakeExecutor()
    request = tp_request(mode="compiled")
    pipeline = PoolPipeline(executor, key_of(request), get_model(request.model))
    pipeline.run(request, True, no_progress, output_type="np")
    pipeline.run(request, False, no_progress, output_type="np")
    first = executor.pool
    executor.pool = FakePool()  # rank death: the executor hands out a fresh pool
    events = []
    pipeline.run(request, False, events.append, output_type="np")
    assert first.runs == [True, False] and executor.pool.runs == [True]
    assert "the pool was restarted: loading" in events[0].message


def test_a_world_of_one_loads_the_pipeline_whole():
    # The bench's 1-rank pool measures the pool's own path: nothing to shard, so nothing is a DTensor.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from acceldemo.models.tensor_parallel import load_sharded_pipeline

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        pipe, counts = load_sharded_pipeline(get_model("tiny-flux2-klein"), SETTINGS,
                                             init_device_mesh("cpu", (1,)))
    finally:
        dist.destroy_process_group()
    assert [(c.name, c.sharded) for c in counts] == [("transformer", 0), ("text_encoder", 0)]
    assert all(type(p).__name__ == "Parameter" for p in pipe.transformer.parameters())


def test_torchrun_root_cause_names_the_rank_and_the_signal():
    log = textwrap.dedent("""\
        Root Cause (first observed failure):
        [0]:
          time      : 2026-11-30_04:23:28
          host      : localhost
          rank      : 1 (local_rank: 1)
          exitcode  : -9 (pid: 15019)
    """)
    assert _root_cause(log) == "rank 1 (pid 15019) was killed by SIGKILL"
    assert _root_cause(log.replace("-9", "2")) == "rank 1 (pid 15019) exited with code 2"
    assert _root_cause("no summary printed") is None


def test_cpu_mesh_shim_is_limited_to_diffusers_0_42(monkeypatch):
    import diffusers
    import diffusers.hooks.tensor_parallel as tensor_parallel
    from diffusers.models.modeling_utils import ModelMixin

    from acceldemo.compat import allow_cpu_tensor_parallel

    monkeypatch.setattr(tensor_parallel, "_SUPPORTED_TP_DEVICES", ("cuda", "neuron", "tpu", "xpu"))
    monkeypatch.setattr(ModelMixin, "_resolve_parallel_config", ModelMixin._resolve_parallel_config)
    original = ModelMixin._resolve_parallel_config
    monkeypatch.setattr(diffusers, "__version__", "0.43.0")
    assert allow_cpu_tensor_parallel() is False
    assert "cpu" not in tensor_parallel._SUPPORTED_TP_DEVICES and ModelMixin._resolve_parallel_config is original
    monkeypatch.setattr(diffusers, "__version__", "0.42.1")
    assert allow_cpu_tensor_parallel() is True and allow_cpu_tensor_parallel() is True
    assert tensor_parallel._SUPPORTED_TP_DEVICES.count("cpu") == 1
    assert ModelMixin._resolve_parallel_config.__wrapped__ is original


# --- one pool shared by the module --------------------------------------------------------------------------


@pytest.mark.slow
def test_sharded_flux2_klein_image_equals_the_one_process_image(klein):
    request = tp_request()
    sharded = klein.run(request, False, no_progress, output_type="np").images[0]
    expected = one_process_image(request)
    assert sharded.shape == (64, 64, 3) and expected.std() > 0.02
    assert np.abs(sharded - expected).max() < 1e-4
    # Each rank holds a real slice of both components: some parameters sharded, not all of them.
    assert len(klein.sharded) == 2
    for rank in klein.sharded:
        assert {c.name for c in rank} == {"transformer", "text_encoder"}
        assert all(0 < c.sharded < c.parameters for c in rank)
    messages = [e.message for e in klein.load_events]
    assert "starting 2 rank(s) on cpu:0 (torchrun)" in messages
    assert any(m.startswith("rank 1 loaded: transformer") for m in messages)
    assert {e.phase for e in klein.load_events} == {Phase.LOAD}


@pytest.mark.slow
def test_sharded_flux1_image_equals_the_one_process_image(pool):
    request = tp_request("tiny-flux1")
    pipeline = pool.load(key_of(request), get_model("tiny-flux1"), no_progress)
    sharded = pipeline.run(request, False, no_progress, output_type="np").images[0]
    assert np.abs(sharded - one_process_image(request)).max() < 1e-4
    for rank in pipeline.sharded:
        assert [(c.name, 0 < c.sharded < c.parameters) for c in rank] == [("transformer", True)]


@pytest.mark.slow
def test_requests_drawn_together_are_one_call_on_every_rank_each_image_its_own(klein):
    requests = [tp_request(seed=5), tp_request(seed=9, prompt="a green square, top left")]
    together = klein.run(Batch(tuple(requests)), False, no_progress, output_type="np").images
    alone = [klein.run(request, False, no_progress, output_type="np").images[0] for request in requests]
    assert len(together) == 2 and np.abs(alone[0] - alone[1]).max() > 0.1
    assert all(np.abs(a - b).max() <= 1 / 255 for a, b in zip(together, alone))


@pytest.mark.slow
def test_compiled_tp_second_visit_to_a_shape_compiles_nothing(pool):
    request = tp_request(mode="compiled")
    pipeline = pool.load(key_of(request), get_model(request.model), no_progress)
    events = []
    first = pipeline.run(request, True, events.append)
    second = pipeline.run(replace(request, seed=7, prompt="a green square"), False, no_progress)
    assert first.new_graphs > 0 and first.compile_seconds > 0
    assert Phase.COMPILE in [e.phase for e in events]
    assert second.new_graphs == 0
    assert second.images[0].size == (64, 64)


@pytest.mark.slow
def test_a_failing_request_is_answered_and_the_pool_keeps_serving(pool, klein):
    launcher = pool.health()[0].launcher_pid
    # 8x8 is below what the tiny VAE can decode: the pipeline itself raises, on every rank.
    with pytest.raises(RuntimeError, match="Kernel size can't be greater"):
        klein.run(replace(tp_request(), shape=Shape(8, 8)), False, no_progress)
    assert klein.run(tp_request(), False, no_progress).images[0].size == (64, 64)
    health = pool.health()[0]
    assert health.alive and health.launcher_pid == launcher and len(health.ranks) == 2


@pytest.mark.slow
def test_cancel_reaches_every_rank_and_stops_at_the_next_step(klein):
    steps = []

    def on_progress(event):
        if event.phase is Phase.DENOISE:
            steps.append(event.step)

    out = klein.run(tp_request(steps=50), False, on_progress, cancelled=lambda: bool(steps))
    # Every rank skips the same remaining steps (FLUX still decodes what it has), so the pool stays in step.
    assert 1 <= len(steps) < 10 and out.images[0].size == (64, 64)
    assert klein.run(tp_request(steps=3), False, on_progress).images[0].size == (64, 64)


@pytest.mark.slow
def test_the_channel_refuses_a_client_without_the_secret(pool, klein, tmp_path):
    channel = pool.health()[0].channel
    assert os.stat(os.path.dirname(channel)).st_mode & 0o777 == 0o700
    with pytest.raises(AuthenticationError):
        Client(channel, family="AF_UNIX", authkey=b"not the pool's secret")
    # A client that skips the handshake and sends a pickle straight away: it must never be unpickled.
    canary = tmp_path / "unpickled"

    class Payload:
        def __reduce__(self):
            return open, (str(canary), "w")

    data = pickle.dumps(Payload())
    with socket.socket(socket.AF_UNIX) as raw:
        raw.settimeout(5)
        raw.connect(channel)
        raw.sendall(struct.pack("!i", len(data)) + data)
        try:
            raw.recv(4096)
        except OSError:
            pass
    time.sleep(0.5)
    assert not canary.exists()
    assert klein.run(tp_request(), False, no_progress).images[0].size == (64, 64)


# --- through the session manager, the CLI, and a crashing app -----------------------------------------------


@pytest.mark.slow
def test_dead_or_hung_rank_fails_the_request_then_a_fresh_pool_serves_and_nothing_is_left(fresh_manager):
    manager = fresh_manager()
    request = GenerateParams(prompt="a red circle on a blue background", model="tiny-flux2-klein", hardware="cpu",
                             placement="tp", tp_size=2, resolution="128x128", steps=50, seed=0)
    first = manager.generate(request)
    executor = manager.backend.executor.executor_for(first.key)
    channels = [executor.health()[0].channel]
    assert os.path.isdir(os.path.join(os.path.dirname(channels[0]), "torchelastic"))  # torchrun's logs: the pool's

    def signal_rank_1_at_step_2(sig):
        victim = executor.health()[0].ranks[1].pid

        def on_progress(event):
            if event.phase is Phase.DENOISE and event.step == 2:
                os.kill(victim, sig)
        return on_progress

    started = time.monotonic()
    with pytest.raises(GenerationFailed, match=r"lost a rank during the request: rank 1 \(pid \d+\) was killed by "
                                               r"SIGKILL; the pool restarts on the next request"):
        manager.generate(request, signal_rank_1_at_step_2(signal.SIGKILL))
    assert time.monotonic() - started < 15

    again = manager.generate(request)
    assert np.array_equal(np.asarray(again.image), np.asarray(first.image))
    channels.append(executor.health()[0].channel)  # a fresh pool; the one about to hang
    assert channels[0] != channels[1]

    executor.timeout_s = 3  # a stopped rank never answers: the request must not wait for ever
    started = time.monotonic()
    with pytest.raises(GenerationFailed, match="did not answer during the request within 3 s"):
        manager.generate(request, signal_rank_1_at_step_2(signal.SIGSTOP))
    assert time.monotonic() - started < 15

    manager.close()
    assert executor.health() == []
    for channel in channels:
        assert wait_until_gone(channel, 10) == [], channel
        assert not os.path.exists(os.path.dirname(channel)), channel  # its folder, torchrun's logs with it


@pytest.mark.slow
def test_cli_tp_image_equals_the_device_image(tmp_path):
    def generate(placement: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "acceldemo", "generate", "--prompt", "x", "--hardware", "cpu", "--size", "64x64",
             "--seed", "0", "--json", "--out", str(tmp_path / placement), "--placement", placement,
             *(["--tp", "2"] if placement == "tp" else [])],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    runs = {placement: generate(placement) for placement in ("tp", "device")}
    facts = {}
    for placement, run in runs.items():
        out, err = run.communicate(timeout=240)
        assert run.returncode == 0, err[-2000:]
        facts[placement] = json.loads(out.strip().splitlines()[-1])
    assert (facts["tp"]["placement"], facts["tp"]["tp_size"]) == ("tp", 2)
    tp, device = (np.asarray(Image.open(facts[p]["path"]), dtype=np.int16) for p in ("tp", "device"))
    # PNG pixels are rounded floats that differ by < 1e-5: at most one level apart, almost all equal.
    assert np.abs(tp - device).max() <= 1 and (tp != device).mean() < 0.01
    assert device.std() > 5
    assert processes_started_by(runs["tp"].pid) == []


APP = """
import faulthandler, signal, sys, time
faulthandler.enable()  # a SIGABRT from the test shows where a hung exit waits
# Ctrl-C as a terminal gives it, whoever runs the tests: a shell script's background job (`cmd &`) starts with SIGINT
# ignored and passes that on, so the app would never see the signal.
signal.signal(signal.SIGINT, signal.default_int_handler)
from acceldemo.config import Settings
from acceldemo.executors.pool import PoolExecutor
from acceldemo.hardware import HardwareRegistry
settings = Settings.from_env()
executor = PoolExecutor(settings, HardwareRegistry(settings), timeout_s=120)
from acceldemo.records import DeviceSet
executor.pool_for(DeviceSet("cpu", (0,)), 2, lambda event: None)
print(executor.health()[0].channel, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGINT], ids=["crash", "ctrl-c"])
def test_no_pool_process_outlives_the_app(how, tmp_path):
    # The app's stderr goes to a file: a pipe nobody reads would block the app once full, a hang of the test's own
    # making.
    log = tmp_path / "app.log"
    with open(log, "w") as err:
        app = subprocess.Popen([sys.executable, "-c", APP], cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        channel = app.stdout.readline().strip()
        assert channel, log.read_text()[-2000:]
        assert len(pool_processes(channel)) == 3  # torchrun's agent and two ranks
        assert sorted(processes_started_by(app.pid)) == sorted(pool_processes(channel))
        app.send_signal(how)
        try:
            app.wait(30)  # at most SHUTDOWN_GRACE_S + TERMINATE_GRACE_S before the kill, and the exit
        except subprocess.TimeoutExpired:
            left = {pid: _state(pid) for pid in pool_processes(channel)}
            app.send_signal(signal.SIGABRT)  # faulthandler writes every thread's stack to the log
            app.wait(10)
            pytest.fail(f"the app did not exit within 30 s of {how.name}; pool processes {left}; "
                        f"its stderr ends:\n{log.read_text()[-6000:]}")
        assert wait_until_gone(channel, 15) == [] and processes_started_by(app.pid) == []
        assert not os.path.exists(os.path.dirname(channel))  # the private folder goes too
    finally:
        app.kill()
        app.wait()


@pytest.mark.slow
def test_rank_zero_sends_the_previews_the_one_process_pipeline_makes(klein):
    request = tp_request(previews=True, steps=4)
    events = []
    klein.run(request, False, events.append)
    previews = [e.preview for e in events if e.preview is not None]
    assert [p.step for p in previews] == [1, 2, 3, 4] and previews[0].shape == Shape(64, 64)
    local = LocalExecutor(SETTINGS, HARDWARE).load(replace(key_of(request), placement=Placement.DEVICE, tp_size=1),
                                                   get_model(request.model), no_progress)
    alone = []
    local.run(request, False, alone.append)
    expected = [e.preview.pixels for e in alone if e.preview is not None]
    assert all(np.abs(p.pixels.astype(int) - e).max() <= 1 for p, e in zip(previews, expected, strict=True))


@pytest.mark.slow
def test_every_rank_skips_the_same_steps_with_taylorseer_and_the_image_is_the_one_process_image(klein):
    request = tp_request(step_cache="taylorseer", steps=10)
    out = klein.run(request, False, no_progress, output_type="np")
    assert (out.cache.name, out.cache.calls, out.cache.skipped) == ("taylorseer", 10, 5)
    assert np.abs(out.images[0] - one_process_image(request)).max() < 1e-4
    plain = klein.run(tp_request(steps=10), False, no_progress, output_type="np")
    assert plain.cache.skipped == 0 and np.abs(plain.images[0] - out.images[0]).max() > 0
