"""Reliability in the engine and the served app: stop, busy devices, bad input everywhere, load, exposure."""
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from fastapi.testclient import TestClient

from acceldemo.errors import Cancelled, CapacityExceeded
from acceldemo.records import GenerateRequest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_stop_ends_the_job_at_the_next_step_and_frees_the_device(fresh_manager):
    m = fresh_manager()
    steps_seen = []
    stop = threading.Event()

    def on_progress(event):
        if event.phase == "denoise":
            steps_seen.append(event.step)
            stop.set()

    with pytest.raises(Cancelled, match="stopped at 64x64 after 1 of 20 steps; cpu is free"):
        m.generate(GenerateRequest(prompt="x", hardware="cpu", steps=20), on_progress, cancelled=stop.is_set)
    assert steps_seen == [1]
    assert m.generate(GenerateRequest(prompt="x", hardware="cpu")).image.size == (64, 64)


def test_a_device_busy_past_the_wait_limit_answers_busy_retry(fresh_manager):
    m = fresh_manager(device_wait_s=0.2)
    m._device_locks["cpu"].acquire()  # another job holds the device
    try:
        with pytest.raises(CapacityExceeded, match="cpu stayed busy for 0 s .*retry"):
            m.generate(GenerateRequest(prompt="x", hardware="cpu"))
    finally:
        m._device_locks["cpu"].release()
    assert m.queue_depth() == 0
    assert m.generate(GenerateRequest(prompt="x", hardware="cpu")).image.size == (64, 64)


BAD_CLI = [
    (["--size", "0x64"], "width=0 is not accepted"),
    (["--size", "64x100"], "height=100 is not accepted: tiny-flux2-klein needs a multiple of 16"),
    (["--steps", "0"], "steps=0 is not accepted"),
    (["--guidance", "nan"], "guidance=nan is not accepted"),
    (["--seed", "-5"], "seed=-5 is not accepted"),
    (["--model", "sdxl"], "model='sdxl' is not accepted: known values are"),
    (["--mode", "compiled", "--placement", "offload"], "offload hooks cannot be traced"),
    (["--model", "tiny-sd3", "--mode", "regional"], "has no repeated blocks"),
    (["--mode", "eager-fused"], "cpu does not offer it; only tpu does"),
    (["--hardware", "tpu"], "torch_tpu is not installed"),
]


@pytest.mark.slow
def test_bad_input_through_the_cli_is_one_message_without_traceback():
    # All cases in one process would stop at the first; each is a separate run of the real CLI.
    def run(case):
        args, message = case
        done = subprocess.run([sys.executable, "-m", "acceldemo", "generate", "--prompt", "x", *args],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)
        return done.returncode, done.stderr, message

    with ThreadPoolExecutor(2) as pool:
        for code, stderr, message in pool.map(run, BAD_CLI):
            assert code == 2 and message in stderr and "Traceback" not in stderr, (message, stderr[-500:])


def test_status_and_metrics_need_the_token_when_one_is_set(fresh_manager):
    from acceldemo.ui.server import create_app

    with TestClient(create_app(fresh_manager(), api_token="s3cret")) as client:
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


@pytest.mark.slow
def test_sixteen_clients_four_requests_each_get_their_own_results(server):
    from gradio_client import Client

    shapes = ["64x64", "128x64", "64x128", "96x96"]

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
    print(f"64 requests from 16 clients in {time.time() - started:.1f} s")


def test_out_of_memory_while_loading_evicts_idle_pipelines_and_retries_once(fresh_manager):
    m = fresh_manager()
    m.generate(GenerateRequest(prompt="resident", hardware="cpu", model="tiny-flux1"))
    real_load, failures = m.executor.load, []

    def load_after_one_oom(key, spec, on_progress):
        if not failures:
            failures.append(key)
            raise MemoryError("device memory exhausted")
        return real_load(key, spec, on_progress)

    m.executor.load = load_after_one_oom
    events = []
    result = m.generate(GenerateRequest(prompt="x", hardware="cpu", model="tiny-sd3"), events.append)
    assert result.image.size == (64, 64)
    assert "out of memory: freed 1 pipeline(s), loading again" in [e.message for e in events]
    assert {p.key.model: p.resident for p in m.status()} == {"tiny-flux1": False, "tiny-sd3": True}


def test_out_of_memory_with_nothing_to_free_is_a_clear_error(fresh_manager):
    from acceldemo.errors import GenerationFailed

    m = fresh_manager()

    def always_oom(key, spec, on_progress):
        raise MemoryError("device memory exhausted")

    m.executor.load = always_oom
    with pytest.raises(GenerationFailed, match="MemoryError: device memory exhausted .*try placement offload or tp"):
        m.generate(GenerateRequest(prompt="x", hardware="cpu"))


def test_an_exception_mid_denoise_is_a_clear_error_and_the_next_request_works(fresh_manager):
    from acceldemo.errors import GenerationFailed

    m = fresh_manager()
    m.generate(GenerateRequest(prompt="x", hardware="cpu"))
    calls = []

    def fail_at_step_two(event):
        if event.phase == "denoise" and event.step == 2 and not calls:
            calls.append(event)
            raise RuntimeError("NaN in the latents")

    with pytest.raises(GenerationFailed, match="failed at 64x64: RuntimeError: NaN in the latents"):
        m.generate(GenerateRequest(prompt="x", hardware="cpu", seed=3), fail_at_step_two)
    assert m.generate(GenerateRequest(prompt="x", hardware="cpu", seed=3)).warm


def test_no_model_is_ever_loaded_with_remote_code():
    import pathlib

    sources = pathlib.Path(ROOT, "acceldemo").rglob("*.py")
    assert not [p for p in sources if "trust_remote_code=True" in p.read_text()]
