"""The embedded tiny pipelines: what the rest of the app relies on them to do, offline on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import diffusers
import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from PIL import Image

from acceldemo.models import tiny
from acceldemo.models.tiny import TINY_BUILD_VERSION, TINY_FAMILIES, build_tiny_pipeline, ensure_tiny_model

pytestmark = pytest.mark.heavy  # outside the quick tier (scripts/test.sh --fast); run in CI

PIPELINE_CLASSES = {
    "flux2-klein": "Flux2KleinPipeline",
    "flux1": "FluxPipeline",
    "sd3": "StableDiffusion3Pipeline",
    "flux2": "Flux2Pipeline",
}
# The guidance each family's reference recipe uses (the catalog's real models); for SD3 it turns CFG on.
GUIDANCE = {"flux2-klein": 1.0, "flux1": 0.0, "sd3": 4.5, "flux2": 4.0}
FLUX_FAMILIES = ("flux2-klein", "flux1", "flux2")
# Multiples of 16 with odd packed-latent sides (80 px -> 5 patches), non-square, and the 512 px maximum.
SIZES = ((64, 64), (208, 80), (512, 512))


@pytest.fixture(scope="module")
def pipelines() -> dict[str, DiffusionPipeline]:
    built = {family: build_tiny_pipeline(family) for family in TINY_FAMILIES}
    for pipeline in built.values():
        pipeline.set_progress_bar_config(disable=True)
    return built


@pytest.fixture(scope="module")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


def generate(
    pipeline: DiffusionPipeline,
    family: str,
    width: int = 64,
    height: int = 64,
    prompt: str = "a red fox in the snow",
    steps: int = 2,
    **kwargs,
) -> Image.Image | np.ndarray:
    """One call as the app makes it: prompt by keyword (Flux2Klein's first argument is an image)."""
    output = pipeline(
        prompt=prompt,
        height=height,
        width=width,
        num_inference_steps=steps,
        guidance_scale=GUIDANCE[family],
        generator=torch.Generator("cpu").manual_seed(0),
        **kwargs,
    )
    return output.images[0]


def load(folder: Path, family: str) -> DiffusionPipeline:
    """Load as callers do: the real pipeline class's own from_pretrained."""
    pipeline = getattr(diffusers, PIPELINE_CLASSES[family]).from_pretrained(folder)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def parameter_count(pipeline: DiffusionPipeline) -> int:
    modules = [c for c in pipeline.components.values() if isinstance(c, torch.nn.Module)]
    return sum(p.numel() for module in modules for p in module.parameters())


def state_dicts(pipeline: DiffusionPipeline) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{key}": tensor
        for name, component in pipeline.components.items()
        if isinstance(component, torch.nn.Module)
        for key, tensor in component.state_dict().items()
    }


def test_unknown_family_names_the_known_ones(tmp_path: Path) -> None:
    for call in (lambda: build_tiny_pipeline("flux3"), lambda: ensure_tiny_model("flux3", tmp_path)):
        with pytest.raises(ValueError, match="flux3.*flux2-klein, flux1, sd3, flux2"):
            call()
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_each_family_is_its_real_pipeline_class_and_small(pipelines, family: str) -> None:
    pipeline = pipelines[family]
    assert type(pipeline).__name__ == PIPELINE_CLASSES[family]
    assert pipeline.transformer.dtype == torch.float32
    assert 300_000 < parameter_count(pipeline) < 1_000_000


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize(("width", "height"), SIZES)
def test_image_has_the_requested_size_and_is_not_constant(pipelines, family: str, width: int, height: int) -> None:
    image = generate(pipelines[family], family, width, height)
    assert image.size == (width, height)
    assert np.asarray(image).std() > 1.0


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_same_seed_gives_the_same_image_and_the_prompt_matters(pipelines, family: str) -> None:
    pipeline = pipelines[family]
    first = generate(pipeline, family, output_type="np")
    assert np.array_equal(first, generate(pipeline, family, output_type="np"))
    assert not np.array_equal(first, generate(pipeline, family, output_type="np", prompt="a blue boat"))


def test_flux2_system_prompt_leaves_room_for_the_prompt_in_256_tokens(pipelines) -> None:
    pipeline = pipelines["flux2"]
    short = generate(pipeline, "flux2", output_type="np", max_sequence_length=256)
    other = generate(pipeline, "flux2", output_type="np", max_sequence_length=256, prompt="a blue boat")
    assert not np.array_equal(short, other)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_building_again_gives_identical_weights(pipelines, family: str) -> None:
    first, second = state_dicts(pipelines[family]), state_dicts(build_tiny_pipeline(family))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)


