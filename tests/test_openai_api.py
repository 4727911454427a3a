"""The OpenAI-compatible Images API through the official `openai` SDK: images, URLs, models, every error status as
the SDK's own exception, one line and one set of counters with the page, and Gradio's address variables."""
import base64
import io
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from acceldemo.config import Settings
from acceldemo.errors import (
    Cancelled,
    CapacityExceeded,
    DeviceBusy,
    GenerationFailed,
    HardwareUnavailable,
    ModelUnavailable,
    QueueFull,
    UnknownName,
    UnsupportedCombination,
)
from acceldemo.models.catalog import CATALOG, get_model
from acceldemo.models.loading import model_availability
from acceldemo.models.shapes import SIZES as SHAPES_SIZES
from acceldemo.models.shapes import TRAINED_SIZES as TRAINED_SHAPES_SIZES
from acceldemo.records import Shape
from acceldemo.ui.image_store import ImageStore
from acceldemo.ui.keys import Keys
from acceldemo.ui.openai_protocol import api_error
from acceldemo.ui.server import create_app
from tests.engines import DeviceHolder, free_port, serving
from training.shapes.judge import judge

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sdk(url: str, api_key: str = "unused") -> openai.OpenAI:
    # The SDK retries 429 and 5xx by default: the tests want to see each answer.
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=120)


def pixels(b64_json: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64_json))))


