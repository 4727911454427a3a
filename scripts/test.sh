#!/usr/bin/env bash
# The test suite on a fresh machine: makes .venv (again only when a requirements file changed), installs what the
# tests need (Python packages, and Debian's chromium for the browser test), then runs pytest and prints the 20
# slowest tests. `--fast`: the quick tier only (validation, the engine, the API routes, the CLI's refusals; no
# browser, no worker pools, no real compilers), for a change in progress. Other arguments go to pytest.
#
# Tests that are not marked slow (the quick tier, the tiny models' own checks, the fake devices, inductor in-process)
# run on two pytest-xdist workers, a test file each at a time (`--dist loadfile`: a file's module fixtures are built
# once), with one torch thread per process (OMP_NUM_THREADS=1): on a 2-core host two busy processes of 2 threads each
# run the tiny models many times slower than of 1. Measured here: the 580 such tests in 4¼ to 8½ min. The tests
# marked slow then run serially: they are worker pools, app servers, a browser, bench runs and Ray nodes of several
# processes each, which two workers at once only slow down and make flaky (measured on this host: the whole suite on
# two workers 45 min with browser timeouts, against 60 serially). With arguments (a file, -k, -m ...), pytest runs
# them once, serially, as given.
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
if [ "${1:-}" = "--fast" ]; then
  shift
  fast=1
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
pytest=(.venv/bin/python -m pytest --durations=20)
parallel=(-n 2 --dist loadfile)
if [ "$fast" = 1 ]; then
  OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" exec "${pytest[@]}" "${parallel[@]}" \
    -m "not slow and not heavy and not inductor and not tpu_wheel" "$@"
elif [ $# -gt 0 ]; then
  exec "${pytest[@]}" "$@"
fi
status=0
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "${pytest[@]}" "${parallel[@]}" -m "not slow" || status=$?
"${pytest[@]}" -m slow || status=$?
exit "$status"
