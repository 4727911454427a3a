"""The code is clean under the lint rules pyproject.toml sets (pyflakes, pycodestyle, import order, bugbear,
pyupgrade): checked in the fast tier, so CI refuses a change that is not."""
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    ruff = Path(sys.executable).with_name("ruff")
    command = [str(ruff)] if ruff.exists() else [shutil.which("ruff") or "ruff"]
    done = subprocess.run([*command, "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
