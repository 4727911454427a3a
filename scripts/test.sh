#!/usr/bin/env bash
# The test suite on a fresh machine: makes .venv (again only when a requirements file changed), installs what the
# tests need (Python packages, and Debian's chromium for the browser test), then runs pytest and prints the 20
# slowest tests. `--fast`: the quick tier only (validation, the engine, the API routes, the CLI's refusals; no
# browser, no worker pools, no real compilers), for a change in progress. Other arguments go to pytest.
#
# The quick tier runs on two pytest-xdist workers, a test file each at a time (`--dist loadfile`: a file's module
# fixtures are built once), with one torch thread per process (OMP_NUM_THREADS=1): on a 2-core host two busy
# processes of 2 threads each run the tiny models many times slower than of 1. The whole suite runs serially: its
# long tests are worker pools, app servers and Ray nodes of several processes each, which two workers at once only
# slow down (measured on this host: 43 min on two workers against 31 serially).
set -euo pipefail
cd "$(dirname "$0")/.."
tier=()
if [ "${1:-}" = "--fast" ]; then
  shift
  tier=(-n 2 --dist loadfile -m "not slow and not heavy and not inductor and not tpu_wheel")
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
elif [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
wanted=$(cat requirements*.txt tests/tpu_wheel/requirements.txt | sha256sum | cut -d' ' -f1)
if [ ! -x .venv/bin/python ] || [ "$(cat .venv/.requirements-sha256 2>/dev/null)" != "$wanted" ]; then
  python3 -m venv .venv
  .venv/bin/pip install --quiet --disable-pip-version-check -r requirements-dev.txt
  echo "$wanted" > .venv/.requirements-sha256
fi
exec .venv/bin/python -m pytest "${tier[@]}" --durations=20 "$@"
