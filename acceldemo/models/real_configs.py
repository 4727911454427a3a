"""The real models' configs, kept in the repository (`configs/<catalog name>/`, each file naming its `_source`): the
catalog derives their weight bytes and head counts from them, and tests build their components from them (on the
meta device, or at their real width with few blocks)."""
from __future__ import annotations

import json
from functools import cache
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent / "configs"
# Components whose weights count (the pipeline's modules; tokenizers and the scheduler hold none).
WEIGHTED = ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3", "vae")
PARAMETERS = "parameters.json"


def has_configs(name: str) -> bool:
    return (CONFIGS / name / "model_index.json").is_file()


def _public(data: dict) -> dict:
    """A config without its source note (diffusers and transformers take every other key as theirs)."""
    return {key: value for key, value in data.items() if key != "_source"}


@cache
def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def model_index(name: str) -> dict:
    return _public(_read(CONFIGS / name / "model_index.json"))


def component_config(name: str, component: str) -> dict:
    return _public(_read(CONFIGS / name / component / "config.json"))


def scheduler_config(name: str) -> dict:
    return _public(_read(CONFIGS / name / "scheduler" / "scheduler_config.json"))


def source(name: str, component: str | None = None) -> str:
    """Where a config file's values come from, as the file says."""
    path = CONFIGS / name / (f"{component}/config.json" if component else "model_index.json")
    return _read(path)["_source"]


def components(name: str) -> dict[str, tuple[str, str]]:
    """The model's weighted components: name -> (library, class)."""
    return {component: tuple(entry) for component, entry in model_index(name).items()
            if component in WEIGHTED and isinstance(entry, list) and entry[0]}


def build(name: str, component: str, **overrides):
    """The component as an nn.Module from its config (`overrides` change fields, e.g. fewer blocks), with random
    weights where the caller's device and dtype context put them (`torch.device("meta")`: none at all)."""
    library, class_name = components(name)[component]
    config = {**component_config(name, component), **overrides}
    if library == "diffusers":
        import diffusers

        return getattr(diffusers, class_name).from_config(config)
    import transformers

    settings = transformers.AutoConfig.for_model(**config)
    return getattr(transformers, class_name)(settings)


def count_parameters(name: str) -> dict[str, int]:
    """Each weighted component's saved values (`weights.saved_tensors`), built on the meta device (nothing
    allocated)."""
    import torch

    from .weights import saved_tensors

    with torch.device("meta"):
        return {component: sum(t.numel() for t in saved_tensors(build(name, component)))
                for component in components(name)}


def parameter_counts(name: str) -> dict[str, int]:
    """The counts `count_parameters` gives, as written beside the configs (`python -m training.real_configs`)."""
    return dict(_read(CONFIGS / name / PARAMETERS)["parameters"])


def component_bytes(name: str, dtype: str) -> dict[str, int]:
    """Weight bytes per component in `dtype`: the parameter counts times the dtype's size."""
    from .weights import DTYPE_BYTES

    size = DTYPE_BYTES[dtype]
    return {component: count * size for component, count in parameter_counts(name).items()}


def attention_heads(name: str, component: str) -> tuple[int, int]:
    """(query heads, key/value heads) of a component's attention: what a tensor-parallel degree must divide."""
    config = component_config(name, component)
    config = config.get("text_config", config)
    heads = config.get("num_attention_heads") or config.get("num_heads")
    return heads, config.get("num_key_value_heads") or heads
