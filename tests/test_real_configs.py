"""The real models' configs shipped in the repository: each names its source, builds on the meta device, and the
catalog's bytes, heads, widths and token counts are what the configs give; the planner answers for hosts this machine
is not, and the seeds' recipes hold against it."""
import json

import pytest

from acceldemo.cli import main as cli_main
from acceldemo.config import Settings
from acceldemo.engine.planning import named_host, plan
from acceldemo.hardware import host_kinds
from acceldemo.models import real_configs
from acceldemo.models.catalog import CATALOG
from acceldemo.models.families import PipelineFamily
from acceldemo.records import Mode, Placement, Shape

REAL = [name for name, spec in CATALOG.items() if spec.repo]
SETTINGS = Settings.from_env()
# Published sizes, independent of the configs (model cards and the models' own names), in parameters.
PUBLISHED = {("flux1-schnell", "transformer"): 12e9,  # "a 12 billion parameter rectified flow transformer"
             ("sd3.5-medium", "transformer"): 2.5e9,  # "2.5 billion parameters" (MMDiT-X)
             ("flux2-klein-4b", "text_encoder"): 4.0e9,  # Qwen3-4B
             ("flux2-dev", "transformer"): 32e9,  # "a 32 billion parameter rectified flow transformer"
             ("flux2-dev", "text_encoder"): 24e9}  # Mistral Small 3.1/3.2 24B


@pytest.fixture(scope="module")
def counted() -> dict[str, dict[str, int]]:
    """Every real model's components built from its configs on the meta device, their stored values counted."""
    return {name: real_configs.count_parameters(name) for name in REAL}


def test_every_real_model_ships_its_configs_each_naming_its_source():
    for name in REAL:
        assert real_configs.has_configs(name), name
        index = real_configs.model_index(name)
        assert index["_class_name"] == CATALOG[name].family
        assert len(real_configs.source(name)) > 40
        for component in real_configs.components(name):
            assert len(real_configs.source(name, component)) > 40, (name, component)
        folder = real_configs.CONFIGS / name
        for path in folder.rglob("*.json"):
            assert "_source" in json.loads(path.read_text()), path


def test_the_catalogs_bytes_are_the_configs_parameters_in_its_dtype(counted):
    for name in REAL:
        spec = CATALOG[name]
        assert real_configs.parameter_counts(name) == counted[name], f"{name}: python -m training.real_configs"
        assert spec.component_bytes == {component: count * 2 for component, count in counted[name].items()}
    for (name, component), published in PUBLISHED.items():
        assert abs(counted[name][component] / published - 1) < 0.03, (name, component, counted[name][component])
    # Whole-model sizes the placement rests on, in bf16.
    assert round(CATALOG["flux2-dev"].component_bytes["transformer"] / 1e9) == 64
    assert round(CATALOG["flux1-schnell"].weight_bytes / 1e9, 1) == 33.7
    assert round(CATALOG["sd3.5-medium"].weight_bytes / 1e9, 1) == 16.3


