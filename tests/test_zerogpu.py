"""ZeroGPU (hardware/zerogpu.py, executors/zerogpu.py) with the real `spaces` package: off a ZeroGPU Space its
decorator is a pass-through and the hardware is absent; on one (SPACES_ZERO_GPU), in a process of its own, each draw
goes through the package's own schedule, fork, allow and release against a stand-in of the device API on loopback
(tests/fakes/zerogpu_api.py), with the CPU standing in for the lent GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from acceldemo.config import Settings
from acceldemo.hardware import HardwareRegistry, host_kinds
from acceldemo.hardware.zerogpu import POOL_REFUSAL, ZeroGpuHardware, zero_gpu_on

REPO = Path(__file__).resolve().parents[1]


def test_off_zerogpu_the_real_decorator_is_a_pass_through_and_the_hardware_is_absent(monkeypatch):
    monkeypatch.delenv("SPACES_ZERO_GPU", raising=False)
    import spaces

    def draw(x):
        return x * 2

    assert spaces.GPU(duration=lambda x: 5)(draw) is draw
    found = HardwareRegistry(Settings.from_env()).get("zerogpu").detect()
    assert not found.available and "SPACES_ZERO_GPU" in found.reason


def test_zerogpu_switch_reads_as_the_spaces_package_does():
    for on in ("1", "t", "true", "True", "TRUE"):
        assert zero_gpu_on({"SPACES_ZERO_GPU": on})
    for off in ("", "0", "false", "no"):
        assert not zero_gpu_on({"SPACES_ZERO_GPU": off})
    assert not zero_gpu_on({})


def test_zerogpu_host_kinds_modes_and_placements():
    kinds = host_kinds()
    assert kinds["zerogpu"].devices == 1 and kinds["zerogpu"].memory_bytes == 70 * 1000**3
    assert kinds["zerogpu-xlarge"].memory_bytes == 141 * 1000**3
    assert [str(m) for m in ZeroGpuHardware.offered_modes()] == ["eager", "compiled"]
    adapter = ZeroGpuHardware(Settings.from_env())
    from acceldemo.records import Mode, Placement

    assert "packaged repeated blocks are not built here" in adapter.mode_refusal(Mode.REGIONAL)
    assert adapter.mode_refusal(Mode.COMPILED) is None and adapter.mode_refusal(Mode.EAGER) is None
    # Without packages, compiled would be a JIT compile in every forked process: not offered, and says why.
    unpackaged = ZeroGpuHardware(Settings.from_env({"ACCELDEMO_PRECOMPILE": "off"}))
    assert [str(m) for m in unpackaged.modes] == ["eager"]
    assert "ACCELDEMO_PRECOMPILE=off" in unpackaged.mode_refusal(Mode.COMPILED)

    assert adapter.placement_refusal(Placement.DEVICE) is None
    assert all(adapter.placement_refusal(p) == POOL_REFUSAL for p in (Placement.TP, Placement.CFG, Placement.CP))
    assert "offload" in adapter.placement_refusal(Placement.OFFLOAD)


# What runs in the ZeroGPU process: the switch on, the stand-in API, the CPU patches, the CPU as the lent GPU.
_ON_ZEROGPU = """
import json, os, sys, tempfile
from tests.fakes.zerogpu_api import ZeroGpuApi, keep_tensors_on_cpu_in_the_child, lend_the_cpu, patch_cpu_torch_for_spaces

api = ZeroGpuApi(reuse=True)  # the second draw goes to the child the first one forked
os.environ.update(SPACES_ZERO_GPU="true", SPACES_ZERO_DEVICE_API_URL=api.url,
                  ZEROGPU_OFFLOAD_DIR=tempfile.mkdtemp(), ACCELDEMO_ZEROGPU_FIRST_S="42")
patch_cpu_torch_for_spaces()

from acceldemo import hardware
from acceldemo.config import Settings

lend_the_cpu()
settings = Settings.from_env()
hardware.prepare_process(settings)  # imports spaces, which patches torch
keep_tensors_on_cpu_in_the_child()
import numpy
from acceldemo.builder import build_engine
from acceldemo.errors import AcceldemoError
from acceldemo.records import GenerateParams

