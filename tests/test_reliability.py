"""Reliability in the engine and the served app: stop, busy devices, bad input everywhere, load, exposure."""
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from fastapi.testclient import TestClient

from acceldemo.errors import Cancelled, CapacityExceeded
from acceldemo.records import DeviceSet, GenerateParams, Phase
from tests.engines import free_port, wait_until_answers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_stop_ends_the_job_at_the_next_step_and_frees_the_device(fresh_manager):
    m = fresh_manager()
    steps_seen = []
    stop = threading.Event()

    def on_progress(event):
        if event.phase is Phase.DENOISE:
            steps_seen.append(event.step)
            stop.set()

    with pytest.raises(Cancelled, match="stopped at 64x64 after 1 of 20 steps; cpu:0 is free"):
        m.generate(GenerateParams(prompt="x", hardware="cpu", steps=20), on_progress, cancelled=stop.is_set)
    assert steps_seen == [1]
    assert m.generate(GenerateParams(prompt="x", hardware="cpu")).image.size == (64, 64)
    assert m.snapshot().counters.requests["cancelled"] == 1


def test_a_device_busy_past_the_wait_limit_answers_busy_retry(fresh_manager):
    m = fresh_manager(device_wait_s=0.2)
    holder = m.backend.line.enter("another job", [DeviceSet("cpu", (0,))])  # another job holds the device
    try:
        with pytest.raises(CapacityExceeded, match="cpu:0 stayed busy for 0 s .*retry"):
            m.generate(GenerateParams(prompt="x", hardware="cpu"))
    finally:
        m.backend.line.release(holder)
    assert m.queue_depth() == 0 and m.snapshot().counters.requests["refused"] == 1
    assert m.generate(GenerateParams(prompt="x", hardware="cpu")).image.size == (64, 64)


