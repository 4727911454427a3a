"""Client keys and the operator key (ACCELDEMO_API_KEYS, ACCELDEMO_ADMIN_KEY, and ACCELDEMO_API_TOKEN as before):
the key file's refusals, then the real server through the official clients — /v1 with the openai SDK, the Gradio API
with gradio_client, /status and /metrics over HTTP."""
import hashlib
import logging
import os
import subprocess
import sys

import httpx
import openai
import pytest
from gradio_client import Client

from acceldemo.ui.keys import ADMIN_KEY_MIN_CHARS, KeyFileError, Keys, Refused, parse_key_file
from acceldemo.ui.page import NOT_THE_OPERATOR_KEY
from acceldemo.ui.server import create_app
from tests.engines import serving

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALICE, BOB, OPERATOR = "alice-key-4f1d9a0c2e", "bob-key-77aa01c3d9", "operator-key-0123456789abcdef"


def line(name: str, key: str) -> str:
    return f"{name} {hashlib.sha256(key.encode()).hexdigest()}\n"


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("# client keys\n" + line("alice", ALICE) + "\n" + line("bob", BOB))
    return path


# --- the key file and the key settings: each refusal names where and what ------------------------------------------

@pytest.mark.parametrize(("text", "said"), [
    ("alice\n", ":1: a line is a client name and its key's sha256 (2 fields), not 1"),
    ("alice abc def\n", ":1: a line is a client name and its key's sha256 (2 fields), not 3"),
    (f"alice {ALICE}\n", ":1: the second field must be the key's sha256 (64 hex digits), never the key itself"),
    ("al ice" + line("x", ALICE)[1:], "(2 fields), not 3"),
    ("-alice " + "0" * 64 + "\n", ":1: a client name is 1-64 letters"),
    ("a" * 65 + " " + "0" * 64 + "\n", ":1: a client name is 1-64 letters"),
    ("# only a comment\n\n", "no client keys in it"),
    ("", "no client keys in it"),
    (line("alice", ALICE) + line("alice", BOB), ":2: client 'alice' is named twice"),
    ("alice " + "g" * 64 + "\n", ":1: the second field must be the key's sha256"),
    ("alice " + "0" * 63 + "\n", ":1: the second field must be the key's sha256"),
])
def test_a_key_file_that_is_not_one_is_refused_by_line(text, said):
    with pytest.raises(KeyFileError) as refused:
        parse_key_file(text, "ACCELDEMO_API_KEYS keys.txt")
    assert said in str(refused.value) and str(refused.value).startswith("ACCELDEMO_API_KEYS keys.txt")
    assert ALICE not in str(refused.value)  # a key pasted by mistake is not echoed back


def test_key_settings_that_cannot_be_used_are_refused(tmp_path):
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00alice")
    cases = [
        ({"api_keys": str(tmp_path / "missing.txt")}, "cannot be read"),
        ({"api_keys": str(tmp_path)}, "cannot be read"),
        ({"api_keys": str(binary)}, "not UTF-8 text"),
        ({"admin_key": "short"}, f"at least {ADMIN_KEY_MIN_CHARS} characters"),
        ({"admin_key": "a key with spaces in it"}, "without spaces"),
        ({"admin_key": OPERATOR, "admin_key_file": str(binary)}, "not both"),
        ({"admin_key_file": str(tmp_path / "missing")}, "ACCELDEMO_ADMIN_KEY_FILE"),
    ]
    empty = tmp_path / "empty"
    empty.write_text("\n")
    cases.append(({"admin_key_file": str(empty)}, "empty"))
    named_token = tmp_path / "token.txt"
    named_token.write_text(line("token", ALICE))
    cases.append(({"api_keys": str(named_token), "api_token": "s3cret"}, "rename it"))
    for settings, said in cases:
        with pytest.raises(KeyFileError, match=said):
            Keys.from_settings(**settings)