def test_building_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected_draw = torch.rand(1)
    torch.manual_seed(123)
    build_tiny_pipeline("flux1")
    assert torch.equal(torch.rand(1), expected_draw)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_saved_model_reloads_and_reproduces_the_built_image(pipelines, model_root: Path, family: str) -> None:
    folder = ensure_tiny_model(family, model_root)
    assert folder == model_root / f"tiny-{family}-v{TINY_BUILD_VERSION}"
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == PIPELINE_CLASSES[family]
    assert sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) < 5_000_000
    loaded = load(folder, family)
    # Not bit-identical: memory-mapped safetensors weights sit at other alignments, which
    # changes the summation order of CPU matmul kernels (differences around 1e-6).
    built = generate(pipelines[family], family, output_type="np")
    np.testing.assert_allclose(generate(loaded, family, output_type="np"), built, atol=1e-4)


def test_second_ensure_reuses_the_folder_without_building(model_root: Path, monkeypatch) -> None:
    folder = ensure_tiny_model("flux1", model_root)

    def build_must_not_run(family: str) -> DiffusionPipeline:
        raise AssertionError(f"rebuilt {family}")

    monkeypatch.setattr(tiny, "build_tiny_pipeline", build_must_not_run)
    assert ensure_tiny_model("flux1", model_root) == folder


def test_leftover_of_a_crashed_build_is_never_used(tmp_path: Path) -> None:
    leftover = tmp_path / f".tiny-sd3-v{TINY_BUILD_VERSION}.crashed.partial"
    leftover.mkdir()
    (leftover / "model_index.json").write_text("{}")
    folder = ensure_tiny_model("sd3", tmp_path)
    assert folder != leftover
    assert isinstance(load(folder, "sd3").transformer, torch.nn.Module)


def test_concurrent_builder_that_finishes_first_wins(tmp_path: Path, monkeypatch) -> None:
    real_build = tiny.build_tiny_pipeline

    def build_while_another_builder_finishes(family: str) -> DiffusionPipeline:
        monkeypatch.setattr(tiny, "build_tiny_pipeline", real_build)
        ensure_tiny_model(family, tmp_path)
        return real_build(family)

    monkeypatch.setattr(tiny, "build_tiny_pipeline", build_while_another_builder_finishes)
    folder = ensure_tiny_model("flux1", tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]
    assert isinstance(load(folder, "flux1").transformer, torch.nn.Module)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_shapes_suit_tensor_parallel_over_2_and_4_ranks_and_regional_compile(pipelines, family: str) -> None:
    transformer = pipelines[family].transformer.config
    assert transformer.num_attention_heads % 4 == 0
    assert len(pipelines[family].transformer.transformer_blocks) >= 2
    if family in FLUX_FAMILIES:
        assert len(pipelines[family].transformer.single_transformer_blocks) >= 2
    if family in ("flux2-klein", "flux2"):
        text = pipelines[family].text_encoder.config.get_text_config()
        assert text.num_attention_heads % 4 == 0
        assert text.num_key_value_heads % 4 == 0
        assert text.vocab_size % 4 == 0
        # The pipelines read hidden states 9/18/27 (klein) and 10/20/30 (dev) by default.
        assert text.num_hidden_layers >= {"flux2-klein": 27, "flux2": 31}[family]


@pytest.mark.parametrize(
    ("family", "scope"),
    [*((family, "whole") for family in TINY_FAMILIES), *((family, "repeated blocks") for family in FLUX_FAMILIES)],
)
def test_transformer_compiles_with_static_shapes(pipelines, fresh_dynamo, family: str, scope: str) -> None:
    eager = generate(pipelines[family], family, output_type="np")
    pipeline = build_tiny_pipeline(family)  # a fresh copy: compiling changes the module in place
    pipeline.set_progress_bar_config(disable=True)
    transformer = pipeline.transformer
    compile_transformer = transformer.compile if scope == "whole" else transformer.compile_repeated_blocks
    compile_transformer(backend="aot_eager", fullgraph=True, dynamic=False)
    compiled = generate(pipeline, family, output_type="np")
    # Repeated blocks give one graph per block kind at least: double- and single-stream.
    assert fresh_dynamo["stats"]["unique_graphs"] >= (1 if scope == "whole" else 2)
    np.testing.assert_allclose(compiled, eager, atol=1e-5)


def test_sd3_has_no_repeated_blocks_to_compile(pipelines) -> None:
    with pytest.raises(ValueError, match="_repeated_blocks"):
        pipelines["sd3"].transformer.compile_repeated_blocks(backend="aot_eager", fullgraph=True, dynamic=False)
