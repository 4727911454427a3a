"""The docs site (docs/, mkdocs.yml) and README.md: settings and CLI references complete, the site builds, the README short."""
import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
VARIABLE = re.compile(r"ACCELDEMO_[A-Z0-9_]*[A-Z0-9]")


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def source_variables() -> set[str]:
    files = [*sorted((ROOT / "acceldemo").rglob("*.py")), ROOT / "app.py"]
    return {name for path in files for name in VARIABLE.findall(path.read_text())}


def table_rows(text: str) -> list[str]:
    """The first cell of every Markdown table row (a row's subject), outside code blocks."""
    cells, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("|") and not re.match(r"^\|[\s:|-]+\|?$", line):
            cells.append(line.split("|")[1])
    return cells


def test_every_variable_the_code_reads_is_in_the_settings_table_once():
    names = source_variables()
    assert "ACCELDEMO_CACHE_DIR" in names and "ACCELDEMO_QUEUE_SIZE" in names  # the scan itself works
    rows = [cell for path in [*pages(), README] for cell in table_rows(path.read_text())]
    settings = (DOCS / "operations.md").read_text()
    missing = sorted(name for name in names if f"`{name}`" not in settings)
    assert not missing, f"ACCELDEMO_* variables read by the code but not in docs/operations.md: {missing}"
    counts = {name: sum(f"`{name}`" in cell for cell in rows) for name in names}
    wrong = {name: count for name, count in counts.items() if count != 1}
    assert not wrong, f"each variable must be the subject of exactly one table row across docs/ and README.md: {wrong}"


def subcommand_flags() -> dict[str, list[str]]:
    from acceldemo.cli import build_parser

    flags = {}
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                flags[name] = [option for each in sub._actions for option in each.option_strings
                               if option not in ("-h", "--help")]
    return flags


def test_every_flag_of_every_subcommand_is_in_the_cli_page():
    flags = subcommand_flags()
    assert {"generate", "warmup", "info"} <= set(flags) and "--prompt" in flags["generate"]
    text = (DOCS / "cli.md").read_text()
    missing = {name: [flag for flag in options if not re.search(rf"`[^`]*{re.escape(flag)}(?![\w-])[^`]*`", text)]
               for name, options in flags.items()}
    missing = {name: options for name, options in missing.items() if options}
    assert not missing, f"flags not mentioned in docs/cli.md: {missing}"
    for name in flags:
        assert f"`{name}`" in text, f"subcommand {name} has no mention in docs/cli.md"


def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site" / "architecture.html").is_file()


def test_every_page_is_in_the_nav():
    config = (ROOT / "mkdocs.yml").read_text()
    assert not [path.name for path in pages() if f" {path.name}" not in config]


def test_no_page_speaks_of_how_the_work_was_organised():
    pattern = re.compile(r"\b(issue|landing|landed) ?#?[0-9]+|the issue's|last landing", re.IGNORECASE)
    # Whole texts with line breaks as spaces, so a phrase wrapped over two lines is found too.
    found = [f"{path.name}: {match.group(0)!r}" for path in [*pages(), README]
             for match in pattern.finditer(" ".join(path.read_text().split()))]
    assert not found, "\n".join(found)


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    head = "\n".join(lines[:40])
    assert "python3 -m venv .venv && .venv/bin/pip install -r requirements.txt && .venv/bin/python app.py" in head
    assert "bash scripts/test.sh" in head


def test_readme_links_every_page():
    text = README.read_text()
    assert not [path.name for path in pages() if f"docs/{path.name}" not in text]


# The hardware flavours the Hub's Spaces configuration reference accepts for `suggested_hardware`.
SPACE_HARDWARE = {"cpu-basic", "cpu-upgrade", "t4-small", "t4-medium", "l4x1", "l4x4", "a10g-small", "a10g-large",
                  "a10g-largex2", "a10g-largex4", "a100-large", "v5e-1x1", "v5e-2x2", "v5e-2x4"}


def test_the_space_front_matter_builds_the_space_this_checkout_runs_as():
    """A Gradio Space reads README.md's front matter: the Gradio it installs, the Python it runs (3.10 when unset, which
    this package refuses), how long start-up may take before the Space is marked failed (30 minutes when unset, less
    than a compiled warm-up of a real model can take)."""
    import tomllib

    import yaml
    from packaging.specifiers import SpecifierSet

    text = README.read_text()
    assert text.startswith("---\n")
    front = yaml.safe_load(text.split("---\n", 2)[1])
    pins = dict(line.split("==") for line in (ROOT / "requirements.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert (front["sdk"], front["sdk_version"]) == ("gradio", pins["gradio"])
    assert front["app_file"] == "app.py" and (ROOT / "app.py").exists()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # A string: unquoted, YAML reads 3.10 as the number 3.1.
    assert isinstance(front["python_version"], str)
    assert front["python_version"] in SpecifierSet(project["requires-python"])
    assert f"FROM python:{front['python_version']}-slim" in (ROOT / "Dockerfile").read_text()
    assert front["suggested_hardware"] in SPACE_HARDWARE
    timeout = re.fullmatch(r"(\d+)([mh])", front["startup_duration_timeout"])
    assert timeout and int(timeout[1]) * {"m": 1, "h": 60}[timeout[2]] > 30
    assert front["license"].lower() == project["license"].lower()
    assert len(front["short_description"]) <= 60
