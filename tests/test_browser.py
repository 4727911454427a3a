"""A person in a real browser (Debian chromium via Playwright): pick, generate, see compile once, then warm."""
import json
import os
import time
import urllib.request
from pathlib import Path

import pytest

from acceldemo.ui.page import STOPPED, series_colors

playwright = pytest.importorskip("playwright.sync_api", reason="Playwright is installed by scripts/test.sh")
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists(CHROMIUM) and not os.environ.get("CI"),
                                 reason="Debian chromium is installed by scripts/test.sh")]


@pytest.fixture(scope="module")
def page(server):
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking"])
        page = browser.new_page(viewport={"width": 1400, "height": 1600})
        page.goto(server + "/")
        page.wait_for_selector("#generate")
        open_folds(page)
        yield page
        browser.close()


def open_folds(page) -> None:
    """Opens the first tab's folded inputs: Advanced (steps, seed, step cache, weights) and the edit and style."""
    for fold, inside in (("advanced", "#seed"), ("edit-style", "#lora")):
        if not page.locator(inside).is_visible():
            page.locator(f"#{fold} button").first.click()
        page.locator(inside).wait_for(state="visible", timeout=10_000)


def tab(page, name: str) -> None:
    page.get_by_role("tab", name=name).click()


def choose(page, elem_id: str, label_start: str) -> None:
    """Open a dropdown and pick the option whose label starts with `label_start`."""
    box = page.locator(f"#{elem_id} input")
    box.click()
    listbox = page.locator(f"#{box.get_attribute('aria-controls')}")
    listbox.locator(f'[role=option][aria-label^="{label_start}"]').first.click()
    assert box.input_value().startswith(label_start)


def type_resolution(page, value: str) -> None:
    box = page.locator("#resolution input")
    box.fill(value)
    box.press("Enter")
    page.locator("#prompt textarea").click()  # blur commits the typed value


def generate_and_watch(page, seed: int, timeout_s: float = 120) -> list[str]:
    """Generate with a seed of its own; collect every progress text shown until that seed's facts appear."""
    page.locator("#seed input").fill(str(seed))
    page.locator("#generate").click()
    seen, deadline = [], time.time() + timeout_s
    while time.time() < deadline:
        seen.append(page.locator("#image").inner_text() + " | " + page.locator("#facts").inner_text())
        if f"seed {seed}" in seen[-1]:
            return seen
        time.sleep(0.05)
    raise AssertionError(f"no result within {timeout_s} s; saw {seen[-5:]}")


def shown_size(page, expected: tuple[int, int], timeout_ms: int = 15_000) -> list[int]:
    """The result image's natural size once the browser has loaded it (the facts can arrive first)."""
    script = "([w, h]) => { const i = document.querySelector('#image img');" \
             " return !!i && i.complete && i.naturalWidth === w && i.naturalHeight === h }"
    try:
        page.wait_for_function(script, arg=list(expected), timeout=timeout_ms)
    except playwright.TimeoutError:
        pass  # the assertion below names the size the browser did load
    return page.locator("#image img").evaluate("img => [img.naturalWidth, img.naturalHeight]")


def test_the_result_box_is_display_only_before_and_after_a_draw(page):
    def upload_area() -> list:
        box = page.locator("#image")
        return [text for text in ("Drop Image Here", "Click to Upload") if text in box.inner_text()] + \
            (["file input"] if box.locator("input[type=file]").count() else [])

    assert upload_area() == []
    generate_and_watch(page, seed=5)
    assert page.locator("#image img").count() == 1 and upload_area() == []


def test_compile_progress_shows_on_the_first_visit_only(page):
    choose(page, "hardware", "cpu — found")
    choose(page, "mode", "compiled")
    type_resolution(page, "80x80")
    first = generate_and_watch(page, seed=11)
    assert any("compiling 80x80 (first time for this shape)" in text for text in first), first[-5:]
    assert "80x80" in first[-1] and "graph(s) compiled" in first[-1]
    second = generate_and_watch(page, seed=12)
    assert not any("compiling" in text for text in second)
    assert "reused a compiled graph" in second[-1]
    image = page.locator("#image img")
    assert image.count() == 1 and shown_size(page, (80, 80)) == [80, 80]
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "demo.png"), full_page=True)
    tab(page, "Operator")
    page.wait_for_function("() => document.querySelector('#shapes')?.innerText.includes('80x80')", timeout=10_000)
    tab(page, "Generate")


def chart_image(page):
    """The latency chart as the browser shows it (a PNG the server drew), decoded."""
    import base64
    import io

    from PIL import Image

    source = page.locator("#latency img").get_attribute("src") or ""
    return Image.open(io.BytesIO(base64.b64decode(source.split(",", 1)[1]))).convert("RGB") if "," in source \
        else None


def pixels_of(image, colour: str) -> int:
    import numpy as np

    wanted = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(np.asarray(image, dtype=int) - wanted).sum(axis=2) < 30).sum())


def test_latency_chart_draws_a_new_point_in_its_series_colour(page):
    choose(page, "mode", "eager")
    type_resolution(page, "96x96")
    tab(page, "Operator")
    page.locator("#latency").wait_for(state="visible")
    before = chart_image(page)
    colour = series_colors()["eager first call"]
    tab(page, "Generate")
    generate_and_watch(page, seed=21)
    tab(page, "Operator")
    had = pixels_of(before, colour) if before is not None else 0
    deadline = time.time() + 15  # the chart refreshes every 2 s
    while (after := chart_image(page)) is None or pixels_of(after, colour) <= had:
        assert time.time() < deadline, "the chart was not drawn again with the new point"
        page.wait_for_timeout(250)
    tab(page, "Generate")


def status(server) -> dict:
    with urllib.request.urlopen(server + "/status", timeout=10) as response:
        return json.load(response)


