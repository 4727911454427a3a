"""The fleet on a real two-node Ray cluster (two `ray start` processes of one CPU each on 127.0.0.1, asking for
their token) with app.py serving on it. Ray binds some listeners on every interface, so these run only inside a private network namespace:
`tests/test_fleet.py` runs this file there with pytest (its name keeps the normal collection away from it).
"""
from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from PIL import Image

from acceldemo.bench.fleet import RAY_ENV, LocalCluster, fleet_app, in_private_network

APP = Path(__file__).resolve().parents[1] / "app.py"
pytestmark = pytest.mark.skipif(not in_private_network(), reason="run by tests/test_fleet.py in a private network")

PROMPT = "a red circle on a blue background, top left"
# Long enough (several seconds on one core) to be killed or cancelled mid-way.
LONG = {"model": "tiny-flux2-klein", "size": "256x256", "num_inference_steps": 100, "mode": "eager"}


WARM_CACHE = "taylorseer"


@pytest.fixture(scope="module")
def cluster():
    cluster = LocalCluster(nodes=2, cpus=1)
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def app(cluster):
    # Warmed at start with a step cache: the replica warms the very request it then serves, every field included.
    # These tests are one client (this address) filling the line: its share is the whole line (fairness between
    # clients on a fleet is tests/test_fleet.py's and tests/test_fair_share.py's).
    server = fleet_app(cluster, {"ACCELDEMO_QUEUE_SIZE": "6", "ACCELDEMO_CLIENT_QUEUE": "6"},
                       args=("--replicas", "2", "--warmup", f"compiled:64x64:step_cache={WARM_CACHE}"))
    try:
        yield server.ready()
    finally:
        print(server.output()[-4000:])
        server.close()


def _status(url: str) -> dict:
    return httpx.get(url + "/status", timeout=30).json()


def _replicas(url: str) -> list[dict]:
    return _status(url)["replicas"]


def _wait(condition, timeout: float, what: str, url: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"{what} within {timeout} s; /status replicas: {json.dumps(_replicas(url))[:2000]}")


def test_concurrent_sdk_requests_land_on_both_nodes(app):
    client = OpenAI(base_url=app + "/v1", api_key="unused", timeout=300, max_retries=0)
    facts, errors = [], []

    def one(i: int) -> None:
        try:
            answer = client.images.generate(prompt=PROMPT, size="64x64", extra_body={"seed": i, "mode": "eager"})
            image = Image.open(io.BytesIO(base64.b64decode(answer.data[0].b64_json)))
            assert image.size == (64, 64) and image.getextrema()[0][0] != image.getextrema()[0][1]
            facts.append(answer.model_extra["acceldemo"][0])
        except Exception as error:  # noqa: BLE001 - collected and asserted below
            errors.append(repr(error))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    nodes = {fact["node"] for fact in facts}
    assert len(facts) == 8 and len(nodes) == 2, nodes
    assert all("/" in node for node in nodes)  # host name / Ray node id
    # The replicas report what they served every second: /status lists both nodes' replicas and their counts.
    def counted():
        found = _replicas(app)
        return found if sum(replica["served"] for replica in found) >= 8 else None

    listed = _wait(counted, 30, "8 images counted by the replicas", app)
    assert len(listed) == 2 and {replica["node"] for replica in listed} == nodes, listed
    assert all(replica["served"] >= 1 and replica["replica"] for replica in listed), listed


def test_the_start_up_warm_up_reached_ready_and_its_request_compiles_nothing_more(app):
    startup = _status(app)["startup"]
    assert startup["state"] == "done", startup
    assert httpx.get(app + "/ready", timeout=30).status_code == 200
    answer = httpx.post(app + "/v1/images/generations", timeout=300, json={
        "prompt": PROMPT, "size": "64x64", "mode": "compiled", "step_cache": WARM_CACHE, "seed": 3}).json()
    facts = answer["acceldemo"][0]
    image = Image.open(io.BytesIO(base64.b64decode(answer["data"][0]["b64_json"])))
    assert image.size == (64, 64) and image.getextrema()[0][0] != image.getextrema()[0][1]
    assert facts["new_graphs"] == 0 and facts["mode"] == "compiled", facts
    assert facts["step_cache"]["ran"] == WARM_CACHE, facts


@pytest.fixture(scope="module")
def driver(cluster):
    """This process joined to the cluster ahead of time, so a kill mid-request is one call, not a connection. Ray
    reads its auth settings when it is imported: the cluster's token is in the environment first."""
    with pytest.MonkeyPatch.context() as environment:
        for name, value in cluster.auth_env.items():
            environment.setenv(name, value)
        environment.delenv("RAY_AUTH_TOKEN", raising=False)
        import ray

        ray.init(address=cluster.address, log_to_driver=False, runtime_env={"env_vars": RAY_ENV})
        yield ray
        ray.shutdown()


def _replica_actor(ray, replica_id: str):
    named = ray.util.list_named_actors(all_namespaces=True)
    actors = [a for a in named if a["name"].startswith("SERVE_REPLICA") and a["name"].endswith(replica_id)]
    assert len(actors) == 1, (replica_id, named)
    return ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"])