engine = build_engine(settings)
draws = []
for seed in (1, 2):
    messages = []
    result = engine.generate(GenerateParams(prompt="a red circle on a blue background", resolution="64x64",
                                            steps=4, seed=seed), lambda event: messages.append(event.message))
    pixels = numpy.asarray(result.image)
    draws.append({"facts": result.facts(), "size": list(result.image.size), "std": float(pixels.std()),
                  "messages": messages})
# Stop, from this process, while the lent process draws.
steps_seen = []
try:
    engine.generate(GenerateParams(prompt="a red circle", resolution="64x64", steps=40, seed=9),
                    lambda event: steps_seen.append(event.step or 0), lambda: max(steps_seen, default=0) >= 2)
    stopped = None
except AcceldemoError as error:
    stopped = str(error)
refusals = {}
for name, params in {"regional": dict(mode="regional"), "tp": dict(placement="tp", tp_size=2)}.items():
    try:
        engine.check(GenerateParams(prompt="x", hardware="zerogpu", **params))
    except AcceldemoError as error:
        refusals[name] = str(error)
# The platform refuses: a visitor's spent quota, then no GPU free.
platform = {}
for answer in ("quota", "no_gpu"):
    api.answer = answer
    try:
        engine.submit(engine.check(GenerateParams(prompt="a red circle", resolution="64x64", steps=4, seed=11)),
                      visitor_token="eyJ9.eyJ1c2VyIjoiYWxpY2UifQ.c2ln").result()
    except AcceldemoError as error:
        platform[answer] = [type(error).__name__, str(error), getattr(error, "retry_after_s", None)]
api.answer = "gpu"
# Two visitors' requests waiting together behind a long draw (stopped once all four are in line): a call draws only
# for one visitor, whose quota it is charged to.
before = len(api.calls)
jobs = []
blocker = engine.submit(engine.check(GenerateParams(prompt="a red circle", resolution="64x64", steps=100, seed=3)),
                        lambda event: None, lambda: len(jobs) == 4)
for visitor in ("alice", "alice", "bob", "bob"):
    jobs.append(engine.submit(engine.check(GenerateParams(prompt="a blue square", resolution="64x64", steps=4,
                                                          seed=len(jobs))), visitor_token=f"token-of-{visitor}"))
try:
    blocker.result()
except AcceldemoError:
    pass
visitors = {"batches": [job.result().facts()["batch"] for job in jobs],
            "tokens": [query.get("token") for path, query in api.calls[before:] if path == "/schedule"]}
engine.close()
result = {"draws": draws, "calls": api.calls[:before], "pid": os.getpid(), "refusals": refusals,
          "stopped": stopped, "steps_seen": steps_seen, "platform": platform, "visitors": visitors}