def cancelled_jobs(server) -> int:
    return status(server)["counters"]["requests"]["cancelled"]


def test_stop_ends_the_running_job_and_the_next_generate_runs(page, server):
    before = cancelled_jobs(server)
    choose(page, "mode", "eager")
    type_resolution(page, "512x512")
    page.locator("#steps input").fill("100")  # seconds of denoising on the tiny model: time to press Stop
    page.locator("#generate").click()
    page.locator("#stop").wait_for(state="visible", timeout=10_000)  # Stop in Generate's place while drawing
    # Drawing: the engine runs it (the page's progress text may already have given way to the first preview).
    deadline = time.time() + 120
    while not any(device["running"] for device in status(server)["devices"]):
        assert time.time() < deadline, "the job did not start"
        time.sleep(0.25)
    page.wait_for_timeout(1000)  # a few denoise steps in
    page.locator("#stop").click()
    page.locator("#facts").get_by_text(STOPPED.replace("**", "")).wait_for(timeout=10_000)
    page.locator("#generate").wait_for(state="visible", timeout=10_000)
    deadline = time.time() + 30
    while cancelled_jobs(server) == before:  # the engine ended the job at a step, not only the page
        assert time.time() < deadline, "the job was not stopped in the engine"
        time.sleep(0.25)
    type_resolution(page, "64x64")
    page.locator("#steps input").fill("4")
    result = generate_and_watch(page, seed=22)
    assert "64x64" in result[-1] and "steps 4" in result[-1]
    assert shown_size(page, (64, 64)) == [64, 64]
    with urllib.request.urlopen(server + "/metrics", timeout=10) as response:
        assert 'acceldemo_requests_total{kind="generate",outcome="cancelled"}' in response.read().decode()
    # Nothing running: Generate is back in Stop's place.
    page.locator("#generate").wait_for(state="visible", timeout=10_000)
    assert not page.locator("#stop").is_visible()


def test_a_bad_size_typed_in_the_page_is_the_engines_message_and_the_page_serves_on(page):
    choose(page, "mode", "eager")
    type_resolution(page, "100x64")
    page.locator("#generate").click()
    # The same words as the CLI's and the API's (tests/test_cli.py, tests/test_server.py), in Gradio's toast.
    page.get_by_text("width=100 is not accepted: tiny-flux2-klein needs a multiple of 16 from 64 to 512 — try 96") \
        .first.wait_for(timeout=30_000)
    assert "Traceback" not in page.content()
    type_resolution(page, "64x64")
    result = generate_and_watch(page, seed=31)
    assert "64x64" in result[-1]


def test_an_example_picks_tiny_shapes_at_its_size_and_an_unknown_word_is_named(page):
    from acceldemo.models.catalog import get_model

    spec = get_model("tiny-shapes")
    page.locator("#examples-tiny-shapes").get_by_text(spec.example_prompts[1], exact=True).click()
    page.wait_for_function("t => document.querySelector('#prompt textarea').value === t", arg=spec.example_prompts[1])
    assert page.locator("#model input").input_value() == spec.title
    box = page.locator("#resolution input")
    page.wait_for_function("() => document.querySelector('#resolution input').value === '64x64'")
    box.click()
    options = page.locator(f"#{box.get_attribute('aria-controls')} [role=option]")
    assert [option.get_attribute("aria-label") for option in options.all()] == [str(s) for s in spec.presets]
    options.first.click()
    choose(page, "mode", "eager")
    page.locator("#prompt textarea").fill("a yellow square on a purple background, center")
    result = generate_and_watch(page, seed=41)
    assert "64x64" in result[-1] and "tiny-shapes does not know: purple — it knows red" in result[-1]
    assert shown_size(page, (64, 64)) == [64, 64]


def test_compare_shows_both_pictures_their_times_and_how_far_apart_they_are(page):
    tab(page, "Compare")
    page.locator("#compare").wait_for(state="visible")
    choose(page, "compare-a-mode", "eager")
    choose(page, "compare-b-mode", "compiled")
    choose(page, "compare-b-step-cache", "taylorseer")
    for side in ("a", "b"):
        page.locator(f"#compare-{side}-steps input").fill("12")
    page.locator("#compare").click()
    facts = page.locator("#compare-facts")
    facts.get_by_text("B's speed ÷ A's").wait_for(timeout=180_000)
    text = facts.inner_text()
    assert "cpu · eager · device · no step cache" in text and "cpu · compiled · device · taylorseer" in text
    assert "12 (7 from taylorseer)" in text and "PSNR" in text and "denoise s" in text
    script = "id => { const i = document.querySelector(`#${id} img`); return !!i && i.complete && i.naturalWidth > 0 }"
    for side in ("a", "b"):
        page.wait_for_function(script, arg=f"compare-{side}-image", timeout=15_000)
    page.locator("#compare-section").screenshot(path=str(ARTIFACTS / "compare.png"))
    tab(page, "Generate")


def test_the_placement_panel_says_what_a_model_would_get_on_another_host(page):
    choose(page, "model", "FLUX.2 [dev]")
    tab(page, "Operator")
    choose(page, "other-host", "trn2.48xlarge")
    plan = page.locator("#other-host-plan")
    plan.get_by_text("flux2-dev on trn2.48xlarge (64 x 25.8 GB neuron)").wait_for(timeout=15_000)
    assert "tensor parallel over 8 holds 14.1 GB per device" in plan.inner_text()
    choose(page, "other-host", "v6e-1")
    page.wait_for_function("() => document.querySelector('#other-host-plan').innerText.includes('v6e-1')")
    assert "a pool across hosts" in plan.inner_text()
    tab(page, "Generate")
    choose(page, "model", "Tiny shapes")
