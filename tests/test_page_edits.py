"""The page's edits and LoRA styles through the served app and the official gradio_client: a picture changed by
its prompt, a file that is not a picture refused in the engine's words, a style that changes the image and none that
gives the plain one back."""
import json
import os
import urllib.request

import numpy as np
import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError
from PIL import Image

from acceldemo.models.catalog import get_model
from acceldemo.models.shapes import trained_model_dir
from acceldemo.ui.server import create_app
from tests.engines import new_manager, serving, settings_with
from tests.test_server import call_generate
from training.shapes.dataset import Scene, render
from training.shapes.judge import judge

pytestmark = pytest.mark.slow

STYLE = "test-style"
GREEN_CIRCLE = "a green circle on a blue background, top left"


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    """ACCELDEMO_LORA_DIR holding one style for tiny-shapes: random rank-4 weights on the double-stream blocks'
    attention, in diffusers' own key format."""
    import diffusers
    import torch
    from safetensors.torch import save_file

    transformer = diffusers.Flux2Transformer2DModel.from_pretrained(trained_model_dir(), subfolder="transformer")
    generator = torch.Generator().manual_seed(0)
    state = {}
    for name, layer in transformer.named_modules():
        if name.startswith("transformer_blocks.") and name.endswith(("attn.to_q", "attn.to_v", "attn.to_out.0")):
            state[f"transformer.{name}.lora_A.weight"] = torch.randn(4, layer.in_features, generator=generator) * 0.3
            state[f"transformer.{name}.lora_B.weight"] = torch.randn(layer.out_features, 4, generator=generator) * 0.3
    root = tmp_path_factory.mktemp("loras")
    (root / "tiny-shapes").mkdir()
    save_file(state, str(root / "tiny-shapes" / f"{STYLE}.safetensors"))
    return root


@pytest.fixture(scope="module")
def url(lora_dir):
    """The app over an engine whose first model is tiny-shapes, with the test style, served in this process."""
    engine = new_manager(settings_with(lora_dir=lora_dir, default_model="tiny-shapes"))
    try:
        with serving(create_app(engine)) as base:
            yield base
    finally:
        engine.close()


@pytest.fixture(scope="module")
def client(url):
    client = Client(url + "/", verbose=False)
    yield client
    client.close()  # its heartbeat stream would hold the server's shutdown for half a minute


def shapes(client, prompt, seed=0, picture=None, strength=0.8, lora="none", lora_scale=1.0):
    """tiny-shapes at 64x64, eager: the image's pixels, the page's text and the facts."""
    path, text, facts = call_generate(client, model="tiny-shapes", mode="eager", prompt=prompt, seed=seed,
                                      picture=picture, strength=strength, lora=lora, lora_scale=lora_scale)
    return np.asarray(Image.open(path).convert("RGB")).astype(int), text, facts


def test_an_edit_turns_the_red_circle_green_where_it_was(client, tmp_path):
    red = tmp_path / "red-circle.png"
    render(Scene("circle", "red", "blue", "top left"), 64, 64).save(red)
    pixels, text, facts = shapes(client, GREEN_CIRCLE, seed=1, picture=handle_file(str(red)), strength=0.7)
    seen = judge(Image.fromarray(pixels.astype(np.uint8)))
    assert (seen.shape, seen.colour, seen.position, seen.background) == ("circle", "green", "top left", "blue"), seen
    assert facts["edit"] == {"method": "strength", "strength": 0.7, "images": 1, "mask": False,
                             "source": "PNG 64x64"}
    assert "edit: image-to-image at strength **0.7** · from PNG 64x64" in text


def test_a_file_that_is_not_a_picture_gets_the_engines_message(client, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("a red circle, drawn in words")
    with pytest.raises(AppError, match="image='a file that is not a picture' is not accepted: a PNG, JPEG or WebP"):
        shapes(client, GREEN_CIRCLE, picture=handle_file(str(notes)))
    assert shapes(client, GREEN_CIRCLE)[2]["edit"] is None  # still serving


def test_a_style_changes_the_image_and_none_gives_the_plain_one_back(client, url):
    with urllib.request.urlopen(url + "/config", timeout=10) as answer:
        config = json.load(answer)
    (dropdown,) = [c["props"] for c in config["components"] if c["props"].get("elem_id") == "lora"]
    assert [value for _, value in dropdown["choices"]] == ["none", "outline", STYLE] and dropdown["value"] == "none"

    prompt = "a red square on a green background, bottom right"
    plain, text, facts = shapes(client, prompt, seed=3)
    styled, styled_text, styled_facts = shapes(client, prompt, seed=3, lora=STYLE, lora_scale=1.0)
    again = shapes(client, prompt, seed=3, lora="none")[0]
    assert np.abs(styled - plain).mean() > 2.0
    assert np.abs(again - plain).max() <= 1
    assert (facts["lora"], facts["lora_scale"]) == (None, None) and "style" not in text
    assert (styled_facts["lora"], styled_facts["lora_scale"]) == (STYLE, 1.0)
    assert f"style **{STYLE}** at strength 1" in styled_text


def test_in_the_browser_each_model_offers_its_styles_and_edit_this_starts_an_edit(url):
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is installed by scripts/test.sh")
    from tests.test_browser import CHROMIUM, choose, open_folds

    if not os.path.exists(CHROMIUM) and not os.environ.get("CI"):
        pytest.skip("Debian chromium is installed by scripts/test.sh")

    def styles() -> list[str]:
        box = page.locator("#lora input")
        box.click()
        options = page.locator(f"#{box.get_attribute('aria-controls')} [role=option]")
        options.first.wait_for()
        shown = [options.nth(i).get_attribute("aria-label") for i in range(options.count())]
        box.press("Escape")
        return shown

    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1600})
            page.goto(url + "/")
            page.wait_for_selector("#generate")
            open_folds(page)
            assert styles() == ["none", "outline", STYLE]
            choose(page, "model", get_model("tiny-flux2-klein").title)
            page.locator("#strength").get_by_text("not used").wait_for()
            assert styles() == ["none"]
            choose(page, "model", get_model("tiny-shapes").title)
            page.locator("#strength").get_by_text("how much of the picture is redrawn").wait_for()
            assert styles() == ["none", "outline", STYLE]
            choose(page, "mode", "eager")

            page.locator("#generate").click()  # the page's own prompt: a red circle on blue, top left, seed 0
            page.locator("#facts").get_by_text("seed 0").wait_for(timeout=60_000)
            assert page.locator("#picture img").count() == 0
            page.locator("#edit-this").click()
            page.wait_for_function("() => document.querySelector('#picture img')?.naturalWidth === 64")
            choose(page, "lora", STYLE)
            page.locator("#generate").click()
            page.locator("#facts").get_by_text(f"style {STYLE} at strength 1").wait_for(timeout=60_000)
            assert "edit: image-to-image at strength 0.8 · from PNG 64x64" in page.locator("#facts").inner_text()
        finally:
            browser.close()
