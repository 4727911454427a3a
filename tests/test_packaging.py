"""What can be checked of the packaging without a Docker engine: paths, ports and commands agree with the app."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_dockerfile_serves_app_py_on_7860_as_uid_1000_with_caches_on_data():
    text = (ROOT / "Dockerfile").read_text()
    assert "useradd -m -u 1000 user" in text and "USER user" in text
    assert "EXPOSE 7860" in text and "PORT=7860" in text and "ACCELDEMO_HOST=0.0.0.0" in text
    assert "ACCELDEMO_CACHE_DIR=/data/acceldemo" in text
    assert 'CMD ["python", "app.py"]' in text
    for name in re.findall(r"requirements[-\w]*\.txt", text):
        assert (ROOT / name).exists(), name


def test_app_reads_the_variables_the_dockerfile_sets():
    from acceldemo.config import Settings

    text = (ROOT / "Dockerfile").read_text()
    env = dict(re.findall(r"\b([A-Z_]+)=(\S+)", " ".join(line for line in text.splitlines()
                                                         if line.startswith("ENV") or line.startswith("    "))))
    settings = Settings.from_env(env)
    assert (settings.host, settings.port, str(settings.cache_dir)) == ("0.0.0.0", 7860, "/data/acceldemo")


def test_readme_front_matter_and_commands_match_ci():
    readme = (ROOT / "README.md").read_text()
    assert readme.startswith("---\n") and "sdk: gradio" in readme and "app_file: app.py" in readme
    assert "bash scripts/test.sh" in readme and "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    assert ".venv/bin/python app.py" in readme


def test_torch_is_pinned_everywhere():
    assert "torch==2.13.0" in (ROOT / "requirements.txt").read_text().splitlines()
