"""Edits (image-to-image, reference images, masks) and LoRA styles, through the engine, the official openai SDK and
the CLI: the pictures judged, graphs counted, every refusal's text."""
import base64
import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from acceldemo.errors import InvalidRequest, UnsupportedCombination
from acceldemo.models.catalog import get_model
from acceldemo.models.shapes import trained_model_dir
from acceldemo.records import GenerateParams, Shape
from acceldemo.ui.server import create_app
from tests.engines import serving
from training.shapes.dataset import Scene, render
from training.shapes.judge import judge

ROOT = Path(__file__).resolve().parents[1]
GREEN = "a green circle on a blue background, top left"
RED = "a red circle on a blue background, top left"


def encoded(picture: Image.Image, kind: str = "PNG") -> bytes:
    out = io.BytesIO()
    picture.save(out, kind)
    return out.getvalue()


def red_circle(width: int = 64, height: int = 64) -> Image.Image:
    return render(Scene("circle", "red", "blue", "top left"), width, height)


def lora_file(path: Path, layers: tuple[str, ...], rank: int, seed: int, scale: float = 0.3) -> Path:
    """A LoRA for tiny-shapes' transformer in diffusers' own format: random weights on `layers` (name fragments)."""
    from diffusers import Flux2KleinPipeline

    transformer = Flux2KleinPipeline.from_pretrained(trained_model_dir()).transformer
    generator, state = torch.Generator().manual_seed(seed), {}
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and any(name.endswith(layer) for layer in layers):
            state[f"transformer.{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=generator)
            state[f"transformer.{name}.lora_B.weight"] = torch.randn(module.out_features, rank,
                                                                     generator=generator) * scale
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))
    return path


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory) -> Path:
    """ACCELDEMO_LORA_DIR with one style for tiny-shapes, `noisy` (rank 4, attention q and v)."""
    root = tmp_path_factory.mktemp("loras")
    lora_file(root / "tiny-shapes" / "noisy.safetensors", ("attn.to_q", "attn.to_v"), 4, seed=1)
    return root


def pixels(image) -> np.ndarray:
    return np.asarray(image, dtype=np.int16)


def same_within_a_level(a, b) -> bool:
    return int(np.abs(pixels(a) - pixels(b)).max()) <= 1


# ---- checks (no pipeline) ----

def test_an_edit_is_checked_into_a_typed_request_at_the_pictures_size(manager):
    request = manager.check(GenerateParams(GREEN, model="tiny-shapes", image=encoded(red_circle(128, 64)),
                                           strength=0.7))
    assert request.shape == Shape(128, 64) and request.edit.method == "strength" and request.edit.strength == 0.7
    assert request.denoise_steps == 3 and request.edit.source == "PNG 128x64"
    # A size the model does not draw: the preset of the nearest proportions; the picture is fitted to it.
    request = manager.check(GenerateParams(GREEN, model="tiny-shapes", image=encoded(red_circle(300, 140))))
    assert request.shape == Shape(128, 64) and request.edit.strength == 0.8
    assert Image.open(io.BytesIO(request.edit.images[0])).size == (128, 64)
    # FLUX.2 edits with reference pictures: each adds its tokens to the static shape.
    reference = manager.check(GenerateParams("a cat", model="tiny-flux2-klein", image=[encoded(red_circle())] * 2))
    plain = manager.check(GenerateParams("a cat", model="tiny-flux2-klein"))
    assert reference.edit.method == "reference" and reference.graph_key[0] == 3 * plain.graph_key[0]


@pytest.mark.parametrize("image, mask, strength, field, words", [
    (b"hello, not a picture", None, None, "image", "not a picture"),
    (b"", None, None, "image", "an empty file"),
    ("gif", None, None, "image", "a GIF file"),
    ("png", None, 0, "strength", "greater than 0 and at most 1"),
    ("png", None, 1.5, "strength", "greater than 0 and at most 1"),
    ("png", None, "lots", "strength", "greater than 0 and at most 1"),
    ("png", "opaque", None, "mask", "transparent where the picture may change"),
    ("png", "jpeg", None, "mask", "without transparency"),
    ("png", "small", None, "mask", "a 32x32 mask for a 64x64 image"),
    ("png", "empty", None, "mask", "no transparent pixel"),
    ("two", None, None, "image", "at most 1 for tiny-shapes"),
])
def test_bad_edits_are_refused_by_name(manager, image, mask, strength, field, words):
    pictures = {"png": encoded(red_circle()), "gif": encoded(red_circle(), "GIF"), "two": [encoded(red_circle())] * 2}
    masks = {"opaque": encoded(Image.new("RGB", (64, 64))), "jpeg": encoded(Image.new("RGB", (64, 64)), "JPEG"),
             "small": encoded(Image.new("RGBA", (32, 32), (0, 0, 0, 0))),
             "empty": encoded(Image.new("RGBA", (64, 64), (0, 0, 0, 255)))}
    with pytest.raises(InvalidRequest) as refused:
        manager.check(GenerateParams(RED, model="tiny-shapes", image=pictures.get(image, image) if isinstance(image, str) else image,
                                     mask=masks.get(mask), strength=strength))
    assert refused.value.field == field and words in str(refused.value)


