"""What can be checked of the packaging without a Docker engine or a build: paths, ports and commands agree with the
app, pyproject.toml agrees with the requirements files, and the wheel's package data covers the app's data files."""
import glob
import os
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def _dockerfile_env() -> dict[str, str]:
    text = _dockerfile()
    return dict(re.findall(r"\b([A-Z_]+)=(\S+)", " ".join(line for line in text.splitlines()
                                                         if line.startswith("ENV") or line.startswith("    "))))


def test_dockerfile_serves_app_py_on_7860_as_uid_1000():
    text = _dockerfile()
    assert "useradd -m -u 1000 user" in text and "USER user" in text
    # The user exists before anything is copied, so every COPY can hand its files to it.
    assert text.index("useradd -m -u 1000 user") < text.index("COPY")
    assert "HOME=/home/user" in text
    assert "EXPOSE 7860" in text and "PORT=7860" in text and "ACCELDEMO_HOST=0.0.0.0" in text
    assert 'CMD ["python", "app.py"]' in text
    for name in re.findall(r"requirements[-\w]*\.txt", text):
        assert (ROOT / name).exists(), name


def test_dockerfile_leaves_the_cache_folder_to_the_app():
    """uid 1000 cannot create /data/acceldemo without a volume: the image names no cache folder, the app picks one."""
    assert "ACCELDEMO_CACHE_DIR" not in _dockerfile_env()


def test_app_reads_the_variables_the_dockerfile_sets():
    from acceldemo.config import Settings, default_cache_dir

    settings = Settings.from_env(_dockerfile_env())
    assert (settings.host, settings.port) == ("0.0.0.0", 7860)
    assert settings.cache_dir == default_cache_dir()


def test_cache_folder_is_on_a_writable_data_volume(tmp_path):
    from acceldemo.config import Settings, cache_dir_note, default_cache_dir

    data = tmp_path / "data"
    data.mkdir()
    assert default_cache_dir(data, home=tmp_path / "home") == data / "acceldemo"
    settings = Settings(cache_dir=default_cache_dir(data))
    assert cache_dir_note(settings, {}, data) == f"cache directory {data / 'acceldemo'} ({data} is writable (a persistent volume))"


def test_cache_folder_falls_back_to_home_without_a_data_volume(tmp_path):
    from acceldemo.config import Settings, cache_dir_note, default_cache_dir

    home = tmp_path / "home"
    assert default_cache_dir(tmp_path / "absent", home=home) == home / ".cache" / "acceldemo"
    assert default_cache_dir(Path("/nonexistent-data-volume")) == Path.home() / ".cache" / "acceldemo"
    settings = Settings(cache_dir=default_cache_dir(tmp_path / "absent", home=home))
    note = cache_dir_note(settings, {}, tmp_path / "absent")
    assert note.startswith(f"cache directory {home / '.cache' / 'acceldemo'} (") and "not writable" in note


def test_cache_folder_falls_back_to_home_when_data_is_not_writable(tmp_path, monkeypatch):
    import acceldemo.config as config

    data, home = tmp_path / "data", tmp_path / "home"
    data.mkdir()
    data.chmod(0o555)
    try:
        if os.access(data, os.W_OK):  # root ignores the mode bits: deny as a read-only mount would
            real_access = os.access
            monkeypatch.setattr(config.os, "access", lambda path, mode: False if Path(path) == data and mode & os.W_OK
                                else real_access(path, mode))
        assert config.default_cache_dir(data, home=home) == home / ".cache" / "acceldemo"
    finally:
        data.chmod(0o755)


def test_an_operator_cache_folder_wins(tmp_path):
    from acceldemo.config import Settings, cache_dir_note

    settings = Settings.from_env({"ACCELDEMO_CACHE_DIR": str(tmp_path / "mine")})
    assert settings.cache_dir == tmp_path / "mine"
    assert cache_dir_note(settings, {"ACCELDEMO_CACHE_DIR": str(tmp_path / "mine")}).endswith(
        "(set by ACCELDEMO_CACHE_DIR)")


