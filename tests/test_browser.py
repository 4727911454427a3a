"""A person in a real browser (Debian chromium via Playwright): pick, generate, see compile once, then warm."""
import os
import time
from pathlib import Path

import pytest

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
        yield page
        browser.close()


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
    assert image.count() == 1 and image.evaluate("img => img.naturalWidth") == 80
    ARTIFACTS.mkdir(exist_ok=True)
    page.wait_for_timeout(2500)  # let the shapes panel refresh once
    assert "80x80" in page.locator("#shapes").inner_text()
    page.screenshot(path=str(ARTIFACTS / "demo.png"), full_page=True)
