"""The real torch-tpu wheel in a virtual environment of its own, built once per machine and set of pins.

It lives under ${XDG_CACHE_HOME:-~/.cache}/acceldemo-test/, named after the pins in requirements.txt and the
Python version, so a second test run finds it and a change of pins builds a new one. A build happens in a
`.building-PID` folder that becomes the environment only once pip has finished: a killed build is never used,
and the next one clears its leftovers. `python -m tests.tpu_wheel.environment` builds it and prints its Python.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "requirements.txt"
# On PYTHONPATH, the simulated TPU host of every process in the environment (see site/sitecustomize.py).
SIMULATION = HERE / "site"


def pins() -> list[str]:
    """The requirement lines: `name==version`."""
    lines = (line.split("#")[0].strip() for line in REQUIREMENTS.read_text().splitlines())
    return [line for line in lines if line]


def location() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    name = "_".join(pin.replace("==", "-") for pin in pins()) + f"_py{sys.version_info.major}.{sys.version_info.minor}"
    return Path(cache) / "acceldemo-test" / name


def ensure() -> Path:
    """The environment's Python, after building the environment if this machine has none for these pins."""
    target = location()
    python = target / "bin" / "python"
    if python.exists():
        return python
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second test run waits for the first build instead of starting its own
        if python.exists():
            return python
        for leftover in target.parent.glob(target.name + ".building-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        building = target.with_name(f"{target.name}.building-{os.getpid()}")
        started = time.monotonic()
        _run([sys.executable, "-m", "venv", str(building)])
        _run([str(building / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
              "-r", str(REQUIREMENTS)])
        # Only `bin/python -m ...` is used, which finds its environment from where it lies: the folder can move.
        building.rename(target)
        print(f"built {target} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return python


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"building the torch-tpu test environment failed (it needs PyPI): {' '.join(command)} "
                           f"exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}\n"
                           'Without PyPI, leave these tests out with -m "not tpu_wheel".')


if __name__ == "__main__":
    print(ensure())
