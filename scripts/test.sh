#!/usr/bin/env bash
# The whole test suite on a fresh machine: makes .venv, installs what the tests need, runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install --quiet --disable-pip-version-check -r requirements-dev.txt
exec .venv/bin/python -m pytest "$@"
