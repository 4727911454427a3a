"""A person in a real browser (Debian chromium via Playwright) watches the picture form: the page's image changes
with the previews before the final image, and a small image fills its frame in sharp blocks."""
import os

import pytest

from tests.test_browser import open_folds

playwright = pytest.importorskip("playwright.sync_api", reason="Playwright is installed by scripts/test.sh")
CHROMIUM = "/usr/bin/chromium"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists(CHROMIUM) and not os.environ.get("CI"),
                                 reason="Debian chromium is installed by scripts/test.sh")]

# Every picture the #image frame shows, in order: its <img> src whenever the frame changes.
WATCH = """() => {
  window.shown = [];
  const note = () => {
    const img = document.querySelector('#image img');
    const src = img && img.getAttribute('src');
    if (src && window.shown[window.shown.length - 1] !== src) window.shown.push(src);
  };
  new MutationObserver(note).observe(document.querySelector('#image'),
                                     {subtree: true, childList: true, attributes: true, attributeFilter: ['src']});
}"""


def test_the_image_forms_in_place_before_the_final_image(server):
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking"])
        page = browser.new_page(viewport={"width": 1400, "height": 1600})
        page.goto(server + "/")
        page.wait_for_selector("#generate")
        open_folds(page)
        page.locator("#steps input").fill("8")
        page.locator("#seed input").fill("7")
        page.evaluate(WATCH)
        page.locator("#generate").click()
        page.locator("#facts").get_by_text("seed 7").wait_for(timeout=120_000)
        page.wait_for_function("() => window.shown.length > 0")
        shown = page.evaluate("window.shown")
        final = page.locator("#image img").get_attribute("src")
        assert shown[-1] == final
        assert len(shown) - 1 >= 2, shown  # at least two previews before the final image
        # 64x64 fills the frame (384 px high), scaled up without smoothing.
        box = page.locator("#image img").bounding_box()
        rendering = page.locator("#image img").evaluate("img => getComputedStyle(img).imageRendering")
        assert box["height"] >= 300 and rendering == "pixelated", (box, rendering)
        assert page.locator("#image img").evaluate("img => [img.naturalWidth, img.naturalHeight]") == [64, 64]
        browser.close()
