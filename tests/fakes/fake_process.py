"""Run test code in a fresh interpreter that has a fake accelerator installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
# Marks the line that carries the result, so the code under test may print freely.
_RESULT_MARKER = "FAKE-DEVICE-RESULT:"

# The fake goes in before the code runs, so before anything imports diffusers.
_BOOTSTRAP = f"""
import json, sys
from tests.fakes.fake_device import install_fake_device
install_fake_device(sys.argv[1])
namespace = {{"__name__": "__fake_device_process__"}}
exec(compile(sys.stdin.read(), "<fake-device-code>", "exec"), namespace)
print({_RESULT_MARKER!r} + json.dumps(namespace.get("result")), flush=True)
"""


class FakeDeviceProcessError(RuntimeError):
    """The code failed in the child process; the message carries its stderr."""


def run_in_fake_device_process(
    device: str,
    code: str,
    *,
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> Any:
    """Run `code` where `device` ("neuron" or "tpu") is a fake torch device; return `result`.

    `code` is dedented, runs as a module body and reports by assigning a
    JSON-serialisable value to `result`. torch's PrivateUse1 slot takes one
    backend per process, which is why every fake device needs its own process.
    Raises FakeDeviceProcessError (with the child's output) when the code fails.
    """
    child_env = {
        **os.environ,
        # Only the fake may claim PrivateUse1: a real backend package found by
        # autoload would take it first (or abort the process without hardware).
        "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
        **(env or {}),
    }
    # The checkout goes first on the child's import path (tests.fakes, and acceldemo itself), before any folder the
    # caller's PYTHONPATH names.
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), child_env.get("PYTHONPATH")) if p)
    completed = subprocess.run(
        [sys.executable, "-c", _BOOTSTRAP, device],
        input=textwrap.dedent(code),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO_ROOT,
        env=child_env,
    )
    for line in reversed(completed.stdout.splitlines()):
        if completed.returncode == 0 and line.startswith(_RESULT_MARKER):
            return json.loads(line[len(_RESULT_MARKER) :])
    raise FakeDeviceProcessError(
        f"code on fake device {device!r} exited with {completed.returncode}:\n"
        f"--- stdout ---\n{completed.stdout[-4000:]}\n--- stderr ---\n{completed.stderr[-4000:]}"
    )
