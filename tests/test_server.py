"""The served app through gradio_client and plain HTTP: generate, warm repeats, errors, status, metrics."""
import json
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from gradio_client import Client
from PIL import Image

from acceldemo.models.shapes import SIZES as SHAPES_SIZES

pytestmark = pytest.mark.slow


def call_generate(client, resolution="64x64", mode="compiled", **kw):
    args = dict(prompt="a red circle", model="tiny-flux2-klein", hardware="cpu", mode=mode, placement="auto",
                tp_size=2, resolution=resolution, steps=4, guidance=1.0, seed=0)
    args.update(kw)
    return client.predict(*args.values(), api_name="/generate")


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@pytest.fixture(scope="module")
def client(server):
    deadline = time.time() + 180
    while get(server + "/ready")[0] != 200:  # start-up warm-up of 64x64 first
        assert time.time() < deadline, "start-up warm-up never finished"
        time.sleep(0.5)
    return Client(server + "/", verbose=False)


def test_generate_returns_an_image_of_the_asked_size(client):
    image_path, text, facts = call_generate(client, resolution="128x64", mode="eager")
    pixels = np.asarray(Image.open(image_path))
    assert pixels.shape[:2] == (64, 128) and pixels.std() > 1.0
    assert facts["width"] == 128 and facts["height"] == 64 and "128x64" in text


def test_a_shape_warmed_at_start_is_warm_and_a_repeat_is_warm(client):
    _, _, first = call_generate(client, resolution="64x64")
    assert first["new_graphs"] == 0 and first["warm"]
    _, _, new = call_generate(client, resolution="96x64")
    _, _, again = call_generate(client, resolution="96x64", seed=5)
    assert new["new_graphs"] > 0 and not new["warm"]
    assert again["new_graphs"] == 0 and again["warm"]


def test_warm_up_through_the_api_takes_batch_buckets(client):
    answer = client.predict(["128x64"], "tiny-flux2-klein", "cpu", "compiled", "auto", 2, ["1", "2"],
                            api_name="/warm_up")
    assert answer.startswith("Warmed: 128x64 (ready") and "128x64 ×2 (ready" in answer
    assert client.predict(["128x64"], "tiny-flux2-klein", "cpu", "compiled", "auto", 2,
                          api_name="/warm_up").startswith("Warmed: 128x64 (ready")  # batch sizes are optional


def test_an_invalid_request_gets_the_engine_message(client):
    with pytest.raises(Exception) as raised:
        call_generate(client, resolution="100x64")
    assert "width=100 is not accepted: tiny-flux2-klein needs a multiple of 16 from 64 to 512 — try 96" \
        in str(raised.value)
    with pytest.raises(Exception, match="resolution='big' is not accepted: WIDTHxHEIGHT"):
        call_generate(client, resolution="big")
    with pytest.raises(Exception, match="hardware 'tpu' is not available here: torch_tpu is not installed"):
        call_generate(client, hardware="tpu")
    assert call_generate(client, mode="eager")[2]["width"] == 64  # still serving


def test_tiny_shapes_says_what_it_does_not_know_and_refuses_sizes_it_does_not_draw_right_at(client):
    image_path, text, facts = call_generate(client, model="tiny-shapes", mode="eager", resolution="64x64",
                                            prompt="a yellow square on a purple background, center")
    assert np.asarray(Image.open(image_path)).shape[:2] == (64, 64)
    assert facts["unknown_words"] == ["purple"]
    assert facts["note"].startswith("tiny-shapes does not know: purple — it knows red, green, blue") \
        and facts["note"] in text
    for prompt in ("a red square on a blue background, top left", "Red square, upper-left!", "a square"):
        facts = call_generate(client, model="tiny-shapes", mode="eager", prompt=prompt)[2]
        assert facts["unknown_words"] == [] and facts["note"] == "", prompt
    served = ", ".join(f"{width}x{height}" for width, height in SHAPES_SIZES)
    with pytest.raises(Exception, match=f"resolution='96x64' is not accepted: one of the sizes tiny-shapes draws "
                                        f"correctly: {served}"):
        call_generate(client, model="tiny-shapes", mode="eager", resolution="96x64")


def test_status_endpoint_lists_pipelines_and_shapes(client, server):
    call_generate(client, resolution="64x64")
    code, body = get(server + "/status")  # served once, beside the page: not a second time in the Gradio API
    assert code == 200 and "/status" not in client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    status = json.loads(body)
    compiled = next(p for p in status["pipelines"] if (p["model"], p["mode"]) == ("tiny-flux2-klein", "compiled"))
    shapes = {s["shape"]: s for s in compiled["shapes"] if s["batch"] == 1}
    assert shapes["64x64"]["state"] == "ready" and shapes["64x64"]["graphs"] > 0 and shapes["64x64"]["hits"] >= 1
    assert status["startup"]["shown"].startswith("done: 64x64 ready") and status["startup"]["state"] == "done"
    # The tests' aot_eager backend has no packages: the store is reported, empty.
    assert {k: status["precompiled"][k] for k in ("setting", "packages", "built", "hit_rate")} == \
        {"setting": "auto", "packages": 0, "built": 0, "hit_rate": None}


def test_service_routes(client, server):
    assert get(server + "/health") == (200, '{"ok":true}')
    code, body = get(server + "/ready")
    assert code == 200 and json.loads(body)["ready"] is True
    code, metrics = get(server + "/metrics")
    assert code == 200
    for name in ("acceldemo_requests_total", "acceldemo_phase_seconds_bucket", "acceldemo_compiled_graphs_total",
                 "acceldemo_compile_seconds_total", "acceldemo_shape_cache_hits_total", "acceldemo_queue_depth",
                 "acceldemo_resident_pipelines", 'acceldemo_precompiled_packages{event="loaded"}'):
        assert name in metrics, name


def test_the_latency_chart_has_a_log_axis_and_a_point_per_measurement():
    from acceldemo.ui.page import latency_chart, series_colors

    figure = latency_chart([("64x64", "compiled first call", 80.0), ("64x64", "compiled warm", 0.05),
                            ("128x64", "eager first call", 0.4)])
    (axes,) = figure.axes
    assert axes.get_yscale() == "log"
    assert [t.get_text() for t in axes.get_xticklabels()] == ["64x64", "128x64"]
    drawn = {c.get_label(): [tuple(xy) for xy in c.get_offsets()] for c in axes.collections}
    assert drawn == {"compiled first call": [(0, 80.0)], "compiled warm": [(0, 0.05)], "eager first call": [(1, 0.4)]}
    colours = {c.get_label(): c.get_facecolor()[0] for c in axes.collections}
    import matplotlib.colors

    assert all(matplotlib.colors.to_hex(colours[s]) == series_colors()[s] for s in colours)