def test_heads_widths_and_tokens_agree_between_the_configs_and_the_catalog():
    for name in REAL:
        spec = CATALOG[name]
        transformer = real_configs.component_config(name, "transformer")
        vae = real_configs.component_config(name, "vae")
        assert spec.attention_heads == transformer["num_attention_heads"]
        # Image tokens per shape: the VAE's downsampling times the 2x2 packing (or SD3's 2x2 patches).
        scale = 2 ** (len(vae["block_out_channels"]) - 1) * 2
        assert spec.granularity == scale == 16
        if spec.packed_latents:
            packed = vae["latent_channels"] * 4
            assert transformer["in_channels"] == packed
            assert spec.graph_key(Shape(1024, 768), 1, spec.guidance)[0] == (1024 // scale) * (768 // scale)
        else:
            assert transformer["in_channels"] == vae["latent_channels"] and transformer["patch_size"] == 2
        texts = {c: real_configs.component_config(name, c) for c in real_configs.components(name)
                 if c.startswith("text_encoder")}
        for component in texts:
            heads, kv = real_configs.attention_heads(name, component)
            if component in spec.tp_components:
                assert spec.shard_heads[component] == (heads, kv)
        widths = {c: config.get("text_config", config).get("hidden_size") or config.get("d_model")
                  for c, config in texts.items()}
        if spec.family.flux2:  # three stacked hidden states of the LLM
            assert transformer["joint_attention_dim"] == 3 * widths["text_encoder"]
        elif spec.family is PipelineFamily.FLUX1:
            assert transformer["joint_attention_dim"] == widths["text_encoder_2"]
            assert transformer["pooled_projection_dim"] == texts["text_encoder"]["projection_dim"]
        else:
            assert transformer["joint_attention_dim"] == widths["text_encoder_3"]
            assert transformer["pooled_projection_dim"] == sum(texts[c]["projection_dim"]
                                                               for c in ("text_encoder", "text_encoder_2"))


@pytest.mark.parametrize("host", sorted(host_kinds()))
def test_every_degree_the_planner_offers_divides_what_it_shards(host):
    kind = named_host(host)
    for name in REAL:
        planned = plan(CATALOG[name], kind, SETTINGS)
        divisors = [count for _, count in CATALOG[name].shard_divisors()]
        for size in (*planned.tp_sizes, planned.proposal.tp_size):
            assert all(count % size == 0 for count in divisors), (name, host, size)
        assert planned.weights_per_device * 1.2 <= planned.memory_bytes or planned.proposal.tp_size > kind.devices


def test_the_seed_recipes_hold_against_the_planner():
    klein = plan(CATALOG["flux2-klein-4b"], named_host("trn2.48xlarge"), SETTINGS)
    assert (klein.proposal.placement, klein.mode) == (Placement.DEVICE, Mode.COMPILED)  # fits one NeuronCore
    schnell = plan(CATALOG["flux1-schnell"], named_host("v6e-1"), SETTINGS)
    assert (schnell.proposal.placement, schnell.mode) == (Placement.OFFLOAD, Mode.REGIONAL)
    assert "offload hooks cannot be traced" in next(o.reason for o in schnell.modes if o.name is Mode.COMPILED)
    sd3 = plan(CATALOG["sd3.5-medium"], named_host("v6e-1"), SETTINGS)
    assert (sd3.proposal.placement, sd3.mode) == (Placement.DEVICE, Mode.COMPILED)  # compiled whole
    for host, degree in (("v6e-8", 4), ("trn2.48xlarge", 8), ("v5e-8", 8)):
        dev = plan(CATALOG["flux2-dev"], named_host(host), SETTINGS)
        assert (dev.proposal.placement, dev.degrees) == (Placement.TP, {"tp": degree, "cfg": 1, "cp": 1}), host
    assert plan(CATALOG["flux1-schnell"], named_host("h100"), SETTINGS).proposal.placement is Placement.DEVICE


def test_plan_on_the_command_line(capsys):
    assert cli_main(["plan", "--host", "trn2.48xlarge", "--model", "flux2-dev", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["placement"] == "tp" and facts["degrees"] == {"tp": 8, "cfg": 1, "cp": 1}
    assert facts["weights_gb_per_device"] == 14.06 and facts["cp_sizes"] == [] and not facts["cfg"]  # cp holds 111 GB per rank
    assert cli_main(["plan", "--hardware", "neuron", "--devices", "8", "--device-memory", "24GiB"]) == 0
    out = capsys.readouterr().out
    assert "flux2-dev on 8 x 26 GB neuron" in out and "tensor parallel over 8" in out
    assert cli_main(["plan", "--host", "list"]) == 0 and "v6e-4" in capsys.readouterr().out
    assert cli_main(["plan", "--host", "v9z-4"]) == 2
    assert "host='v9z-4' is not accepted: known values are a100x8" in capsys.readouterr().err
    assert cli_main(["plan", "--hardware", "cuda", "--devices", "2", "--device-memory", "lots"]) == 2
    assert "device_memory='lots' is not accepted" in capsys.readouterr().err