print("ZEROGPU-RESULT:" + json.dumps(result), flush=True)
"""


@pytest.fixture(scope="module")
def on_zerogpu():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    env.pop("SPACES_ZERO_GPU", None)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_ON_ZEROGPU)], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("ZEROGPU-RESULT:")]
    assert done.returncode == 0 and lines, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return json.loads(lines[-1].removeprefix("ZEROGPU-RESULT:"))


def test_each_draw_asks_the_platform_for_the_gpu_through_the_real_spaces_package(on_zerogpu):
    calls = [path for path, _ in on_zerogpu["calls"]]
    assert calls.count("/schedule") == 5 and calls.count("/release") == 3, calls
    # Each draw: schedule (the parent asks), allow (the forked child, with its pid), release (the parent, after the
    # result came back through the pipe).
    # One fork: the stand-in said the GPU stayed idle, so the second draw ran in the same child (which had moved the
    # pipeline to its device already).
    assert calls[:5] == ["/schedule", "/allow", "/release", "/schedule", "/release"]
    assert calls.count("/allow") == 1  # the stopped draw too went to that child
    allows = [query for path, query in on_zerogpu["calls"] if path == "/allow"]
    assert all(int(query["pid"]) != on_zerogpu["pid"] for query in allows)
    # No visitor's token (a call made here, not through a Space's front end): the call is the Space's own.
    schedules = [query for path, query in on_zerogpu["calls"] if path == "/schedule"]
    assert all("token" not in query for query in schedules[:3])
    releases = [query for path, query in on_zerogpu["calls"] if path == "/release"]
    assert all(query["fail"] == "false" and query["allowToken"] == "token-1" for query in releases)
    for draw in on_zerogpu["draws"]:
        assert draw["size"] == [64, 64] and draw["std"] > 5
        # No hardware was named: on a ZeroGPU Space the lent GPU is the default.
        assert draw["facts"]["hardware"] == "zerogpu" and draw["facts"]["mode"] == "eager"


def test_the_lent_process_reports_its_steps_and_stops_when_asked(on_zerogpu):
    first, second = (draw["messages"] for draw in on_zerogpu["draws"])
    # This process's own event, then the child's: the move to its device (the first draw only), and each step.
    assert "asking ZeroGPU for a large GPU for 42 s" in first
    assert any(m.startswith("moved to the lent GPU in ") for m in first)
    assert not any(m.startswith("moved to the lent GPU") for m in second)
    for messages in (first, second):
        assert [m for m in messages if m.startswith("step ")] == [f"step {i}/4" for i in range(1, 5)]
    # Stopped after step 2 was seen here: the child read the flag at a later step and ended the call early.
    stopped = on_zerogpu["stopped"]
    assert stopped and stopped.startswith("stopped at 64x64 after "), stopped
    assert int(stopped.split(" after ")[1].split(" of ")[0]) < 40 and "of 40 steps" in stopped
    assert 2 <= max(on_zerogpu["steps_seen"]) < 40


def test_the_platforms_refusals_are_a_spent_quota_with_its_wait_and_no_gpu_free(on_zerogpu):
    kind, message, retry_after = on_zerogpu["platform"]["quota"]
    assert kind == "GpuQuotaExceeded" and retry_after == 83
    assert message.startswith("ZeroGPU quota exceeded: You have exceeded your ZeroGPU quota (11s requested vs. 30s "
                              "left). Try again in 0:01:23.")
    kind, message, _ = on_zerogpu["platform"]["no_gpu"]
    assert kind == "DeviceBusy" and message.startswith("ZeroGPU client error: ")
    # The visitor's token went with both.
    assert [query.get("token") for path, query in on_zerogpu["calls"] if path == "/schedule"][-2:] == \
        ["eyJ9.eyJ1c2VyIjoiYWxpY2UifQ.c2ln"] * 2


def test_a_call_draws_for_one_visitor_and_is_charged_to_their_quota(on_zerogpu):
    visitors = on_zerogpu["visitors"]
    # The blocker's call (the Space's own), then one call per visitor, each of their two requests drawn together.
    assert visitors["tokens"] == [None, "token-of-alice", "token-of-bob"], visitors
    assert visitors["batches"] == [2, 2, 2, 2], visitors


def test_the_duration_asked_is_the_first_guess_then_the_measured_steps(on_zerogpu):
    first, second = (draw["facts"]["zero_gpu"] for draw in on_zerogpu["draws"])
    schedules = [query for path, query in on_zerogpu["calls"] if path == "/schedule"]
    # What the facts say was asked is what the package sent (duration x the H200's duration factor 1.0).
    assert [int(query["durationSeconds"]) for query in schedules[:2]] == [first["asked_seconds"],
                                                                           second["asked_seconds"]]
    assert first["asked_seconds"] == 42 and first["size"] == "large"  # ACCELDEMO_ZEROGPU_FIRST_S
    # The second: 4 steps x the step time measured on the first, plus the 10 s margin (a tiny model's steps are
    # milliseconds here).
    assert second["asked_seconds"] == 11
    assert 0 < first["used_seconds"] < 300 and 0 < second["used_seconds"] < 300
    # The first draw paid for the fork and the move to the device; the second went to the same child.
    assert 0 < second["lending_seconds"] < first["lending_seconds"]


def test_pools_and_regional_mode_are_refused_by_name_on_zerogpu(on_zerogpu):
    refusals = on_zerogpu["refusals"]
    assert "mode 'regional' is not possible here: on ZeroGPU a JIT compile dies" in refusals["regional"]
    assert "ZeroGPU lends one GPU to one forked process per call" in refusals["tp"]


@pytest.mark.slow
def test_the_app_on_a_zerogpu_space_reports_start_up_and_draws_through_the_lent_gpu(tmp_path):
    """app.py itself, as a ZeroGPU Space starts it: `spaces` first, the platform told the app is up, and a request to
    the OpenAI door (the official SDK) drawn inside a `spaces.GPU` call in a forked child."""
    import base64

    import openai

    from tests.engines import free_port, wait_until_answers
    from tests.fakes.zerogpu_api import ZeroGpuApi

    api, port = ZeroGpuApi(), free_port()
    site = REPO / "tests" / "fakes" / "zerogpu_site"
    env = {**os.environ, "SPACES_ZERO_GPU": "true", "SPACES_ZERO_DEVICE_API_URL": api.url,
           "ZEROGPU_OFFLOAD_DIR": str(tmp_path / "offload"),
           "PYTHONPATH": os.pathsep.join(p for p in (str(site), str(REPO), os.environ.get("PYTHONPATH")) if p)}
    log_path = tmp_path / "app.log"
    with open(log_path, "w") as log:
        app = subprocess.Popen([sys.executable, "app.py", "--port", str(port)], cwd=REPO, env=env, stdout=log,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_answers(url + "/health", app, log_path)
        assert [path for path, _ in api.calls] == ["/startup-report"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        # The token a ZeroGPU Space's front end adds for a signed-in visitor (a JWT; the platform reads its payload).
        payload = base64.urlsafe_b64encode(json.dumps({"user": "alice"}).encode()).decode().rstrip("=")
        token = f"eyJhbGciOiJFZERTQSJ9.{payload}.c2ln"
        answer = client.images.generate(prompt="a red circle on a blue background", size="64x64",
                                        response_format="b64_json", extra_body={"seed": 3, "num_inference_steps": 4},
                                        extra_headers={"X-IP-Token": token})
        import io

        import numpy as np
        from PIL import Image

        image = Image.open(io.BytesIO(base64.b64decode(answer.data[0].b64_json)))
        assert image.size == (64, 64) and np.asarray(image).std() > 5
        facts = answer.model_extra["acceldemo"][0]
        assert facts["hardware"] == "zerogpu" and facts["zero_gpu"]["asked_seconds"] == 60
        calls = [path for path, _ in api.calls]
        assert calls[:2] == ["/startup-report", "/schedule"] and calls.count("/release") == 1 and "/allow" in calls
        # The visitor's token went to the platform with the schedule: their quota is the one charged.
        schedule = next(query for path, query in api.calls if path == "/schedule")
        assert schedule["token"] == token and schedule["durationSeconds"] == "60"
        allow = next(query for path, query in api.calls if path == "/allow")
        assert int(allow["pid"]) != app.pid
        assert "ZeroGPU: each draw asks the platform for a large GPU slice" in log_path.read_text()
        # The visitor's quota is spent: a 429 with the platform's wait, as for a full line.
        api.answer = "quota"
        with pytest.raises(openai.RateLimitError) as refused:
            client.images.generate(prompt="a red circle", size="64x64", extra_headers={"X-IP-Token": token})
        assert refused.value.response.headers["retry-after"] == "83"
        assert refused.value.code == "gpu_quota_exceeded" and "Try again in 0:01:23" in refused.value.message
    finally:
        app.terminate()
        app.wait(timeout=30)
        api.close()


def test_the_app_refuses_a_ray_fleet_or_replicas_on_zerogpu():
    env = {**os.environ, "SPACES_ZERO_GPU": "1", "SPACES_ZERO_DEVICE_API_URL": "http://127.0.0.1:9"}
    for flags in (["--ray", "auto"], ["--replicas", "2"]):
        done = subprocess.run([sys.executable, "app.py", *flags], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2, done.stderr
        assert f"error: {flags[0]} on ZeroGPU (SPACES_ZERO_GPU is set): ZeroGPU lends one GPU" in done.stderr


@pytest.mark.slow
def test_the_gpu_machines_script_runs_dry_on_this_host(tmp_path):
    """bench/device/zerogpu_cuda.py, the check for a lent CUDA machine, with --dry-run: the tests' patches and the
    CPU as the lent device; its report has a row per draw, the first one forking the child the others reuse."""
    out = tmp_path / "dry.json"
    done = subprocess.run([sys.executable, "-m", "bench.device.zerogpu_cuda", "--dry-run", "--size", "64x64",
                           "--draws", "2", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "SPACES_ZERO_GPU"})
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    first, second = report["draws"]
    assert report["dry_run"] and first["size"] == [64, 64] and first["child_pid"] == second["child_pid"]
    assert (first["asked_s"], second["asked_s"]) == (60, 11)
    assert report["device_api_calls"] == ["/schedule", "/allow", "/release", "/schedule", "/release"]


# Compiled on ZeroGPU: the warm-up builds a package in the lent process (real inductor, AOTInductor), a later call in a
# newly forked process loads it, and a shape nobody warmed is refused by name.
_COMPILED_ON_ZEROGPU = """
import json, os, tempfile
from tests.fakes.zerogpu_api import ZeroGpuApi, keep_tensors_on_cpu_in_the_child, lend_the_cpu, patch_cpu_torch_for_spaces

