"""The first screen a visitor sees, in a real browser (Debian chromium via Playwright) at a desktop window and at a
phone's: the prompt with Generate and the picture without scrolling, Enter draws, Stop in Generate's place while
drawing, display-only picture, true facts, the operator's panels in a tab of their own, nothing wider than a phone."""
import json
import os
import time
import urllib.request
from pathlib import Path

import pytest

from tests.test_browser import choose

playwright = pytest.importorskip("playwright.sync_api", reason="Playwright is installed by scripts/test.sh")
CHROMIUM = "/usr/bin/chromium"
# Screenshots for the docs (docs/first-screen.png and docs/first-screen-phone.png are copies).
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
DESKTOP = {"width": 1400, "height": 900}
PHONE = {"width": 390, "height": 844}

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists(CHROMIUM) and not os.environ.get("CI"),
                                 reason="Debian chromium is installed by scripts/test.sh")]


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking"])
        yield browser
        browser.close()


def open_page(browser, server, viewport: dict):
    page = browser.new_page(viewport=viewport)
    page.goto(server + "/")
    page.wait_for_selector("#generate")
    page.wait_for_selector("#image")
    return page


def box(page, selector: str) -> dict:
    found = page.locator(selector).first.bounding_box()
    assert found is not None, f"{selector} is not shown"
    return found


def in_view(page, selector: str, viewport: dict) -> bool:
    """Wholly inside the window as first shown (nothing scrolled)."""
    b = box(page, selector)
    return b["x"] >= 0 and b["y"] >= 0 and b["x"] + b["width"] <= viewport["width"] + 1 and \
        b["y"] + b["height"] <= viewport["height"] + 1


def requests(server) -> int:
    """Requests the engine has taken, whatever their outcome (the start-up warm-up is not one)."""
    with urllib.request.urlopen(server + "/status", timeout=10) as response:
        return sum(json.load(response)["counters"]["requests"].values())


def requests_reach(server, count: int, timeout_s: float = 10) -> int:
    """The engine's count once it reaches `count` (it counts a request as its result is handed over) or the time
    is up."""
    deadline = time.time() + timeout_s
    while (now := requests(server)) < count and time.time() < deadline:
        time.sleep(0.1)
    return now


def wait_for_facts(page, text: str, timeout_s: float = 120) -> str:
    deadline = time.time() + timeout_s
    while text not in (facts := page.locator("#facts").inner_text()):
        assert time.time() < deadline, f"no facts with {text!r}; shown: {facts!r}"
        time.sleep(0.1)
    return facts


def wider_than_the_window(page) -> list[str]:
    """Every shown element that reaches past the window's right edge, and whether the page scrolls sideways."""
    return page.evaluate("""() => {
        const width = window.innerWidth, wide = [];
        if (document.documentElement.scrollWidth > width) wide.push(`page scrolls to ${document.documentElement.scrollWidth}`);
        for (const el of document.querySelectorAll('body *')) {
            const r = el.getBoundingClientRect();
            if (r.width && r.height && getComputedStyle(el).visibility !== 'hidden' && r.right > width + 1)
                wide.push(`${el.tagName.toLowerCase()}#${el.id}.${el.className} ends at ${Math.round(r.right)}`);
        }
        return wide.slice(0, 10);
    }""")


def test_at_a_desktop_window_prompt_generate_and_picture_are_on_the_first_screen_and_enter_draws(browser, server):
    page = open_page(browser, server, DESKTOP)
    for selector in ("#prompt textarea", "#generate", "#image", "#model", "#hardware", "#mode", "#resolution"):
        assert in_view(page, selector, DESKTOP), selector
    assert not page.locator("#stop").is_visible()
    for text in ("Drop Image Here", "Click to Upload"):
        assert text not in page.locator("#image").inner_text()
    # The visitor's screen holds none of the operator's panels.
    for selector in ("#replicas", "#shapes", "#warmup", "#mode-notes", "#latency"):
        assert not page.locator(selector).is_visible(), selector
    choose(page, "model", "Tiny shapes")
    served = requests(server)
    prompt = page.locator("#prompt textarea")
    prompt.fill("a green circle on a blue background, center")
    prompt.press("Enter")
    page.locator("#stop").wait_for(state="visible", timeout=10_000)  # Stop in Generate's place while drawing
    assert not page.locator("#generate").is_visible()
    facts = wait_for_facts(page, "seed 0")
    page.locator("#generate").wait_for(state="visible", timeout=10_000)
    assert not page.locator("#stop").is_visible()
    assert requests_reach(server, served + 1) == served + 1
    # Eager: the timing line first, and not a word about compiled graphs.
    first_line = facts.splitlines()[0]
    assert first_line.startswith("total ") and "denoise" in first_line and "load" in first_line, facts
    assert "eager" in facts and "graph" not in facts and "compil" not in facts, facts
    assert page.locator("#image img").count() == 1
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "first-screen.png"))
    page.close()