def test_too_large_a_picture_is_refused_by_its_bytes_and_pixels(manager):
    from acceldemo.engine import pictures

    with pytest.raises(InvalidRequest, match="at most 20 MB and 16 megapixels"):
        manager.check(GenerateParams(RED, model="tiny-shapes", image=b"\x89PNG" + bytes(pictures.MAX_IMAGE_BYTES)))
    huge = encoded(Image.new("L", (5000, 4000)))  # small in bytes, 20 megapixels
    with pytest.raises(InvalidRequest, match="too many pixels|5000x4000"):
        manager.check(GenerateParams(RED, model="tiny-shapes", image=huge))


def test_a_mask_where_the_model_cannot_inpaint_and_parts_of_an_edit_without_a_picture_are_refused(manager):
    mask = encoded(Image.new("RGBA", (64, 64), (0, 0, 0, 0)))
    for model, how in (("tiny-flux2", "with reference images"), ("tiny-sd3", "by image-to-image")):
        with pytest.raises(UnsupportedCombination, match=f"{model} cannot inpaint \\(it edits the whole picture {how}"):
            manager.check(GenerateParams("a cat", model=model, image=encoded(red_circle()), mask=mask))
    # A mask repaints one picture: FLUX.2 klein's reference pictures do not go with one.
    with pytest.raises(InvalidRequest, match=r"at most 1 for tiny-flux2-klein \(it repaints one picture where"):
        manager.check(GenerateParams("a cat", model="tiny-flux2-klein", image=[encoded(red_circle())] * 2, mask=mask))
    masked = manager.check(GenerateParams("a cat", model="tiny-flux2-klein", image=encoded(red_circle()), mask=mask,
                                          strength=0.5))
    # Diffusers' klein inpainting attends to the picture it repaints as to a reference: its tokens count.
    assert (masked.edit.method, masked.edit.strength, masked.denoise_steps, masked.references) == ("inpaint", 0.5, 2, 1)
    for field, value in (("strength", 0.5), ("mask", mask)):
        with pytest.raises(InvalidRequest, match="only with an image to edit"):
            manager.check(GenerateParams(RED, model="tiny-shapes", **{field: value}))


# ---- edits drawn ----