api = ZeroGpuApi(reuse=False)  # every call in a newly forked process, as after the GPU went to another Space
os.environ.update(SPACES_ZERO_GPU="true", SPACES_ZERO_DEVICE_API_URL=api.url,
                  ZEROGPU_OFFLOAD_DIR=tempfile.mkdtemp(), ACCELDEMO_ZEROGPU_COMPILE_S="321")
patch_cpu_torch_for_spaces()
from acceldemo import hardware
from acceldemo.config import Settings

lend_the_cpu()
settings = Settings.from_env()
hardware.prepare_process(settings)
keep_tensors_on_cpu_in_the_child()
from acceldemo.builder import build_engine
from acceldemo.errors import AcceldemoError
from acceldemo.records import GenerateParams

engine = build_engine(settings)
ask = dict(prompt="a red circle on a blue background", mode="compiled", steps=2, seed=5)
warmed = engine.warm_up(GenerateParams(**ask, resolution="64x64"))
drawn = engine.generate(GenerateParams(**ask, resolution="64x64"))
try:
    engine.generate(GenerateParams(**ask, resolution="80x64"))
    refused = None
except AcceldemoError as error:
    refused = str(error)
engine.close()
result = {"warmed": [str(shape.state) for shape in warmed], "facts": drawn.facts(), "size": list(drawn.image.size),
          "refused": refused, "calls": api.calls}