def test_a_compiled_draw_says_whether_it_compiled_or_reused_and_how_many_graphs(browser, server):
    page = open_page(browser, server, DESKTOP)
    page.locator("#mode input").click()
    listbox = page.locator(f"#{page.locator('#mode input').get_attribute('aria-controls')}")
    listbox.locator('[role=option][aria-label="compiled"]').click()
    page.locator("#prompt textarea").press("Enter")
    facts = wait_for_facts(page, "seed 0")
    # 64x64 compiled at start-up (conftest's --warmup compiled:64x64@1,2): reused, and its compile time shown.
    assert "reused a compiled graph" in facts and "compile " in facts.splitlines()[0], facts
    page.close()


def test_the_operator_tab_holds_placement_replicas_shapes_the_line_and_warm_up(browser, server):
    page = open_page(browser, server, DESKTOP)
    page.get_by_role("tab", name="Operator").click()
    for selector in ("#replicas", "#shapes", "#warmup", "#mode-notes", "#placement", "#startup"):
        page.locator(selector).wait_for(state="visible", timeout=10_000)
    assert "64x64" in page.locator("#shapes").inner_text() or page.wait_for_function(
        "() => document.querySelector('#shapes').innerText.includes('64x64')", timeout=10_000)
    assert "Line:" in page.locator("#startup").inner_text()
    assert not page.locator("#generate").is_visible()
    page.get_by_role("tab", name="Generate").click()
    page.locator("#generate").wait_for(state="visible")
    page.close()


def test_an_embedded_example_is_drawn_once_then_answered_from_the_example_cache(browser, server):
    from acceldemo.models.catalog import get_model

    page = open_page(browser, server, DESKTOP)
    # Examples no other test clicks: the app (conftest's `server`) lives for the session, its example cache too.
    first, second = get_model("tiny-shapes").example_prompts[-2:]
    examples = page.locator("#examples-tiny-shapes")
    shown, before = {}, ""
    for text in (first, second):
        drawn = requests(server)
        examples.get_by_text(text, exact=True).click()
        page.wait_for_function("t => { const f = document.querySelector('#facts').innerText;"
                               " return f.includes('tiny-shapes') && f !== t }", arg=before, timeout=120_000)
        shown[text] = before = page.locator("#facts").inner_text()
        assert requests_reach(server, drawn + 1) == drawn + 1  # the first click of each draws it
        assert page.locator("#prompt textarea").input_value() == text
    drawn = requests(server)
    started = time.time()
    examples.get_by_text(first, exact=True).click()
    page.wait_for_function("t => document.querySelector('#facts').innerText === t", arg=shown[first],
                           timeout=10_000)  # the very facts of its first draw, times and all
    assert time.time() - started < 5 and requests_reach(server, drawn + 1, 3) == drawn  # nothing drawn again
    page.close()


def test_at_a_phone_width_prompt_generate_and_picture_stack_in_order_and_nothing_scrolls_sideways(browser, server):
    page = open_page(browser, server, PHONE)
    for selector in ("#prompt textarea", "#generate"):
        assert in_view(page, selector, PHONE), selector
    prompt, generate, image = box(page, "#prompt"), box(page, "#generate"), box(page, "#image")
    # One above the other, or side by side with Generate after the prompt; the picture below both.
    assert generate["y"] >= prompt["y"] + prompt["height"] - 1 or generate["x"] >= prompt["x"] + prompt["width"] - 1
    assert image["y"] >= max(prompt["y"] + prompt["height"], generate["y"] + generate["height"]) - 1
    assert wider_than_the_window(page) == []
    page.locator("#prompt textarea").press("Enter")
    wait_for_facts(page, "seed 0")
    assert wider_than_the_window(page) == []
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "first-screen-phone.png"))
    page.close()