def get(url: str, token: str | None = None) -> tuple[int, dict, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


@pytest.fixture(scope="module")
def client(server):
    deadline = time.time() + 180
    while get(server + "/ready")[0] != 200:  # the start-up warm-up of compiled 64x64 first
        assert time.time() < deadline, "start-up warm-up never finished"
        time.sleep(0.5)
    return sdk(server)


# --- against the real app.py (started once per session, about 20 s: slow, as in test_server.py) -----------------------

@pytest.mark.slow
def test_one_image_is_a_png_of_the_asked_size_with_the_engine_facts(client):
    raw = client.images.with_raw_response.generate(model="tiny-flux2-klein", prompt="a red circle", size="128x64",
                                                   extra_body={"seed": 5, "num_inference_steps": 2})
    answer = raw.parse()
    assert len(answer.data) == 1 and answer.data[0].revised_prompt is None and answer.data[0].url is None
    image = pixels(answer.data[0].b64_json)
    assert image.shape == (64, 128, 3) and image.std() > 1.0
    facts = answer.acceldemo[0]
    assert (facts["width"], facts["height"], facts["seed"], facts["steps"], facts["mode"]) == (128, 64, 5, 2, "eager")
    assert facts["device"] == "cpu:0" and facts["seconds"] > 0 and isinstance(facts["warm"], bool)
    assert raw.headers["x-acceldemo-device"] == "cpu:0" and raw.headers["x-acceldemo-model"] == "tiny-flux2-klein"
    assert float(raw.headers["x-acceldemo-seconds"]) == pytest.approx(facts["seconds"], abs=1e-3)
    assert raw.headers["x-acceldemo-new-graphs"] == str(facts["new_graphs"])


@pytest.mark.slow
def test_without_a_seed_each_request_draws_its_own_and_says_which(client):
    first, second = (client.images.generate(prompt="a red circle", size="64x64", n=2,
                                            extra_body={"num_inference_steps": 2}) for _ in range(2))
    seeds = [[facts["seed"] for facts in answer.acceldemo] for answer in (first, second)]
    assert seeds[0][1] == seeds[0][0] + 1 and seeds[1][1] == seeds[1][0] + 1 and seeds[0] != seeds[1]
    assert not (pixels(first.data[0].b64_json) == pixels(second.data[0].b64_json)).all()
    again = client.images.generate(prompt="a red circle", size="64x64",
                                   extra_body={"seed": seeds[1][1], "num_inference_steps": 2})
    # The seed it names makes it again (within one level: the n=2 request was one batched call, which may round
    # differently).
    assert np.abs(pixels(again.data[0].b64_json).astype(int) - pixels(second.data[1].b64_json)).max() <= 1


@pytest.mark.slow
def test_n_images_are_seed_and_seed_plus_one_and_differ(client):
    answer = client.images.generate(prompt="a red circle", size="64x64", n=2,
                                    extra_body={"seed": 3, "mode": "compiled", "guidance_scale": 1.0})
    first, second = (pixels(item.b64_json) for item in answer.data)
    assert first.shape == second.shape == (64, 64, 3)
    assert np.abs(first.astype(int) - second).mean() > 1.0
    assert [f["seed"] for f in answer.acceldemo] == [3, 4]
    # One call drew both (batch 2, warmed at start: compiled:64x64@1,2).
    assert all(f["mode"] == "compiled" and f["new_graphs"] == 0 and f["batch"] == 2 for f in answer.acceldemo)
    again = client.images.generate(prompt="a red circle", size="64x64", extra_body={"seed": 4, "mode": "compiled"})
    # seed+1 is the image seed+1 asks for alone (within one level: a batched product may round differently)
    assert np.abs(pixels(again.data[0].b64_json).astype(int) - second).max() <= 1


@pytest.mark.slow
def test_a_url_answer_serves_the_png_until_it_expires(client, server):
    answer = client.images.generate(prompt="a blue square", size="64x128", response_format="url")
    url = answer.data[0].url
    assert answer.data[0].b64_json is None and url.startswith(server + "/v1/images/")
    code, headers, body = get(url)
    assert code == 200 and headers["content-type"] == "image/png"
    assert Image.open(io.BytesIO(body)).size == (64, 128)
    code, _, body = get(server + "/v1/images/" + "A" * 22)
    assert code == 404 and json.loads(body)["error"]["code"] == "image_not_found"


@pytest.mark.slow
def test_models_list_is_the_catalog_with_what_runs_here(client):
    listed = {model.id: model for model in client.models.list()}
    assert set(listed) == set(CATALOG)
    assert [name for name, model in listed.items() if model.default] == ["tiny-flux2-klein"]
    for name, model in listed.items():
        assert model.object == "model" and model.owned_by == "acceldemo"
        assert (model.available, model.availability) == model_availability(CATALOG[name], Settings.from_env())
    assert listed["tiny-sd3"].available and listed["tiny-sd3"].size == "64x64"
    assert client.models.retrieve("tiny-sd3").guidance_scale == get_model("tiny-sd3").guidance
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("sdxl")


@pytest.mark.slow
def test_invalid_requests_are_400_naming_the_api_field_with_the_engine_message(client):
    cases = [
        (dict(size="100x64"), "size",
         "width=100 is not accepted: tiny-flux2-klein needs a multiple of 16 from 64 to 512 — try 96"),
        (dict(size="big"), "size", "resolution='big' is not accepted: WIDTHxHEIGHT, e.g. 1024x1024"),
        (dict(extra_body={"num_inference_steps": 0}), "num_inference_steps",
         "steps=0 is not accepted: a whole number from 1 to 100"),
        (dict(extra_body={"guidance_scale": 99}), "guidance_scale", "guidance=99.0 is not accepted: a number from 0"),
        (dict(extra_body={"mode": "eager-fused"}), "mode", "cpu does not offer it; only tpu does"),
        (dict(extra_body={"hardware": "tpu"}), "hardware", "hardware 'tpu' is not available here"),
        (dict(n=7), "n", "n=7 is not accepted: input should be less than or equal to 4"),
        (dict(n=2, extra_body={"seed": 2**63 - 1}), "seed",
         "seed=9223372036854775807 is not accepted: a whole number from 0 to 9223372036854775806"),
        (dict(response_format="gif"), "response_format", "response_format='gif' is not accepted"),
        (dict(extra_body={"seed": "abc"}), "seed", "seed='abc' is not accepted"),
        (dict(extra_body={"negative_prompt": "blurry"}), "negative_prompt",
         "negative_prompt='blurry' is not accepted: unknown field; accepted fields are prompt, model, n, size"),
    ]
    for arguments, param, message in cases:
        with pytest.raises(openai.BadRequestError) as raised:
            client.images.generate(prompt="a red circle", **arguments)
        error = raised.value
        assert (error.status_code, error.param, error.type) == (400, param, "invalid_request_error"), arguments
        assert message in error.message, (arguments, error.message)
    for body, message in ((b'{"prompt": ', "the body is not valid JSON"), (b"[1, 2]", "must be a JSON object"),
                          (b'{"size": "64x64"}', "prompt is required")):
        answer = httpx.post(str(client.base_url) + "images/generations", content=body, timeout=30)
        assert answer.status_code == 400 and message in answer.json()["error"]["message"], answer.text
    assert client.images.generate(prompt="still serving", size="64x64").data[0].b64_json


@pytest.mark.slow
def test_tiny_shapes_lists_and_accepts_only_its_sizes_and_names_unknown_words(client):
    served = [f"{width}x{height}" for width, height in SHAPES_SIZES]
    assert client.models.retrieve("tiny-shapes").sizes == served
    not_served = [f"{width}x{height}" for width, height in TRAINED_SHAPES_SIZES if (width, height) not in SHAPES_SIZES]
    for size in ("1024x1024", "96x64", *not_served):
        with pytest.raises(openai.BadRequestError) as raised:
            client.images.generate(model="tiny-shapes", prompt="a red square", size=size)
        assert raised.value.param == "size", size
        assert f"resolution='{size}' is not accepted: one of the sizes tiny-shapes draws correctly: " \
               f"{', '.join(served)}" in raised.value.message
    answer = client.images.generate(model="tiny-shapes", prompt="a YELLOW square on a Purple background, sparkly",
                                    size="64x64", extra_body={"mode": "eager"})
    assert pixels(answer.data[0].b64_json).shape == (64, 64, 3)
    facts = answer.acceldemo[0]
    assert facts["unknown_words"] == ["purple", "sparkly"]
    assert facts["note"].startswith("tiny-shapes does not know: purple, sparkly — it knows red, green, blue")
    for width, height in SHAPES_SIZES[1:]:  # every other served size draws what is asked, where it is asked
        answer = client.images.generate(model="tiny-shapes", prompt="a red square on a blue background, top left",
                                        size=f"{width}x{height}", extra_body={"mode": "eager", "seed": 0})
        drawn = Image.fromarray(pixels(answer.data[0].b64_json))
        assert drawn.size == (width, height)
        read = judge(drawn)
        assert (read.colour, read.background, read.position) == ("red", "blue", "top left"), (width, height, read)


@pytest.mark.slow
def test_an_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.images.generate(model="sdxl", prompt="a red circle")
    assert (raised.value.param, raised.value.code) == ("model", "model_not_found")
    assert "model='sdxl' is not accepted: known values are" in raised.value.message


@pytest.mark.slow
def test_a_request_through_the_route_is_counted_once_like_the_page(client, server):
    def counts():
        status = json.loads(get(server + "/status")[2])
        metrics = get(server + "/metrics")[2].decode()
        total = next(line for line in metrics.splitlines() if line.startswith("acceldemo_phase_seconds_count{")
                     and 'phase="total"' in line and 'mode="compiled"' in line)
        return status["counters"]["requests"], float(total.rsplit(" ", 1)[1])

    before, timed_before = counts()
    client.images.generate(prompt="counted", size="64x64", extra_body={"mode": "compiled"})
    after, timed_after = counts()
    assert after == {**before, "ok": before["ok"] + 1} and timed_after == timed_before + 1
    with pytest.raises(openai.BadRequestError):
        client.images.generate(prompt="counted", size="64x100", n=3)  # one request refused: counted once
    assert counts()[0] == {**after, "invalid": after["invalid"] + 1}


@pytest.mark.slow
def test_a_stream_shows_the_compile_and_each_step_then_the_image(client):
    events = list(client.images.generate(prompt="a red circle", size="80x64", stream=True,
                                         extra_body={"mode": "compiled", "seed": 2}))
    progress = [(e.phase, e.message.split(" — ")[0]) for e in events if e.type == "acceldemo.progress"]
    assert ("compile", "compiling 80x64 (first time for this shape)") in progress  # then " — " and its estimate
    steps = [message for phase, message in progress if phase == "denoise"]
    assert steps == [f"step {i}/4" for i in range(1, 5)]
    assert progress.index(("compile", "compiling 80x64 (first time for this shape)")) < progress.index(
        ("denoise", "step 1/4"))
    done = events[-1]
    assert done.type == "image_generation.completed" and [e.type for e in events].count(done.type) == 1
    assert pixels(done.b64_json).shape == (64, 80, 3)
    assert done.acceldemo["new_graphs"] > 0 and done.acceldemo["seed"] == 2
    with pytest.raises(openai.BadRequestError, match="height=60 is not accepted"):  # before the stream starts
        list(client.images.generate(prompt="a red circle", size="80x60", stream=True))


# --- an app in this process, for the statuses that need its state -----------------------------------------------------

def test_the_token_is_the_clients_api_key(fresh_manager):
    with serving(create_app(fresh_manager(), keys=Keys.from_settings(api_token="s3cret"))) as url:
        with pytest.raises(openai.AuthenticationError) as raised:
            sdk(url, "wrong").images.generate(prompt="a red circle")
        assert (raised.value.code, raised.value.type) == ("invalid_api_key", "invalid_request_error")
        with pytest.raises(openai.AuthenticationError):
            sdk(url, "wrong").models.list()
        bare = httpx.post(url + "/v1/images/generations", json={"prompt": "a red circle"}, timeout=30)
        assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
        answer = sdk(url, "s3cret").images.generate(prompt="a red circle", response_format="url")
        assert get(answer.data[0].url)[0] == 401  # the image URL asks for the token too
        code, _, body = get(answer.data[0].url, "s3cret")
        assert code == 200 and Image.open(io.BytesIO(body)).size == (64, 64)


def test_a_full_line_is_429_and_clients_that_leave_are_taken_out_of_line(fresh_manager):
    m = fresh_manager(queue_size=1)
    blocker = DeviceHolder(m)
    with serving(create_app(m)) as url:
        blocker.start()
        gave_up = []

        def impatient() -> None:
            try:
                httpx.post(url + "/v1/images/generations", json={"prompt": "impatient"}, timeout=3)
            except httpx.ReadTimeout:
                gave_up.append(True)

        leaving = threading.Thread(target=impatient)
        leaving.start()
        deadline = time.monotonic() + 30
        while m.queue_depth() < 1:  # the impatient client waits in line for the held device
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(openai.RateLimitError) as raised:
            sdk(url).images.generate(prompt="one too many")
        error = raised.value
        assert error.code == "queue_full" and error.response.headers["retry-after"].isdigit()
        assert "the queue is full: 1 request(s) are already waiting for a device (ACCELDEMO_QUEUE_SIZE=1)" \
            in error.message
        leaving.join(30)
        assert gave_up
        while m.snapshot().counters.requests["cancelled"] < 1:  # its client hung up: it leaves the line
            assert time.monotonic() < deadline, m.snapshot().counters
            time.sleep(0.05)
        assert m.queue_depth() == 0 and blocker.is_alive()
        with httpx.stream("POST", url + "/v1/images/generations", json={"prompt": "watching", "stream": True},
                          timeout=30) as streamed:
            first = next(streamed.iter_lines())
            assert first == "event: acceldemo.progress"  # 1st in line for cpu:0; then it hangs up
        while m.snapshot().counters.requests["cancelled"] < 2:
            assert time.monotonic() < deadline + 30, m.snapshot().counters
            time.sleep(0.05)
        assert m.queue_depth() == 0 and blocker.is_alive()
        blocker.release()
        assert m.snapshot().counters.requests == {"ok": 1, "invalid": 0, "refused": 1, "cancelled": 2, "failed": 0}


def test_generation_is_503_until_the_start_up_warm_up_is_done(fresh_manager):
    m = fresh_manager()
    blocker = DeviceHolder(m)  # the start-up warm-up waits behind it
    blocker.start()
    with serving(create_app(m, warmup=("eager", [Shape(64, 64)], (1,)))) as url:
        client = sdk(url)
        with pytest.raises(openai.InternalServerError) as raised:
            client.images.generate(prompt="too early")
        error = raised.value
        assert (error.status_code, error.code) == (503, "warming_up") and error.response.headers["retry-after"]
        assert "warming 64x64 (eager)" in error.message
        assert {model.id for model in client.models.list()} == set(CATALOG)  # the catalog answers meanwhile
        blocker.release()
        deadline = time.monotonic() + 60
        while get(url + "/ready")[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert pixels(client.images.generate(prompt="in time").data[0].b64_json).shape == (64, 64, 3)


def test_an_engine_failure_is_500_or_an_error_event_with_the_engine_message(fresh_manager):
    m = fresh_manager()

    def broken_load(key, spec, on_progress):
        raise RuntimeError("device lost")

    m.backend.executor.load = broken_load
    with serving(create_app(m)) as url:
        with pytest.raises(openai.InternalServerError) as raised:
            sdk(url).images.generate(prompt="a red circle")
        error = raised.value
        assert (error.status_code, error.type, error.code) == (500, "server_error", "generation_failed")
        assert error.message.endswith("failed: RuntimeError: device lost") and "tiny-flux2-klein" in error.message
        seen = []
        with pytest.raises(openai.APIError, match="failed: RuntimeError: device lost"):
            for event in sdk(url).images.generate(prompt="a red circle", stream=True):
                seen.append(event.message)
        assert seen == ["running on cpu:0"]  # the stream had begun: the failure is its last event
        assert get(url + "/health")[0] == 200 and m.snapshot().counters.requests["failed"] == 2


def test_every_engine_error_has_its_status():
    statuses = [(QueueFull(3, 3, 2, 5), 429, None), (DeviceBusy("cpu:0 stayed busy"), 503, None),
                (CapacityExceeded("already holds 32 shapes"), 400, "size"),
                (UnknownName("model", "sdxl", ["a"]), 404, "model"),
                (UnknownName("mode", "fast", ["eager"]), 400, "mode"),
                (ModelUnavailable("not on this host"), 404, "model"),
                (HardwareUnavailable("tpu", "not installed"), 400, "hardware"),
                (UnsupportedCombination("mode", "offload hooks cannot be traced"), 400, "mode"),
                (Cancelled("stopped"), 499, None), (GenerationFailed("compile failed"), 500, None)]
    for error, status, param in statuses:
        answer = api_error(error)
        assert (answer.status, answer.param, answer.message) == (status, param, str(error)), error
        assert ("Retry-After" in answer.headers) == (status in (429, 503)), error
    bug = api_error(ValueError("a bug"))
    assert (bug.status, bug.message) == (500, "internal error: ValueError: a bug")


def test_image_store_expires_images_and_its_folder_is_private(tmp_path):
    store = ImageStore(ttl_s=0.3, parent=str(tmp_path))
    kept = store.put(b"png bytes")
    assert len(kept) == 22 and store.get(kept) == b"png bytes" and store.get("unknown") is None
    assert oct(store.folder.stat().st_mode & 0o777) == "0o700"
    time.sleep(0.4)
    assert store.get(kept) is None and list(store.folder.iterdir()) == []
    store.close()
    assert not store.folder.exists()


def test_model_availability_is_read_from_the_model_dir_and_the_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    spec = get_model("flux2-dev")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    settings = Settings.from_env({"ACCELDEMO_CACHE_DIR": str(tmp_path), "ACCELDEMO_MODEL_DIR": str(tmp_path / "m")})
    available, why = model_availability(spec, settings)
    assert not available and "hf download black-forest-labs/FLUX.2-dev" in why
    snapshot = tmp_path / "hub" / "models--black-forest-labs--FLUX.2-dev" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "model_index.json").write_text("{}")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc")
    assert model_availability(spec, settings) == (True, "in the Hugging Face cache")
    (tmp_path / "m" / "black-forest-labs" / "FLUX.2-dev").mkdir(parents=True)
    assert model_availability(spec, settings)[1].startswith("in ACCELDEMO_MODEL_DIR")
    assert model_availability(get_model("tiny-sd3"), settings)[0]


# --- Gradio's address variables ---------------------------------------------------------------------------------------

def test_gradios_address_variables_win_over_acceldemo_host_and_port():
    env = {"ACCELDEMO_CACHE_DIR": "/tmp/c", "ACCELDEMO_HOST": "0.0.0.0", "PORT": "9000"}
    assert (Settings.from_env(env).host, Settings.from_env(env).port) == ("0.0.0.0", 9000)
    gradio = Settings.from_env({**env, "GRADIO_SERVER_NAME": "127.0.0.2", "GRADIO_SERVER_PORT": "8123"})
    assert (gradio.host, gradio.port) == ("127.0.0.2", 8123)
    plain = Settings.from_env({"ACCELDEMO_CACHE_DIR": "/tmp/c"})
    assert (plain.host, plain.port) == ("127.0.0.1", 7860)
    with pytest.raises(ValueError, match="GRADIO_SERVER_PORT='http' is not accepted"):
        Settings.from_env({**env, "GRADIO_SERVER_PORT": "http"})


@pytest.mark.slow
def test_app_py_serves_where_gradio_s_variables_say(tmp_path):
    port, other = free_port(), free_port()
    env = {**os.environ, "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port), "PORT": str(other)}
    env.pop("ACCELDEMO_WARMUP", None)
    with open(tmp_path / "app.log", "w") as log:
        process = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not _healthy(port):
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "app.log").read_text()[-2000:]
            time.sleep(0.5)
        assert not _healthy(other)
    finally:
        process.terminate()
        process.wait(30)


def _healthy(port: int) -> bool:
    try:
        return get(f"http://127.0.0.1:{port}/health")[0] == 200
    except OSError:
        return False