def test_a_request_whose_replica_is_killed_is_served_elsewhere_and_the_replica_comes_back(app, driver):
    events, killed, actor, killed_at = [], None, None, None
    body = {"prompt": PROMPT, "seed": 7, "stream": True, **LONG}
    with httpx.stream("POST", app + "/v1/images/generations", json=body, timeout=600) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[len("data: "):])
            events.append(event)
            message = event.get("message", "")
            if killed is None and message.startswith("running on replica "):
                killed = message.split()[3]
                actor = _replica_actor(driver, killed)  # found now: at step 3 the kill is one call
            if actor is not None and killed_at is None and event.get("step") == 3:
                driver.kill(actor, no_restart=True)  # mid-request: it is drawing its fourth step of 100
                killed_at = len(events)
    messages = [event.get("message", "") for event in events]
    assert killed and killed_at, messages[:8]
    assert any("its replica was lost: running it again on another" in m for m in messages), \
        (messages[killed_at - 2:killed_at + 6], messages[-3:], events[-1].get("type"))
    assert events[-1]["type"] == "image_generation.completed", events[-1]
    image = Image.open(io.BytesIO(base64.b64decode(events[-1]["b64_json"])))
    assert image.size == (256, 256)
    again = [m for m in messages if m.startswith("running on replica ")][-1].split()[3]
    assert again != killed
    # Serve starts a replacement: two replicas again, the killed one not among them.
    _wait(lambda: len(_replicas(app)) == 2 and killed not in {r["replica"] for r in _replicas(app)}, 180,
          "two replicas again, the killed one replaced", app)


def test_a_full_line_is_answered_429_with_retry_after(app):
    answers, lock = [], threading.Lock()
    start = threading.Barrier(12)

    def one(i: int) -> None:
        start.wait()
        reply = httpx.post(app + "/v1/images/generations", json={"prompt": PROMPT, "seed": i, **LONG}, timeout=600)
        with lock:
            answers.append(reply)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    codes = sorted(reply.status_code for reply in answers)
    refused = [reply for reply in answers if reply.status_code == 429]
    # Two replicas drawing + a line of six: eight served, the other four refused at once.
    assert codes.count(200) == 8 and len(refused) == 4, codes
    assert all(int(reply.headers["Retry-After"]) >= 1 for reply in refused)
    assert all(reply.json()["error"]["code"] == "queue_full" for reply in refused)


def test_scale_to_zero_and_back(cluster):
    autoscaling = {"min_replicas": 0, "max_replicas": 2, "initial_replicas": 1, "target_ongoing_requests": 1,
                   "downscale_delay_s": 2, "upscale_delay_s": 0, "downscale_to_zero_delay_s": 2}
    server = fleet_app(cluster, {"ACCELDEMO_RAY_AUTOSCALING": json.dumps(autoscaling)})
    try:
        url = server.ready()
        body = {"prompt": PROMPT, "size": "64x64", "mode": "eager", "seed": 3}
        first = httpx.post(url + "/v1/images/generations", json=body, timeout=600)
        assert first.status_code == 200, first.text
        _wait(lambda: len(_replicas(url)) >= 1, 30, "the replica that drew it listed", url)
        _wait(lambda: _replicas(url) == [], 120, "scaled to zero when idle", url)
        again = httpx.post(url + "/v1/images/generations", json=body, timeout=600)
        assert again.status_code == 200, again.text
        assert again.json()["data"][0]["b64_json"] == first.json()["data"][0]["b64_json"]  # same seed, same image
        assert len(_replicas(url)) == 1
    finally:
        print(server.output()[-4000:])
        server.close()


def _without_ray_auth(**extra: str) -> dict[str, str]:
    """This environment less every Ray auth setting; Ray gives up joining after 2 tries, not 20 (one a second)."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}, **RAY_ENV,
            "RAY_gcs_server_port_wait_time_s": "2", **extra}


def test_a_ray_init_without_the_token_is_refused(cluster):
    joined = subprocess.run(
        [sys.executable, "-c", f"import ray; ray.init(address={cluster.address!r}); print('joined')"],
        capture_output=True, text=True, timeout=120, env=_without_ray_auth(), stdin=subprocess.DEVNULL)
    assert joined.returncode == 1 and "joined" not in joined.stdout, joined.stdout + joined.stderr[-3000:]
    assert "InvalidAuthToken: Authentication token is missing or incorrect" in joined.stderr, joined.stderr[-3000:]


def test_the_app_with_a_wrong_token_says_so_in_one_line_and_never_shows_it(cluster):
    wrong = "f" * 64
    done = subprocess.run(
        [sys.executable, str(APP), "--ray", cluster.address, "--port", "1"], capture_output=True, text=True,
        timeout=300, stdin=subprocess.DEVNULL,
        env=_without_ray_auth(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=wrong, OMP_NUM_THREADS="1"))
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and errors == [
        f"error: --ray {cluster.address}: the Ray cluster refused this app's token: RAY_AUTH_TOKEN or the file "
        "RAY_AUTH_TOKEN_PATH names must hold the token its nodes were started with"], done.stderr[-3000:]
    assert "Traceback" not in done.stderr and wrong not in done.stdout + done.stderr
