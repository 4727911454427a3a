"""Fetching a real catalog model when the operator allows it, from a Hub on loopback (tests/fake_hub.py) through
huggingface_hub itself: the files the pipeline needs with progress in bytes, a transfer cut short resumed, gated
repositories refused with what to do, a missing one named, the disk checked first, and a Space-style start that
fetches and serves. The hub serves the embedded tiny models' files under the real repositories' names."""
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from acceldemo.config import Settings
from acceldemo.errors import ModelUnavailable
from acceldemo.models.catalog import get_model
from acceldemo.models.tiny import ensure_tiny_model
from tests.engines import free_port, wait_until_answers
from tests.fake_hub import Hub, Repo, serve

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SCHNELL = "black-forest-labs/FLUX.1-schnell"
KLEIN = "black-forest-labs/FLUX.2-klein-4B"
# A file of a component folder the pipeline never reads, larger than huggingface_hub's 10 MiB write chunk: a transfer
# cut after 15 MiB has written one chunk, which a resume starts after.
BIG_FILE = "vae/notes.json"
CHUNK = 10 * 1024 * 1024


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    import shutil

    models = tmp_path_factory.mktemp("tiny-models")
    schnell = models / "schnell-repo"
    shutil.copytree(ensure_tiny_model("flux1", models), schnell)
    (schnell / BIG_FILE).write_text(json.dumps({"notes": "x" * (24 * 1024 * 1024)}))
    hub = Hub({SCHNELL: Repo(schnell),
               KLEIN: Repo(ensure_tiny_model("flux2-klein", models), gated=True, tokens=frozenset({"hf_good"}))})
    server = serve(hub)
    yield hub
    server.shutdown()