def test_an_edit_over_the_openai_sdk_turns_the_red_circle_green_from_a_png_and_a_jpeg_and_refuses_the_rest(
        fresh_manager):
    with serving(create_app(fresh_manager(default_model="tiny-shapes"))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        for name, kind in (("red.png", "PNG"), ("red.jpg", "JPEG")):
            answer = client.images.edit(image=(name, encoded(red_circle(), kind), f"image/{kind.lower()}"),
                                        prompt=GREEN, extra_body={"strength": 0.7, "seed": 3})
            image = Image.open(io.BytesIO(base64.b64decode(answer.data[0].b64_json)))
            seen = judge(image)
            assert image.size == (64, 64) and (seen.colour, seen.background, seen.position) == \
                ("green", "blue", "top left"), (name, seen)
            facts = answer.model_extra["acceldemo"][0]
            assert facts["edit"] == {"method": "strength", "strength": 0.7, "images": 1, "mask": False,
                                     "source": f"{kind} 64x64"}
        with pytest.raises(openai.BadRequestError) as refused:
            client.images.edit(image=("notes.txt", b"hello", "text/plain"), prompt=GREEN)
        assert refused.value.body["param"] == "image" and "not a picture" in refused.value.body["message"]
        with pytest.raises(openai.BadRequestError) as refused:
            client.images.edit(image=("red.png", encoded(red_circle()), "image/png"), prompt=GREEN,
                               extra_body={"strength": 2})
        assert refused.value.body["param"] == "strength"
        # A mask: FLUX.1 inpaints with diffusers' pipeline; FLUX.2 [dev] has none, and says so.
        mask = Image.new("RGBA", (64, 64), (0, 0, 0, 255))
        mask.paste((0, 0, 0, 0), (0, 0, 32, 64))
        pair = {"image": ("red.png", encoded(red_circle()), "image/png"),
                "mask": ("mask.png", encoded(mask), "image/png"), "prompt": "a cat"}
        answer = client.images.edit(model="tiny-flux1", **pair, extra_body={"strength": 0.6, "seed": 1})
        assert answer.model_extra["acceldemo"][0]["edit"]["method"] == "inpaint"
        with pytest.raises(openai.BadRequestError) as refused:
            client.images.edit(model="tiny-flux2", **pair)
        assert refused.value.body["param"] == "mask" and "tiny-flux2 cannot inpaint" in refused.value.body["message"]
        # A stream of an edit: OpenAI's image_edit events, a partial image among them.
        events = [event.type for event in client.images.edit(
            image=[("red.png", encoded(red_circle()), "image/png")], prompt=GREEN, stream=True, partial_images=1)]
        assert "image_edit.partial_image" in events and events[-1] == "image_edit.completed"


@pytest.mark.slow
def test_a_masked_edit_changes_only_the_transparent_region(fresh_manager):
    """Two red circles (top left, bottom right); the mask opens the top-left quarter only: that one turns green, the
    other stays red."""
    picture = red_circle()
    picture.paste(render(Scene("circle", "red", "blue", "bottom right"), 64, 64).crop((32, 32, 64, 64)), (32, 32))
    mask = Image.new("RGBA", (64, 64), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (0, 0, 32, 32))
    engine = fresh_manager(default_model="tiny-shapes")
    result = engine.generate(GenerateParams(GREEN, image=encoded(picture), mask=encoded(mask), strength=0.9, seed=5))
    out = pixels(result.image)
    assert result.facts()["edit"]["mask"] is True
    assert judge(result.image.crop((0, 0, 32, 32)).resize((64, 64))).colour == "green"
    kept = np.abs(out[40:, 40:] - pixels(picture)[40:, 40:]).mean()
    assert kept < 12, kept  # the bottom-right circle is the picture's own (through the VAE)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-flux1", "tiny-flux2-klein"])
def test_diffusers_inpainting_keeps_the_picture_outside_the_mask_and_compiles_nothing_new(fresh_manager, model):
    """FLUX.1 and FLUX.2 klein inpaint with diffusers' own pipelines (made from the loaded one): two prompts, one
    seed, the left half open — the final latents right of it are the picture's own in both, left of it they differ;
    through the engine, masked edits compile once for their static shape (FLUX.1: the text-to-image one; klein: the
    picture's tokens beside the image's), then nothing."""
    from acceldemo.executors.local import LocalExecutor
    from acceldemo.executors.recipe import run_pipeline
    from acceldemo.records import DeviceSet, no_progress

    engine = fresh_manager()
    mask = Image.new("RGBA", (128, 128), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (0, 0, 64, 128))  # transparent: the left half may change
    edit = dict(model=model, hardware="cpu", image=encoded(red_circle(128, 128)), mask=encoded(mask), strength=0.8,
                seed=4)
    requests = [engine.check(GenerateParams(prompt, **edit)) for prompt in ("a cat", "a lighthouse at dusk")]
    local = LocalExecutor(engine.settings, engine.hardware).load(requests[0].key(DeviceSet("cpu", (0,))),
                                                                 get_model(requests[0].model), no_progress)
    latents = [run_pipeline(local.prepared, engine.hardware.get("cpu"), request, False, no_progress,
                            output_type="latent").images[0] for request in requests]
    # FLUX.1 hands back packed latents (8x8 tokens of 2x2 patches), klein its latent grid (channels, 16, 16).
    left, right = [(a - b).abs() for a, b in zip(*(_halves(model, x) for x in latents))]
    # Random tiny text encoders move the latents little (klein ~1e-3, FLUX.1 ~3e-2), but they move them; outside
    # the mask nothing moves at all.
    assert float(right.max()) == 0.0 and float(left.mean()) > 1e-4, (float(right.max()), float(left.mean()))
    plain = engine.generate(GenerateParams("a cat", model=model, resolution="128x128", mode="compiled", seed=1))
    first = engine.generate(GenerateParams("a cat", mode="compiled", **edit))
    masked = engine.generate(GenerateParams("a lighthouse at dusk", mode="compiled", **{**edit, "strength": 0.6}))
    assert plain.new_graphs >= 1 and masked.new_graphs == 0
    assert (first.new_graphs >= 1) is (model == "tiny-flux2-klein"), first.new_graphs
    assert first.request.graph_key[0] == plain.request.graph_key[0] * (2 if model == "tiny-flux2-klein" else 1)
    assert masked.facts()["edit"] == {"method": "inpaint", "strength": 0.6, "images": 1, "mask": True,
                                      "source": "PNG 128x128"}
    assert masked.image.size == (128, 128) and pixels(masked.image).std() > 1


def _halves(model: str, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The latents of the image's left and right halves."""
    grid = latents.reshape(8, 8, -1).permute(2, 0, 1) if model == "tiny-flux1" else latents
    middle = grid.shape[-1] // 2
    return grid[..., :middle], grid[..., middle:]


@pytest.mark.slow
def test_edits_compile_once_per_shape_and_run_on_every_pipeline_family(fresh_manager):
    engine = fresh_manager(default_model="tiny-shapes")
    first = engine.generate(GenerateParams(GREEN, image=encoded(red_circle()), strength=0.7, mode="compiled", seed=1))
    again = engine.generate(GenerateParams(GREEN, image=encoded(red_circle()), strength=0.5, mode="compiled", seed=2))
    plain = engine.generate(GenerateParams(RED, mode="compiled", seed=1))  # the same static shape as its edits
    assert first.new_graphs >= 1 and again.new_graphs == 0 and plain.new_graphs == 0
    assert judge(first.image).colour == "green"
    for model in ("tiny-flux2-klein", "tiny-flux1", "tiny-sd3"):  # references; diffusers' image-to-image pipelines
        result = engine.generate(GenerateParams("a cat", model=model, image=encoded(red_circle(128, 128)),
                                                strength=0.6, seed=1))
        assert result.image.size == (128, 128) and pixels(result.image).std() > 1, model
        assert result.facts()["edit"]["method"] == ("reference" if model == "tiny-flux2-klein" else "strength")


@pytest.mark.slow
def test_the_cli_edits_a_picture_with_a_style_and_refuses_a_file_that_is_not_one(tmp_path, lora_dir):
    red = tmp_path / "red.png"
    red_circle().save(red)
    env = {"ACCELDEMO_LORA_DIR": str(lora_dir), "ACCELDEMO_DEFAULT_MODEL": "tiny-shapes", "PATH": "/usr/bin:/bin",
           **{k: v for k, v in __import__("os").environ.items() if k.startswith(("ACCELDEMO_CACHE", "HF_", "OMP"))}}
    done = subprocess.run([sys.executable, "-m", "acceldemo", "generate", "--prompt", GREEN, "--image", str(red),
                           "--strength", "0.7", "--lora", "noisy:0.2", "--seed", "3", "--out", str(tmp_path / "out"),
                           "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    facts = __import__("json").loads(done.stdout.splitlines()[-1])
    assert facts["edit"]["strength"] == 0.7 and facts["lora"] == "noisy" and facts["lora_scale"] == 0.2
    assert Image.open(facts["path"]).size == (64, 64)
    (tmp_path / "notes.png").write_text("not a picture")
    refused = subprocess.run([sys.executable, "-m", "acceldemo", "generate", "--prompt", GREEN, "--image",
                              str(tmp_path / "notes.png")], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode != 0 and "a file that is not a picture" in refused.stderr


# ---- LoRA styles ----

def test_styles_are_listed_checked_and_refused_by_name(fresh_manager, lora_dir):
    engine = fresh_manager(default_model="tiny-shapes", lora_dir=lora_dir)
    listed = {style["name"]: style for style in engine.describe().model("tiny-shapes").loras}
    assert listed["noisy"]["rank"] == 4 and listed["noisy"]["layers"] > 0
    request = engine.check(GenerateParams(RED, lora="noisy", lora_scale="0.5"))
    assert (request.lora, request.lora_scale) == ("noisy", 0.5)
    assert engine.check(GenerateParams(RED, lora="none")).lora is None
    with pytest.raises(InvalidRequest, match="known values are .*noisy.*none"):
        engine.check(GenerateParams(RED, lora="sparkles"))
    with pytest.raises(InvalidRequest, match="lora_scale=3"):
        engine.check(GenerateParams(RED, lora="noisy", lora_scale=3))
    with pytest.raises(InvalidRequest, match="offers no LoRA styles"):
        engine.check(GenerateParams("a cat", model="tiny-flux1", lora="noisy"))
    with pytest.raises(UnsupportedCombination, match="tensor-parallel"):
        engine.check(GenerateParams(RED, lora="noisy", placement="tp", tp_size=2))


@pytest.mark.slow
def test_switching_styles_on_a_compiled_pipeline_compiles_nothing_and_matches_eager(fresh_manager, lora_dir):
    """none → outline → none → outline at 0.5 → noisy (the operator's): one compile, then no graph; each image is
    the eager pipeline's; the shipped outline style draws an outline."""
    from training.shapes.judge import is_outline

    engine = fresh_manager(default_model="tiny-shapes", lora_dir=lora_dir)
    steps = [(None, None), ("outline", None), (None, None), ("outline", 0.5), ("noisy", None)]
    compiled = [engine.generate(GenerateParams(RED, mode="compiled", seed=1, lora=lora, lora_scale=scale))
                for lora, scale in steps]
    eager = [engine.generate(GenerateParams(RED, mode="eager", seed=1, lora=lora, lora_scale=scale))
             for lora, scale in steps]
    # The first call compiles the shape (or finds it compiled by an earlier test: dynamo's graphs are per process).
    assert [r.new_graphs for r in compiled[1:]] == [0, 0, 0, 0]
    assert is_outline(compiled[1].image) and not is_outline(compiled[0].image)
    for (lora, scale), made, reference in zip(steps, compiled, eager):
        assert same_within_a_level(made.image, reference.image), (lora, scale)
    assert same_within_a_level(compiled[0].image, compiled[2].image)  # none is none again after a style
    assert not same_within_a_level(compiled[0].image, compiled[1].image)
    assert not same_within_a_level(compiled[1].image, compiled[3].image)  # the strength counts


@pytest.mark.slow
def test_a_style_added_later_that_the_slot_cannot_hold_is_refused_by_name(fresh_manager, tmp_path):
    root = tmp_path / "loras"
    lora_file(root / "tiny-shapes" / "noisy.safetensors", ("attn.to_q",), 4, seed=1)
    engine = fresh_manager(default_model="tiny-shapes", lora_dir=root)
    engine.generate(GenerateParams(RED, seed=1, lora="noisy"))  # the pipeline and its slot (outline's and noisy's)
    lora_file(root / "tiny-shapes" / "wide.safetensors", ("attn.to_q",), 16, seed=2)
    lora_file(root / "tiny-shapes" / "elsewhere.safetensors", ("proj_out",), 4, seed=3)
    with pytest.raises(InvalidRequest, match="rank 16 exceeds the rank 8"):  # outline's, the largest
        engine.generate(GenerateParams(RED, seed=1, lora="wide"))
    with pytest.raises(InvalidRequest, match="layer\\(s\\) the other styles do not"):
        engine.generate(GenerateParams(RED, seed=1, lora="elsewhere"))
    assert engine.generate(GenerateParams(RED, seed=1, lora="noisy")).image.size == (64, 64)  # still serving


@pytest.mark.inductor
@pytest.mark.slow
def test_a_precompiled_package_serves_every_style(fresh_manager, lora_dir, tmp_path, monkeypatch):
    """AOTInductor packages hold no weights: the slot's tensors are read live, so one package serves none, a style
    and its strengths."""
    engine = fresh_manager(default_model="tiny-shapes", lora_dir=lora_dir, cpu_compile_backend="inductor",
                           cache_dir=tmp_path / "cache")
    steps = [(None, None), ("noisy", None), ("noisy", 0.5), (None, None)]
    made = [engine.generate(GenerateParams(RED, mode="compiled", seed=1, lora=lora, lora_scale=scale))
            for lora, scale in steps]
    eager = [engine.generate(GenerateParams(RED, mode="eager", seed=1, lora=lora, lora_scale=scale))
             for lora, scale in steps]
    assert made[0].new_graphs == 1 and [r.new_graphs for r in made[1:]] == [0, 0, 0]
    for (lora, scale), image, reference in zip(steps, made, eager):
        assert same_within_a_level(image.image, reference.image), (lora, scale)
