"""The wheel: built from pyproject.toml, it holds the app's data (the embedded model, its LoRA, the real configs) and
its console script, and works installed outside the checkout."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of what it is made of (a build in the checkout would leave build/ and
    *.egg-info there), with the venv's setuptools (no download)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    shutil.copytree(ROOT / "acceldemo", source / "acceldemo", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, source / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-w", str(tmp / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (built,) = (tmp / "dist").glob("acceldemo-0.1.0-*.whl")
    return built


@pytest.mark.slow
def test_wheel_holds_the_embedded_model_its_lora_the_real_configs_and_the_console_script(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    weights = "acceldemo/models/shapes/weights/"
    for name in ("model_index.json", "scheduler/scheduler_config.json", "text_encoder/config.json",
                 "text_encoder/model.safetensors", "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json",
                 "tokenizer/chat_template.jinja", "transformer/config.json",
                 "transformer/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors"):
        assert weights + name in names, name
    assert "acceldemo/models/shapes/loras/outline.safetensors" in names
    assert "acceldemo/models/latent_rgb.json" in names
    for model in ("flux2-klein-4b", "flux1-schnell", "sd3.5-medium", "flux2-dev"):
        assert f"acceldemo/models/configs/{model}/model_index.json" in names, model
        assert f"acceldemo/models/configs/{model}/transformer/config.json" in names, model
    # Every data file of the checkout's package is in the wheel, and nothing from outside the package.
    data = {path.relative_to(ROOT).as_posix() for path in (ROOT / "acceldemo").rglob("*")
            if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts}
    assert data <= names, sorted(data - names)
    assert not {name for name in names if name.split("/")[0] in ("training", "tests", "bench", "scripts")}
    (entry_points,) = (name for name in names if name.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[console_scripts]" in text and "acceldemo = acceldemo.cli:main" in text
    (license_file,) = (name for name in names if name.endswith("/LICENSE") and ".dist-info/" in name)
    assert b"Apache License" in zipfile.ZipFile(wheel).read(license_file)


@pytest.mark.slow
def test_installed_wheel_finds_its_embedded_model_outside_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(site),
                           str(wheel)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = tmp_path / "elsewhere"
    run.mkdir()
    # The venv's packages stay (the app's dependencies); only the checkout leaves the import path.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(PYTHONPATH=str(site), ACCELDEMO_CACHE_DIR=str(tmp_path / "cache"), HF_HUB_OFFLINE="1",
               TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    code = (
        "import json, acceldemo\n"
        "from diffusers import Flux2KleinPipeline\n"
        "from acceldemo.models import real_configs\n"
        "from acceldemo.models.shapes import trained_model_dir\n"
        "pipe = Flux2KleinPipeline.from_pretrained(trained_model_dir())\n"
        "print(json.dumps({'package': acceldemo.__file__, 'weights': str(trained_model_dir()),\n"
        "                  'tokens': len(pipe.tokenizer('a red circle')['input_ids']),\n"
        "                  'klein': real_configs.component_config('flux2-klein-4b', 'transformer')['num_layers']}))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=run, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    found = __import__("json").loads(done.stdout.strip().splitlines()[-1])
    assert Path(found["package"]).is_relative_to(site) and Path(found["weights"]).is_relative_to(site)
    assert found["tokens"] > 0 and found["klein"] == 5
    # The console script pip wrote, as a user would run it.
    done = subprocess.run([str(site / "bin" / "acceldemo"), "info"], cwd=run, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tiny-shapes" in done.stdout and "LoRA styles: outline" in done.stdout
