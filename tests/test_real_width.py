"""The real transformers at their real width, one block of each kind, random weights, bf16, on this CPU: the closest
the suite comes to the seeds' recipes without weights. Built from the configs in the repository
(acceldemo/models/configs), run eager, compiled at several shapes (one graph per key `ModelSpec.graph_key` predicts),
compiled per block, as an AOTInductor package built then loaded, and sharded over two torchrun ranks of the pool."""
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from acceldemo.config import Settings
from acceldemo.engine.validation import check_request
from acceldemo.executors.artifacts import ArtifactStore, PrecompiledTransformer
from acceldemo.executors.local import LocalExecutor
from acceldemo.executors.pool import PoolExecutor
from acceldemo.executors.recipe import run_pipeline
from acceldemo.hardware import HardwareRegistry
from acceldemo.models import real_configs
from acceldemo.models.catalog import get_model
from acceldemo.records import DeviceSet, GenerateParams, Placement, Shape, no_progress

pytestmark = pytest.mark.slow
SETTINGS = Settings.from_env()
HARDWARE = HardwareRegistry(SETTINGS)
# One block of each kind; SD 3.5's first layer with its extra self-attention (dual_attention_layers) and a plain one.
SHORT = {"flux2-klein-4b": dict(num_layers=1, num_single_layers=1),
         "flux1-schnell": dict(num_layers=1, num_single_layers=1),
         "sd3.5-medium": dict(num_layers=2, dual_attention_layers=[0])}
TEXT_TOKENS = 32
# Compiled at three sizes, two of one token count: small ones (64 and 128 image tokens for FLUX), as the graph keys
# depend on token counts and latent sizes, not on how large they are; the width is the real one.
SHAPES = (Shape(128, 128), Shape(256, 128), Shape(128, 256))