def test_status_and_metrics_need_the_token_when_one_is_set(fresh_manager):
    from acceldemo.ui.keys import Keys
    from acceldemo.ui.server import create_app

    with TestClient(create_app(fresh_manager(), keys=Keys.from_settings(api_token="s3cret"))) as client:
        assert client.get("/health").json() == {"ok": True}
        assert client.get("/status").status_code == 401
        assert client.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get("/status", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_page_asks_for_a_login_when_auth_is_set(fresh_manager):
    from acceldemo.ui.server import create_app, parse_auth

    assert parse_auth("ann:pw") == ("ann", "pw")
    with pytest.raises(ValueError, match="USER:PASSWORD"):
        parse_auth("annpw")
    with TestClient(create_app(fresh_manager(), auth=("ann", "pw"))) as client:
        assert client.get("/config").status_code == 401
        assert client.post("/login", data={"username": "ann", "password": "pw"}).status_code == 200


# The served app's resident memory through the 16x4 load (tiny model, CPU, after the start-up compile): VmHWM
# measured 590 MiB and +11 MiB from the first to the last quarter of requests (torch 2.13, Gradio 6.31). The
# budgets leave room for other versions and machines, not for a copy of a pipeline or a leak per request.
PEAK_RSS_BUDGET_MIB = 1536
RSS_GROWTH_BUDGET_MIB = 128


def memory_mib(pid: int) -> dict[str, float]:
    """A process's resident memory now (VmRSS) and its peak so far (VmHWM), from /proc, in MiB."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status") if line.startswith(("VmRSS", "VmHWM")))
    return {name: int(value.split()[0]) / 1024 for name, value in fields.items()}


@pytest.mark.slow
def test_eight_clients_asking_the_very_same_image_at_once_all_get_it_whole(server):
    # Identical requests give identical images; Gradio used to rewrite one cached file per image content in place,
    # so a download racing a rewrite came back empty ("peer closed connection ... received 0 bytes").
    from gradio_client import Client
    from PIL import Image

    def client_run(_):
        client = Client(server + "/", verbose=False)
        return [np.asarray(Image.open(client.predict(
            "the same red circle", "tiny-flux2-klein", "cpu", "eager", "auto", 2, "64x64", 2, 1.0, 7,
            api_name="/generate")[0])) for _ in range(3)]

    with ThreadPoolExecutor(8) as pool:
        images = [image for run in pool.map(client_run, range(8)) for image in run]
    assert len(images) == 24 and images[0].shape == (64, 64, 3) and images[0].std() > 0
    # Whole and the same image (within one level: some were drawn together in one call, whose batched products may
    # round differently).
    assert all(np.abs(image.astype(int) - images[0]).max() <= 1 for image in images)


@pytest.mark.slow
def test_sixteen_clients_four_requests_each_get_their_own_results(server):
    from gradio_client import Client

    shapes = ["64x64", "128x64", "64x128", "96x96"]
    rss_after_each = []  # (time, MiB) as requests complete

    def client_run(c):
        client = Client(server + "/", verbose=False)
        got = []
        for r in range(4):
            seed = 1000 * c + r
            resolution = shapes[(c + r) % 4]
            try:
                _, _, facts = client.predict("a blue square", "tiny-flux2-klein", "cpu", "eager", "auto", 2,
                                             resolution, 2, 1.0, seed, api_name="/generate")
                got.append(("ok", seed, facts["seed"], resolution, f"{facts['width']}x{facts['height']}"))
            except Exception as error:  # a full queue is a clear answer, not a failure
                assert "queue is full" in str(error).lower(), error
                got.append(("full", seed, None, resolution, None))
            rss_after_each.append((time.monotonic(), memory_mib(server.pid)["VmRSS"]))
        return got

    started = time.time()
    with ThreadPoolExecutor(16) as pool:
        results = [row for rows in pool.map(client_run, range(16)) for row in rows]
    assert len(results) == 64
    for outcome, seed, got_seed, resolution, got_size in results:
        if outcome == "ok":
            assert (got_seed, got_size) == (seed, resolution)  # nobody received another's image
    assert sum(r[0] == "ok" for r in results) >= 48
    status = json.loads(urllib.request.urlopen(server + "/status", timeout=10).read())
    assert status["queue_depth"] == 0
    rss = [mib for _, mib in sorted(rss_after_each)]
    first, last = np.mean(rss[:16]), np.mean(rss[-16:])
    peak = memory_mib(server.pid)["VmHWM"]
    print(f"64 requests from 16 clients in {time.time() - started:.1f} s; server peak RSS (VmHWM) {peak:.0f} MiB "
          f"(budget {PEAK_RSS_BUDGET_MIB}); RSS first quarter {first:.0f} MiB, last quarter {last:.0f} MiB "
          f"({last - first:+.0f} MiB)")
    assert peak < PEAK_RSS_BUDGET_MIB
    assert last - first < RSS_GROWTH_BUDGET_MIB


def test_out_of_memory_while_loading_evicts_idle_pipelines_and_retries_once(fresh_manager):
    m = fresh_manager()
    m.generate(GenerateParams(prompt="resident", hardware="cpu", model="tiny-flux1"))
    real_load, failures = m.backend.executor.load, []

    def load_after_one_oom(key, spec, on_progress):
        if not failures:
            failures.append(key)
            raise MemoryError("device memory exhausted")
        return real_load(key, spec, on_progress)

    m.backend.executor.load = load_after_one_oom
    events = []
    result = m.generate(GenerateParams(prompt="x", hardware="cpu", model="tiny-sd3"), events.append)
    assert result.image.size == (64, 64)
    assert "out of memory: freed 1 pipeline(s), loading again" in [e.message for e in events]
    assert {p.key.model: p.resident for p in m.snapshot().pipelines} == {"tiny-flux1": False, "tiny-sd3": True}


def test_out_of_memory_with_nothing_to_free_is_a_clear_error(fresh_manager):
    from acceldemo.errors import GenerationFailed

    m = fresh_manager()

    def always_oom(key, spec, on_progress):
        raise MemoryError("device memory exhausted")

    m.backend.executor.load = always_oom
    with pytest.raises(GenerationFailed, match="MemoryError: device memory exhausted .*try placement offload or tp"):
        m.generate(GenerateParams(prompt="x", hardware="cpu"))


def test_an_exception_mid_denoise_is_a_clear_error_and_the_next_request_works(fresh_manager):
    from acceldemo.errors import GenerationFailed

    m = fresh_manager()
    m.generate(GenerateParams(prompt="x", hardware="cpu"))
    calls = []

    def fail_at_step_two(event):
        if event.phase is Phase.DENOISE and event.step == 2 and not calls:
            calls.append(event)
            raise RuntimeError("NaN in the latents")

    with pytest.raises(GenerationFailed, match="failed at 64x64: RuntimeError: NaN in the latents"):
        m.generate(GenerateParams(prompt="x", hardware="cpu", seed=3), fail_at_step_two)
    assert m.generate(GenerateParams(prompt="x", hardware="cpu", seed=3)).warm


def test_no_model_is_ever_loaded_with_remote_code():
    import pathlib

    sources = pathlib.Path(ROOT, "acceldemo").rglob("*.py")
    assert not [p for p in sources if "trust_remote_code=True" in p.read_text()]


def test_every_wait_limit_is_an_operator_setting_with_a_default(monkeypatch):
    from acceldemo.config import PoolLaunch, Settings
    from acceldemo.executors.pool import PoolExecutor
    from acceldemo.hardware import HardwareRegistry

    limits = {"ACCELDEMO_QUEUE_SIZE": ("queue_size", 64), "ACCELDEMO_DEVICE_WAIT_S": ("device_wait_s", 600),
              "ACCELDEMO_POOL_TIMEOUT_S": ("pool_timeout_s", 1800),
              "ACCELDEMO_WARMUP_TIMEOUT_S": ("warmup_timeout_s", 1800)}
    for variable in limits:
        monkeypatch.delenv(variable, raising=False)
    assert {field: getattr(Settings.from_env(), field) for field, _ in limits.values()} == dict(limits.values())
    for i, variable in enumerate(limits, 1):
        monkeypatch.setenv(variable, str(i))
    settings = Settings.from_env()
    assert [getattr(settings, field) for field, _ in limits.values()] == [1, 2, 3, 4]
    executor = PoolExecutor(settings, HardwareRegistry(settings), timeout_s=5)
    # The ranks get the app's settings explicitly, the executor's own limit included: the two sides agree.
    for variable, value in {**PoolLaunch(b"k", 1, executor.settings).environment(),
                            "ACCELDEMO_POOL_TIMEOUT_S": "999"}.items():
        monkeypatch.setenv(variable, value)
    assert executor.timeout_s == 5 and PoolLaunch.take_from_environment().settings.pool_timeout_s == 5


def test_a_start_up_warm_up_past_its_limit_lets_the_app_serve_and_says_so(fresh_manager):
    from acceldemo.records import Shape
    from acceldemo.ui.server import create_app
    from tests.engines import DeviceHolder

    m = fresh_manager(warmup_timeout_s=2)
    blocker = DeviceHolder(m)  # the warm-up waits behind a job far longer than its limit
    blocker.start()

    def ready_when(predicate):
        deadline = time.monotonic() + 60
        while not predicate(answer := client.get("/ready")):
            assert time.monotonic() < deadline, answer.json()
            time.sleep(0.1)
        return answer.json()

    with TestClient(create_app(m, warmup=("eager", [Shape(64, 64)], (1,)))) as client:
        assert client.get("/ready").status_code == 503
        waited = ready_when(lambda answer: answer.status_code == 200)
        assert waited == {"ready": True, "warmup": "warming 64x64 (eager); still going after 2 s "
                                                   "(ACCELDEMO_WARMUP_TIMEOUT_S): serving meanwhile, "
                                                   "requests for that device wait for it"}
        blocker.release()
        done = ready_when(lambda answer: answer.json()["warmup"].startswith("done"))
        assert done == {"ready": True, "warmup": "done: 64x64 ready"}


@pytest.mark.slow
def test_page_and_engine_callers_share_one_line_and_one_set_of_counters(fresh_manager):
    # A queue of 2 while a job holds the only device: of 6 requests sent at once, 3 through the page's API
    # (gradio_client) and 3 straight to the engine, exactly 2 wait and 4 are refused with QueueFull.
    from gradio_client import Client

    from acceldemo.errors import QueueFull
    from acceldemo.ui.server import create_app
    from tests.engines import DeviceHolder, serving

    m = fresh_manager(queue_size=2)
    blocker = DeviceHolder(m)
    with serving(create_app(m)) as url:
        client = Client(url + "/", verbose=False)
        blocker.start()
        start = threading.Barrier(6)

        def through_the_page(seed):
            start.wait()
            try:
                return "ok", client.predict("a red circle", "tiny-flux2-klein", "cpu", "eager", "auto", 2, "64x64",
                                            1, 1.0, seed, api_name="/generate")[2]["seed"]
            except Exception as error:
                return "refused", str(error)

        def straight_to_the_engine(seed):
            start.wait()
            try:
                return "ok", m.generate(GenerateParams(prompt="a red circle", hardware="cpu", steps=1,
                                                       seed=seed)).request.seed
            except QueueFull as error:
                return "refused", str(error)

        with ThreadPoolExecutor(6) as pool:
            asked = [pool.submit(through_the_page if i % 2 else straight_to_the_engine, i) for i in range(6)]
            deadline = time.monotonic() + 60
            while sum(f.done() for f in asked) < 4 or m.queue_depth() < 2:
                assert time.monotonic() < deadline, ([f.done() for f in asked], m.queue_depth())
                time.sleep(0.05)
            assert m.queue_depth() == 2 and sum(f.done() for f in asked) == 4  # the refused answered at once
            blocker.release()
            outcomes = [f.result() for f in asked]
        refused = [text for kind, text in outcomes if kind == "refused"]
        assert len(refused) == 4 and sum(kind == "ok" for kind, _ in outcomes) == 2, outcomes
        assert all("the queue is full: 2 request(s) are already waiting for a device (ACCELDEMO_QUEUE_SIZE=2)"
                   in text for text in refused), refused
        metrics = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        assert 'acceldemo_requests_total{kind="generate",outcome="ok"} 3.0' in metrics
        assert 'acceldemo_requests_total{kind="generate",outcome="refused"} 4.0' in metrics
        status = json.loads(urllib.request.urlopen(url + "/status", timeout=10).read())
        assert status["counters"]["requests"] == {"ok": 3, "invalid": 0, "refused": 4, "cancelled": 0, "failed": 0}
        assert status["queue_depth"] == 0


@pytest.mark.slow
def test_a_terminated_app_removes_its_private_image_folder():
    # uvicorn re-raises SIGTERM after its graceful shutdown; the app must still run its clean-ups.
    env = {k: v for k, v in os.environ.items() if k != "GRADIO_TEMP_DIR"}
    port, before = free_port(), set(glob.glob(f"{tempfile.gettempdir()}/acceldemo-images-*"))
    app = subprocess.Popen([sys.executable, "app.py", "--port", str(port)], cwd=ROOT, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_answers(f"http://127.0.0.1:{port}/health", app)
        (folder,) = set(glob.glob(f"{tempfile.gettempdir()}/acceldemo-images-*")) - before
        assert oct(os.stat(folder).st_mode & 0o777) == "0o700"
        app.terminate()
        assert app.wait(30) == 128 + signal.SIGTERM
        assert not os.path.exists(folder)
    finally:
        app.kill()