def test_dockerfile_health_check_asks_the_health_route_without_curl():
    text = _dockerfile()
    healthcheck = text[text.index("HEALTHCHECK"):].split("\nCMD", 1)[0]
    assert "http://127.0.0.1:7860/health" in healthcheck and "urllib.request" in healthcheck
    assert "curl" not in healthcheck and "CMD [\"python\"" in healthcheck
    assert '@app.get("/health")' in (ROOT / "acceldemo" / "ui" / "server.py").read_text()


def test_dockerignore_keeps_local_state_out_of_the_image():
    entries = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for name in (".git", ".venv", ".pytest_cache", "outputs", "bench-results", "test-artifacts", "site"):
        assert name in entries, name
    assert entries & {"__pycache__", "**/__pycache__"} and entries & {"*.pyc", "**/*.pyc"}
    # What the image runs is not ignored.
    for needed in ("acceldemo", "app.py", "requirements.txt", "requirements*.txt"):
        assert needed not in entries


def test_readme_front_matter_and_commands_match_ci():
    readme = (ROOT / "README.md").read_text()
    assert readme.startswith("---\n") and "sdk: gradio" in readme and "app_file: app.py" in readme
    assert "bash scripts/test.sh" in readme and "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    assert ".venv/bin/python app.py" in readme


def test_torch_is_pinned_everywhere():
    assert "torch==2.13.0" in (ROOT / "requirements.txt").read_text().splitlines()
    assert "torch==2.13.0" in PYPROJECT["project"]["dependencies"]


def _pins(name: str) -> set[str]:
    """A requirements file's own requirements (not those of the files it includes with -r), normalized."""
    lines = (line.split("#", 1)[0].strip() for line in (ROOT / name).read_text().splitlines())
    return {_normal(line) for line in lines if line and not line.startswith("-")}


def _normal(text: str) -> str:
    requirement = Requirement(text)
    extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
    return f"{canonicalize_name(requirement.name)}{extras}{requirement.specifier}"


@pytest.mark.parametrize(("extra", "requirements"), [
    (None, "requirements.txt"),
    ("fleet", "requirements-fleet.txt"),
    ("dev", "requirements-dev.txt"),
    ("tpu", "requirements-tpu.txt"),
])
def test_pyproject_pins_are_the_requirements_files_pins(extra, requirements):
    project = PYPROJECT["project"]
    declared = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    assert {_normal(line) for line in declared} == _pins(requirements)


def test_requirements_files_include_the_base_they_build_on():
    """The extras hold each file's own pins; the files include requirements.txt (and dev the fleet) as pip does."""
    for name in ("requirements-fleet.txt", "requirements-dev.txt", "requirements-tpu.txt", "requirements-cuda.txt",
                 "requirements-neuron.txt"):
        assert "-r requirements.txt" in (ROOT / name).read_text().splitlines(), name
    assert "-r requirements-fleet.txt" in (ROOT / "requirements-dev.txt").read_text().splitlines()
    # Neuron's packages come from AWS's index, which package metadata cannot name: no extra for them.
    assert "neuron" not in PYPROJECT["project"]["optional-dependencies"]


def test_project_metadata_and_console_script():
    project = PYPROJECT["project"]
    assert (project["name"], project["version"], project["requires-python"]) == ("acceldemo", "0.1.0", ">=3.11")
    assert project["license"] == "Apache-2.0"
    assert (ROOT / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert project["scripts"] == {"acceldemo": "acceldemo.cli:main"}
    from acceldemo.cli import main

    assert callable(main)


def _data_files() -> set[str]:
    package = ROOT / "acceldemo"
    return {path.relative_to(package).as_posix() for path in package.rglob("*")
            if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts}


def test_package_data_covers_every_data_file_of_the_app():
    patterns = PYPROJECT["tool"]["setuptools"]["package-data"]["acceldemo"]
    shipped = {match for pattern in patterns
               for match in glob.glob(pattern, root_dir=ROOT / "acceldemo", recursive=True)}
    data = _data_files()
    assert data and data <= shipped, sorted(data - shipped)
    assert any(name.endswith("outline.safetensors") for name in data)


def test_only_the_app_is_packaged_and_training_is_imported_from_the_checkout():
    assert PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"] == ["acceldemo*"]
    # training/ is development tooling: a package of the checkout (imported from the repository root), not the wheel.
    assert (ROOT / "training" / "__init__.py").is_file()
    import training.shapes

    assert Path(training.shapes.__file__).resolve().is_relative_to(ROOT / "training")