def test_headers_that_are_not_a_bearer_key_are_401(key_file):
    keys = Keys.from_settings(str(key_file), OPERATOR)
    for header in ("Basic YWxpY2U6cHc=", "Bearer", "Bearer    ", ALICE, f"Bearer {ALICE}x", "Bearer " + "k" * 100_000,
                   "Bearer alice", "Token " + ALICE):
        with pytest.raises(Refused) as refused:
            keys.client_door(header)
        assert refused.value.status == 401 and ALICE not in refused.value.message
    assert keys.client_door(f"bearer {ALICE}").client == "alice"  # the scheme's case does not matter
    with pytest.raises(Refused) as refused:
        keys.operator_door(f"Bearer {BOB}")
    assert refused.value.status == 403 and "client 'bob'" in refused.value.message
    assert keys.operator_door(f"Bearer {OPERATOR}").operator


def test_a_line_deleted_revokes_that_key_and_a_broken_edit_keeps_the_keys(key_file, caplog):
    keys = Keys.from_settings(str(key_file))
    assert keys.client_door(f"Bearer {BOB}").client == "bob"
    key_file.write_text(line("alice", ALICE))
    with pytest.raises(Refused, match="unknown or revoked"):
        keys.client_door(f"Bearer {BOB}")
    with caplog.at_level(logging.ERROR, logger="acceldemo.keys"):
        key_file.write_text(f"alice {ALICE}\n")  # the key itself pasted in: refused, and the keys read last stay
        assert keys.client_door(f"Bearer {ALICE}").client == "alice"
    assert "keeping the 1 client key(s) read before" in caplog.text and ALICE not in caplog.text


def test_without_any_key_setting_every_door_is_open_as_before():
    keys = Keys.from_settings()
    assert not keys.required and keys.client_door(None).operator and keys.operator_door("Bearer anything").operator


# --- through the real server ------------------------------------------------------------------------------------

def generate_args(**kw):
    args = dict(prompt="a red circle", model="tiny-shapes", hardware="cpu", mode="eager", placement="auto",
                tp_size=None, resolution="64x64", steps=2, guidance=1.0, seed=0)
    args.update(kw)
    return list(args.values())


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """A real server with client keys alice and bob, and an operator key."""
    from tests.engines import new_manager

    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(line("alice", ALICE) + line("bob", BOB))
    engine = new_manager(default_model="tiny-shapes")
    with serving(create_app(engine, keys=Keys.from_settings(str(key_file), OPERATOR))) as url:
        yield url, key_file, engine
    engine.close()


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.slow
def test_v1_needs_a_client_key_and_status_the_operator_key(keyed, caplog):
    url, key_file, _ = keyed
    with caplog.at_level(logging.DEBUG):
        for headers in ({}, bearer("wrong"), {"Authorization": ALICE}):
            answer = httpx.post(url + "/v1/images/generations", json={"prompt": "x"}, headers=headers)
            assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key", headers
        image = openai.OpenAI(base_url=url + "/v1", api_key=ALICE).images.generate(prompt="a red circle",
                                                                                   size="64x64")
        assert image.data[0].b64_json
        refused = httpx.get(url + "/status", headers=bearer(ALICE))
        assert refused.status_code == 403 and "operator action" in refused.json()["detail"]
        assert httpx.get(url + "/metrics", headers=bearer(BOB)).status_code == 403
        assert httpx.get(url + "/status", headers=bearer(OPERATOR)).status_code == 200
        metrics = httpx.get(url + "/metrics", headers=bearer(OPERATOR)).text
    assert 'acceldemo_client_requests_total{client="alice",door="v1",outcome="admitted"} 1.0' in metrics
    assert 'acceldemo_client_requests_total{client="unauthenticated",door="v1",outcome="refused"} 3.0' in metrics
    assert 'acceldemo_client_requests_total{client="alice",door="status",outcome="refused"}' in metrics
    for key in (ALICE, BOB, OPERATOR, hashlib.sha256(ALICE.encode()).hexdigest()):
        assert key not in metrics and key not in caplog.text


@pytest.mark.slow
def test_a_revoked_key_is_refused_without_a_restart(keyed):
    url, key_file, _ = keyed
    sdk = openai.OpenAI(base_url=url + "/v1", api_key=BOB, max_retries=0)
    assert sdk.models.list().data
    saved = key_file.read_text()
    key_file.write_text(line("alice", ALICE))
    try:
        with pytest.raises(openai.AuthenticationError, match="unknown or revoked"):
            sdk.models.list()
        assert httpx.get(url + "/v1/models", headers=bearer(ALICE)).status_code == 200
    finally:
        key_file.write_text(saved)