def run(hub: Hub, home: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The CLI as an operator runs it on a connected host: HF_HOME its own, HF_ENDPOINT the loopback hub."""
    environment = {key: value for key, value in os.environ.items() if key not in ("HF_HUB_OFFLINE", "HF_TOKEN")}
    # The real models' bf16 weights exceed this host's memory as the probe reads it: 64 GB keeps the tiny stand-ins
    # on one device (the placement is not what these tests are about).
    environment.update(HF_HOME=str(home), HF_ENDPOINT=hub.url, HF_HUB_DISABLE_TELEMETRY="1",
                       ACCELDEMO_CPU_COMPILE_BACKEND="aot_eager", ACCELDEMO_CPU_MEMORY_GB="64", **env)
    return subprocess.run([sys.executable, "-m", "acceldemo", *args], cwd=ROOT, env=environment, text=True,
                          capture_output=True, timeout=600, stdin=subprocess.DEVNULL)


def generate(hub: Hub, home: Path, out: Path, model: str = "flux1-schnell", **env: str):
    return run(hub, home, "generate", "--model", model, "--prompt", "a red circle", "--size", "256x256", "--steps",
               "2", "--seed", "1", "--out", str(out), "--json", "--download", **env)


def cached_files(home: Path, repo: str) -> set[str]:
    snapshots = home / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots"
    return {str(p.relative_to(next(snapshots.iterdir()))) for p in snapshots.rglob("*") if p.is_file()}


def test_a_model_is_fetched_with_progress_in_bytes_then_drawn(hub, tmp_path):
    done = generate(hub, tmp_path / "hf", tmp_path / "out")
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(done.stdout.splitlines()[-1])
    assert facts["model"] == "flux1-schnell" and Path(facts["path"]).is_file()
    assert f"downloading {SCHNELL}: " in done.stderr and " GB (" in done.stderr
    served = {str(p.relative_to(hub.repos[SCHNELL].folder)) for p in hub.repos[SCHNELL].folder.rglob("*")
              if p.is_file()}
    assert cached_files(tmp_path / "hf", SCHNELL) == served  # every file the pipeline loads, nothing else
    again = generate(hub, tmp_path / "hf", tmp_path / "out")  # found in the cache: nothing fetched
    assert again.returncode == 0 and "downloading" not in again.stderr


def test_a_transfer_cut_short_is_resumed(hub, tmp_path):
    hub.seen.clear()
    hub.cut_once[BIG_FILE] = CHUNK + CHUNK // 2
    done = generate(hub, tmp_path / "hf", tmp_path / "out")
    assert done.returncode == 0, done.stderr[-3000:]
    assert any(path.endswith(BIG_FILE) and ranged == f"bytes={CHUNK}-" for _, path, ranged in hub.seen), hub.seen
    cached = next((tmp_path / "hf" / "hub").rglob(BIG_FILE))
    assert cached.read_bytes() == (hub.repos[SCHNELL].folder / BIG_FILE).read_bytes()


def test_a_download_killed_midway_fetches_only_what_it_had_not(hub, tmp_path):
    """huggingface_hub 2.4 resumes a cut transfer within its call (above), but keeps no part-file across processes
    (each transfer writes a file of its own, removed on failure: huggingface_hub PR #4228); a killed fetch leaves the
    finished files, which the next one skips, and an orphaned part-file, which the next one removes."""
    home = tmp_path / "hf"
    hub.released.clear()
    hub.stall_once[BIG_FILE] = CHUNK + CHUNK // 2
    environment = {key: value for key, value in os.environ.items() if key not in ("HF_HUB_OFFLINE", "HF_TOKEN")}
    environment.update(HF_HOME=str(home), HF_ENDPOINT=hub.url, ACCELDEMO_CPU_MEMORY_GB="64")
    first = subprocess.Popen([sys.executable, "-m", "acceldemo", "generate", "--model", "flux1-schnell", "--prompt",
                              "x", "--size", "256x256", "--download", "--out", str(tmp_path / "out")], cwd=ROOT,
                             env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not any(p.stat().st_size >= CHUNK for p in home.rglob("*.incomplete")):
            assert first.poll() is None and time.time() < deadline, "the transfer never wrote its first chunk"
            time.sleep(0.2)
    finally:
        first.kill()  # as a host losing power would
        first.wait(30)
        hub.released.set()
    finished = {p.name for p in (home / "hub").rglob("blobs/*") if not p.name.endswith(".incomplete")}
    assert len(finished) >= 10  # the other files of the model were done before the stall
    for orphan in home.rglob("*.incomplete"):  # the next fetch comes minutes later
        os.utime(orphan, (time.time() - 600, time.time() - 600))
    hub.seen.clear()
    resumed = generate(hub, home, tmp_path / "out")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    fetched = [path for method, path, _ in hub.seen if method == "GET" and "/resolve/" in path]
    assert [path.rsplit("/", 2)[-2:] for path in fetched] == [["vae", "notes.json"]]
    assert not list(home.rglob("*.incomplete"))  # the orphan is gone
    cached = next((home / "hub").rglob(BIG_FILE))
    assert cached.read_bytes() == (hub.repos[SCHNELL].folder / BIG_FILE).read_bytes()


@pytest.mark.parametrize("token, says", [
    (None, f"is gated: accept its terms at {{url}}/{KLEIN} with a Hugging Face account and set HF_TOKEN"),
    ("hf_other", f"is gated and the token in HF_TOKEN has no access to it: accept its terms at {{url}}/{KLEIN}"),
])
def test_a_gated_repository_without_access_is_refused_naming_its_page(hub, tmp_path, token, says):
    done = generate(hub, tmp_path / "hf", tmp_path / "out", "flux2-klein-4b", **({"HF_TOKEN": token} if token else {}))
    assert done.returncode == 2 and says.format(url=hub.url) in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "hf" / "hub" / f"models--{KLEIN.replace('/', '--')}" / "blobs").exists()


def test_a_gated_repository_is_fetched_with_a_token_that_has_access(hub, tmp_path):
    done = generate(hub, tmp_path / "hf", tmp_path / "out", "flux2-klein-4b", HF_TOKEN="hf_good")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "transformer/config.json" in cached_files(tmp_path / "hf", KLEIN)


def test_a_missing_repository_is_named(hub, tmp_path):
    done = generate(hub, tmp_path / "hf", tmp_path / "out", "sd3.5-medium")
    assert done.returncode == 2
    assert f"there is no repository stabilityai/stable-diffusion-3.5-medium at {hub.url}" in done.stderr


def test_the_disk_is_checked_before_any_byte_is_fetched(monkeypatch, tmp_path):
    import huggingface_hub
    from huggingface_hub.file_download import DryRunFileInfo

    from acceldemo.models import download

    calls = []

    def snapshot(repo, **kwargs):
        calls.append(kwargs)
        return [DryRunFileInfo(commit_hash="0" * 40, file_size=10**15, filename="transformer/big.safetensors",
                               local_path=str(tmp_path / "x"), is_cached=False, will_download=True)]

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    monkeypatch.setattr(download, "needed_files", lambda spec: ["model_index.json", "transformer/*"])
    downloads = download.Downloads(Settings.from_env({"ACCELDEMO_DOWNLOAD": "1",
                                                      "ACCELDEMO_CACHE_DIR": str(tmp_path / "cache")}))
    with pytest.raises(ModelUnavailable, match=r"needs 1000000\.00 GB more in the Hugging Face cache .* GB free"):
        downloads.ensure(get_model("flux1-schnell"), lambda fetch: None)
    assert [call.get("dry_run") for call in calls] == [True]  # only the dry run: no transfer started


def test_downloads_are_off_unless_allowed_and_on_in_a_space():
    assert not Settings.from_env({}).download
    assert Settings.from_env({"ACCELDEMO_DOWNLOAD": "1"}).download
    assert Settings.from_env({"SPACE_ID": "me/demo"}).download
    assert not Settings.from_env({"SPACE_ID": "me/demo", "HF_HUB_OFFLINE": "1"}).download
    assert not Settings.from_env({"SPACE_ID": "me/demo", "ACCELDEMO_DOWNLOAD": "0"}).download
    assert Settings.from_env({"ACCELDEMO_MODEL": "flux1-schnell"}).default_model == "flux1-schnell"
    with pytest.raises(ValueError, match="ACCELDEMO_DOWNLOAD='maybe' is not accepted"):
        Settings.from_env({"ACCELDEMO_DOWNLOAD": "maybe"})


def test_a_space_style_start_fetches_its_model_with_progress_and_serves(hub, tmp_path):
    import openai

    port = free_port()
    environment = {key: value for key, value in os.environ.items() if key not in ("HF_HUB_OFFLINE",)}
    environment.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=hub.url, SPACE_ID="acceldemo/test",
                       ACCELDEMO_MODEL="flux1-schnell", ACCELDEMO_DEFAULT_MODEL="", GRADIO_SERVER_PORT=str(port),
                       ACCELDEMO_CACHE_DIR=str(tmp_path / "cache"), ACCELDEMO_CPU_MEMORY_GB="64")
    log = (tmp_path / "app.log").open("w")
    app = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_answers(url + "/health", app, tmp_path / "app.log")
        models = json.load(urllib.request.urlopen(url + "/v1/models/flux1-schnell"))
        assert models["available"] and models["default"] and "on first use (ACCELDEMO_DOWNLOAD)" in \
            models["availability"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        events = list(client.images.generate(prompt="a red circle", size="256x256", stream=True,
                                             extra_body={"num_inference_steps": 2, "seed": 1}))
        messages = [getattr(e, "message", "") for e in events]
        assert any(m.startswith(f"downloading {SCHNELL}: ") for m in messages), messages
        assert events[-1].type == "image_generation.completed"
        assert json.load(urllib.request.urlopen(url + "/status"))["downloads"] == []  # done
    finally:
        app.terminate()
        app.wait(30)
