"""Test set-up: a private app cache and a fast CPU compile backend, set before acceldemo is imported."""
import atexit
import os
import shutil
import tempfile

# The app reads these when it is imported; tests must never touch a user's cache. Each pytest-xdist worker gets a
# cache of its own (the workers inherit the controller's environment): tests count compiles and cache hits. The
# process that made one removes it when it exits.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER or "ACCELDEMO_CACHE_DIR" not in os.environ:
    os.environ["ACCELDEMO_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"acceldemo-test-cache-{_WORKER or 'main'}-")
    atexit.register(shutil.rmtree, os.environ["ACCELDEMO_CACHE_DIR"], True)
# aot_eager goes through dynamo and AOTAutograd like inductor but compiles in seconds; the tests
# marked `inductor` use the real backend.
os.environ.setdefault("ACCELDEMO_CPU_COMPILE_BACKEND", "aot_eager")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
# The machinery tests run on the random-weight tiny FLUX.2-klein; the trained default has tests of its own.
os.environ.setdefault("ACCELDEMO_DEFAULT_MODEL", "tiny-flux2-klein")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from acceldemo.config import Settings  # noqa: E402
from acceldemo.hardware import prepare_process  # noqa: E402

# As the app's entry points do, once, before torch loads: compiler caches into the test cache dir.
prepare_process(Settings.from_env())

from tests.engines import free_port, new_manager, s3_server, wait_until_answers  # noqa: E402


@pytest.fixture(scope="session")
def manager():
    """One engine for the session, as the app has: compiled graphs are process-wide anyway."""
    m = new_manager()
    yield m
    m.close()


@pytest.fixture
def fresh_manager():
    """An engine of its own (with settings overridden by keyword), for tests that count loads or evictions."""
    made = []

    def make(**overrides):
        m = new_manager(**overrides)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


class ServerUrl(str):
    """The served app's base URL; `.pid` is its process, for tests that read its memory."""

    pid: int


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The real app.py serving on a free loopback port, with start-up warm-up of one shape."""
    import subprocess
    import sys

    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "app.py", "--port", str(port), "--warmup", "compiled:64x64@1,2",
                                    "--mcp"],
                                   cwd=root, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = ServerUrl(f"http://127.0.0.1:{port}")
    url.pid = process.pid
    try:
        wait_until_answers(url + "/health", process, log_path)
    except AssertionError:
        process.kill()
        raise
    yield url
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        raise


# The shared artifact store on a real S3 protocol (moto's server on loopback): tests/test_store.py and
# tests/test_signed_artifacts.py.
@pytest.fixture(scope="module")
def aws_credentials():
    """moto accepts any credentials; boto needs some to sign with. Set for the module, then put back."""
    wanted = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    before = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module")
def s3(aws_credentials):
    with s3_server() as (_, options):
        yield options