print("ZEROGPU-RESULT:" + json.dumps(result), flush=True)
"""


@pytest.mark.slow
@pytest.mark.inductor
def test_compiled_on_zerogpu_is_a_package_built_by_the_warm_up_and_loaded_by_a_new_process():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    env.pop("SPACES_ZERO_GPU", None)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_COMPILED_ON_ZEROGPU)], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("ZEROGPU-RESULT:")]
    assert done.returncode == 0 and lines, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    result = json.loads(lines[-1].removeprefix("ZEROGPU-RESULT:"))
    assert result["warmed"] == ["ready"]
    schedules = [int(query["durationSeconds"]) for path, query in result["calls"] if path == "/schedule"]
    # The warm-up asked for the compile's seconds (ACCELDEMO_ZEROGPU_COMPILE_S); then a draw in a new process (two
    # allows: two forks) loaded the package the warm-up's process had saved, compiling nothing.
    assert schedules[0] == 321 and len(schedules) == 2
    assert [path for path, _ in result["calls"]].count("/allow") == 2
    facts = result["facts"]
    assert facts["mode"] == "compiled" and facts["hardware"] == "zerogpu" and result["size"] == [64, 64]
    assert facts["new_graphs"] == 0 and facts["packages"].get("loaded") == 1, facts
    assert "compiled 80x64 has no compiled package on zerogpu yet: warm it up first (--warmup compiled:80x64" \
        in result["refused"]