def short_transformer(name: str):
    """The model's transformer at its real width with few blocks, seeded random weights in bf16."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return real_configs.build(name, "transformer", **SHORT[name]).eval()
    finally:
        torch.set_default_dtype(previous)


def inputs(name: str, transformer, shape: Shape) -> dict:
    """The transformer's keyword inputs at an image size, as its pipeline makes them (latents packed 2x2 for FLUX,
    the VAE's 8x downsampling), seeded."""
    config = transformer.config
    generator = torch.Generator().manual_seed(shape.width + shape.height)
    rand = lambda *size: torch.randn(*size, generator=generator).to(torch.bfloat16)  # noqa: E731
    h, w = shape.height // 8, shape.width // 8
    timestep = torch.tensor([0.5], dtype=torch.bfloat16)
    if name == "sd3.5-medium":
        return dict(hidden_states=rand(1, config.in_channels, h, w),
                    encoder_hidden_states=rand(1, TEXT_TOKENS, config.joint_attention_dim),
                    pooled_projections=rand(1, config.pooled_projection_dim), timestep=timestep * 1000,
                    return_dict=False)
    tokens = (h // 2) * (w // 2)
    axes = len(config.axes_dims_rope)
    rows, cols = torch.meshgrid(torch.arange(h // 2), torch.arange(w // 2), indexing="ij")
    img_ids = torch.zeros(tokens, axes)
    img_ids[:, axes - 2], img_ids[:, axes - 1] = rows.flatten().float(), cols.flatten().float()
    common = dict(hidden_states=rand(1, tokens, config.in_channels),
                  encoder_hidden_states=rand(1, TEXT_TOKENS, config.joint_attention_dim), timestep=timestep,
                  img_ids=img_ids, txt_ids=torch.zeros(TEXT_TOKENS, axes), return_dict=False)
    if name == "flux1-schnell":
        return {**common, "pooled_projections": rand(1, config.pooled_projection_dim)}
    return common


@pytest.fixture(scope="module", params=list(SHORT))
def model(request):
    name = request.param
    return SimpleNamespace(name=name, spec=get_model(name), transformer=short_transformer(name))


def graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@torch.no_grad()
def test_eager_forward_at_the_real_width(model):
    transformer = model.transformer
    wide = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    assert wide == {"flux2-klein-4b": 3072, "flux1-schnell": 3072, "sd3.5-medium": 1536}[model.name]
    out = transformer(**inputs(model.name, transformer, Shape(256, 256)))[0]
    expected = (1, 16 * 16, transformer.config.in_channels) if model.spec.packed_latents else (1, 16, 32, 32)
    assert tuple(out.shape) == expected and out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@torch.no_grad()
def test_compiled_builds_one_graph_per_key_the_catalog_predicts(model):
    torch._dynamo.reset()
    transformer = model.transformer  # the last test of the module to use it: it stays compiled
    eager = {shape: transformer(**inputs(model.name, transformer, shape))[0] for shape in SHAPES}
    transformer.compile(backend="aot_eager", fullgraph=True, dynamic=False)
    before, outs = graphs(), {}
    for shape in (*SHAPES, SHAPES[0]):  # the first shape revisited last: it compiles nothing more
        outs[shape] = transformer(**inputs(model.name, transformer, shape))[0]
    keys = {model.spec.graph_key(shape, 1, 0.0) for shape in SHAPES}
    assert graphs() - before == len(keys)  # packed FLUX latents: 512x256 and 256x512 share a graph, SD3 not
    assert len(keys) == (2 if model.spec.packed_latents else 3)
    for shape in SHAPES:
        assert torch.allclose(outs[shape].float(), eager[shape].float(), atol=0.05, rtol=0.05)


@torch.no_grad()
def test_regional_compiles_the_repeated_block_where_there_is_one(model):
    torch._dynamo.reset()
    transformer = short_transformer(model.name)
    shape = Shape(128, 128)
    eager = transformer(**inputs(model.name, transformer, shape))[0]
    if not model.spec.repeated_blocks:
        with pytest.raises(ValueError):
            transformer.compile_repeated_blocks(backend="aot_eager", fullgraph=True, dynamic=False)
        return
    transformer.compile_repeated_blocks(backend="aot_eager", fullgraph=True, dynamic=False)
    before = graphs()
    out = transformer(**inputs(model.name, transformer, shape))[0]
    assert graphs() - before >= 2  # the double-stream and the single-stream block
    assert torch.allclose(out.float(), eager.float(), atol=0.05, rtol=0.05)


@pytest.mark.inductor
@torch.no_grad()
def test_an_aotinductor_package_is_built_once_then_loaded(tmp_path):
    """FLUX.1's short transformer through the app's precompiled path: built and saved at the first call, loaded
    (not compiled) by a fresh stand-in for a restarted app, the same output."""
    settings = dataclasses.replace(SETTINGS, cache_dir=tmp_path)
    cpu = HARDWARE.get("cpu")
    transformer = short_transformer("flux1-schnell")
    given = inputs("flux1-schnell", transformer, Shape(256, 256))
    eager = transformer(**given)[0]
    first = PrecompiledTransformer.install(SimpleNamespace(transformer=transformer), ArtifactStore.of(settings),
                                           "flux1-schnell", cpu)
    built = transformer(**given)[0]
    assert first.events["built"] == 1 and torch.allclose(built.float(), eager.float(), atol=0.05, rtol=0.05)
    restarted = short_transformer("flux1-schnell")  # the same seeded weights, another module
    second = PrecompiledTransformer.install(SimpleNamespace(transformer=restarted), ArtifactStore.of(settings),
                                            "flux1-schnell", cpu)
    loaded = restarted(**given)[0]
    assert (second.events["loaded"], second.events["built"]) == (1, 0)
    assert torch.equal(loaded, built)


def short_pipeline(folder) -> None:
    """FLUX.1 [schnell] as a pipeline folder: the short real-width transformer, its real VAE, CLIP-L and T5-XXL at
    their real widths with one layer each (the pipeline reads their last states only), the tiny models'
    byte-level tokenizers; saved in bf16 as the app loads a model from ACCELDEMO_MODEL_DIR."""
    import diffusers

    from acceldemo.models.tiny import _clip_tokenizer, _t5_tokenizer

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            pipe = diffusers.FluxPipeline(
                transformer=real_configs.build("flux1-schnell", "transformer", **SHORT["flux1-schnell"]),
                vae=real_configs.build("flux1-schnell", "vae"),
                text_encoder=real_configs.build("flux1-schnell", "text_encoder", num_hidden_layers=1),
                text_encoder_2=real_configs.build("flux1-schnell", "text_encoder_2", num_layers=1),
                tokenizer=_clip_tokenizer(), tokenizer_2=_t5_tokenizer(),
                scheduler=diffusers.FlowMatchEulerDiscreteScheduler.from_config(
                    real_configs.scheduler_config("flux1-schnell")))
    finally:
        torch.set_default_dtype(previous)
    pipe.save_pretrained(folder)


def _cpu_has_bf16_units() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX): without them oneDNN's bf16 convolutions take
    minutes each (a 512-channel 3x3 conv at 64x64: 75 s against 0.25 s in float32, seen on an AVX2-only EPYC)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@pytest.mark.skipif(not _cpu_has_bf16_units(), reason="the real-width VAE decodes in bf16 on every rank and once "
                    "more alone: past the pool's 900 s on a CPU without bf16 units (AVX512-BF16 or AMX)")
@pytest.mark.timeout(1800)
def test_tensor_parallel_over_two_pool_ranks_draws_the_one_process_image(tmp_path):
    models = tmp_path / "models"
    short_pipeline(models / "test" / "flux1-schnell-short")
    settings = dataclasses.replace(SETTINGS, model_dir=models)
    spec = dataclasses.replace(get_model("flux1-schnell"), name="flux1-schnell-short",
                               repo="test/flux1-schnell-short", max_sequence_length=TEXT_TOKENS)
    asked = GenerateParams(prompt="a red circle on a blue background", model="flux1-schnell", hardware="cpu",
                           placement="tp", tp_size=2, resolution="256x256", steps=2, seed=3)
    # The request keeps the catalog's name (it is checked against the catalog) with the short model's text length.
    request = dataclasses.replace(check_request(asked, settings, HardwareRegistry(settings)), graph=spec.graph_rule)
    devices = DeviceSet("cpu", (0,))
    pool = PoolExecutor(settings, HardwareRegistry(settings), timeout_s=900)
    try:
        sharded = pool.load(request.key(devices), spec, no_progress)
        out = sharded.run(request, False, no_progress, output_type="np")
    finally:
        pool.close()
    assert all(0 < c.sharded < c.parameters for rank in sharded.sharded for c in rank)
    local_key = dataclasses.replace(request.key(devices), placement=Placement.DEVICE, tp_size=1)
    alone = LocalExecutor(settings, HardwareRegistry(settings)).load(local_key, spec, no_progress)
    expected = run_pipeline(alone.prepared, HARDWARE.get("cpu"), request, False, no_progress, output_type="np").images[0]
    image = out.images[0]
    assert image.shape == (256, 256, 3) and expected.std() > 0.01
    assert np.abs(image - expected).mean() * 255 < 2  # bf16 all-reduces add their rounding
