"""Test set-up: a private app cache and a fast CPU compile backend, set before acceldemo is imported."""
import os
import tempfile

# The app reads these when it is imported; tests must never touch a user's cache.
os.environ.setdefault("ACCELDEMO_CACHE_DIR", tempfile.mkdtemp(prefix="acceldemo-test-cache-"))
# aot_eager goes through dynamo and AOTAutograd like inductor but compiles in seconds; the tests
# marked `inductor` use the real backend.
os.environ.setdefault("ACCELDEMO_CPU_COMPILE_BACKEND", "aot_eager")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from acceldemo.config import Settings  # noqa: E402
from acceldemo.engine import SessionManager  # noqa: E402


@pytest.fixture(scope="session")
def manager():
    """One manager for the session, as the app has: compiled graphs are process-wide anyway."""
    m = SessionManager(Settings.from_env())
    yield m
    m.close()


@pytest.fixture
def fresh_manager():
    """A manager of its own, for tests that count loads or evictions."""
    made = []

    def make(**overrides):
        settings = Settings.from_env()
        m = SessionManager(type(settings)(**{**settings.__dict__, **overrides}))
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()