@pytest.mark.slow
def test_the_gradio_api_takes_a_client_key_but_warm_up_needs_the_operators(keyed):
    url, _, engine = keyed
    alice = Client(url + "/", verbose=False, headers=bearer(ALICE))
    image, _, facts = alice.predict(*generate_args(), api_name="/generate")
    assert facts["model"] == "tiny-shapes" and os.path.getsize(image) > 0
    with pytest.raises(Exception, match="operator's action"):
        alice.predict(["128x64"], "tiny-shapes", "cpu", "eager", "auto", None, ["1"], api_name="/warm_up")
    operator = Client(url + "/", verbose=False, headers=bearer(OPERATOR))
    warmed = operator.predict(["128x64"], "tiny-shapes", "cpu", "eager", "auto", None, ["1"], api_name="/warm_up")
    assert warmed.startswith("Warmed: 128x64")
    assert httpx.get(url + "/config", headers=bearer("wrong")).status_code == 401  # a wrong key is never a visitor
    assert httpx.get(url + "/config").status_code == 200  # the page stays open to visitors
    assert httpx.get(url + "/config", headers={"Authorization": "Basic YWxpY2U6cHc="}).status_code == 200  # a proxy's
    metrics = httpx.get(url + "/metrics", headers=bearer(OPERATOR)).text
    assert 'client="alice",door="gradio",outcome="admitted"' in metrics
    assert 'client="unauthenticated",door="gradio",outcome="refused"' in metrics


@pytest.mark.slow
def test_the_api_token_alone_keeps_its_doors_and_guards_warm_up(fresh_manager):
    with serving(create_app(fresh_manager(default_model="tiny-shapes"),
                            keys=Keys.from_settings(api_token="s3cret-token"))) as url:
        assert httpx.get(url + "/status").status_code == 401
        assert httpx.get(url + "/status", headers=bearer("s3cret-token")).status_code == 200
        assert httpx.get(url + "/v1/models", headers=bearer("s3cret-token")).status_code == 200
        visitor = Client(url + "/", verbose=False)
        assert visitor.predict(*generate_args(), api_name="/generate")[2]["model"] == "tiny-shapes"
        with pytest.raises(Exception, match="operator's action"):
            visitor.predict(["64x64"], "tiny-shapes", "cpu", "eager", "auto", None, ["1"], api_name="/warm_up")


@pytest.mark.heavy  # an app.py process of its own: outside --fast, in the full run
def test_a_bad_key_file_stops_app_py_with_one_error_line(tmp_path):
    bad = tmp_path / "keys.txt"
    bad.write_text(f"alice {ALICE}\n")
    done = subprocess.run([sys.executable, "app.py"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "ACCELDEMO_API_KEYS": str(bad), "PORT": "1"})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: ACCELDEMO_API_KEYS {bad}:1: the second field")
    assert ALICE not in done.stderr


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/usr/bin/chromium") and not os.environ.get("CI"),
                    reason="Debian chromium is installed by scripts/test.sh")
def test_the_operator_tab_shows_warm_up_and_the_panels_only_after_the_operator_key(keyed):
    from playwright.sync_api import sync_playwright

    url = keyed[0]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1200})
            page.goto(url + "/")
            page.wait_for_selector("#generate")
            page.get_by_role("tab", name="Operator").click()
            page.locator("#operator-key input").wait_for(state="visible", timeout=10_000)
            assert not page.locator("#warmup").is_visible() and not page.locator("#shapes").is_visible()
            page.locator("#operator-key input").fill(ALICE)  # a client key is not the operator's
            page.locator("#unlock").click()
            page.get_by_text(NOT_THE_OPERATOR_KEY).first.wait_for(timeout=10_000)
            assert not page.locator("#warmup").is_visible()
            page.locator("#operator-key input").fill(OPERATOR)
            page.locator("#unlock").click()
            page.locator("#warmup").wait_for(state="visible", timeout=10_000)
            page.locator("#shapes").wait_for(state="visible", timeout=10_000)
            assert not page.locator("#operator-key input").is_visible()
        finally:
            browser.close()
