"""Loading a catalog model from local files only: the embedded builders, a model folder, or the HF cache."""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from ..config import Settings
from ..errors import ModelUnavailable
from ..records import Quantization
from .caches import QUANTIZED_PREFIXES
from .catalog import ModelSpec

# Loading is not thread-safe, so pipelines for two devices of one process load one after the other. diffusers
# replaces its module with a lazy one while it is first imported (a second thread importing it then can get the
# half-made module: "module 'diffusers' has no attribute 'Flux2KleinPipeline'"), and transformers and accelerate
# build models under `init_empty_weights`, which swaps torch.nn.Module's parameter registration for the whole
# process while it runs (two loads at once can leave parameters on the meta device, for every later load too).
LOADING = threading.RLock()


def model_source(spec: ModelSpec, settings: Settings) -> str:
    """Where the weights are: a local folder, or a repo id that must already be in the HF cache."""
    with LOADING:  # an embedded model may be built now
        return _model_source(spec, settings)


def _model_source(spec: ModelSpec, settings: Settings) -> str:
    if spec.bundled:
        from .shapes import trained_model_dir

        return str(trained_model_dir())
    if spec.tiny_family:
        from .tiny import ensure_tiny_model

        return str(ensure_tiny_model(spec.tiny_family, settings.cache_dir / "models"))
    folder = model_dir_folder(spec, settings)
    return str(folder) if folder else spec.repo


def model_dir_folder(spec: ModelSpec, settings: Settings) -> Path | None:
    """The model's folder under ACCELDEMO_MODEL_DIR, if it is there."""
    if spec.repo and settings.model_dir and (settings.model_dir / spec.repo).is_dir():
        return settings.model_dir / spec.repo
    return None


def model_is_here(spec: ModelSpec, settings: Settings) -> bool:
    """Whether the model's files are on this host (embedded, in ACCELDEMO_MODEL_DIR or in the Hugging Face cache)."""
    return bool(spec.bundled or spec.tiny_family or model_dir_folder(spec, settings) or _in_hf_cache(spec))


def _in_hf_cache(spec: ModelSpec) -> bool:
    """Whether the Hugging Face cache holds the model (read only, never filled)."""
    from huggingface_hub import try_to_load_from_cache

    # A diffusers model's folder always holds model_index.json.
    return isinstance(try_to_load_from_cache(spec.repo, "model_index.json"), str)


def model_availability(spec: ModelSpec, settings: Settings) -> tuple[bool, str]:
    """Whether the model's weights are on this host, and where (or why not), without loading or building anything."""
    if spec.bundled:
        return True, "embedded: its trained weights ship with the app"
    if spec.tiny_family:
        return True, "embedded: built offline on first use"
    if model_dir_folder(spec, settings):
        return True, f"in ACCELDEMO_MODEL_DIR ({settings.model_dir / spec.repo})"
    if _in_hf_cache(spec):
        return True, "in the Hugging Face cache"
    if settings.download:
        return True, f"fetched from the Hugging Face Hub ({spec.repo}) on first use (ACCELDEMO_DOWNLOAD)"
    return False, (f"not on this host: not under ACCELDEMO_MODEL_DIR ({settings.model_dir or 'unset'}) and not in "
                   f"the Hugging Face cache; downloads are off (ACCELDEMO_DOWNLOAD=1 or --download fetches it, or "
                   f"`hf download {spec.repo}` on a connected host)")


def quantization_config(spec: ModelSpec, source: str, quantization: Quantization):
    """diffusers' pipeline-level quantization for the model: torchao weight-only int8 or fp8 for the transformer and
    the text encoders (each library's own TorchAoConfig), the rest in the model's dtype."""
    import diffusers
    import transformers

    # torchao logs a warning for each of its CUDA kernel libraries a CPU build cannot load; none is used here.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig

    kind = {Quantization.INT8: Int8WeightOnlyConfig, Quantization.FP8: Float8WeightOnlyConfig}[quantization]
    index = spec.family.pipeline_class().load_config(source, local_files_only=True)
    libraries = {"diffusers": diffusers, "transformers": transformers}
    mapping = {name: libraries[entry[0]].TorchAoConfig(kind()) for name, entry in index.items()
               if name.startswith(QUANTIZED_PREFIXES) and isinstance(entry, list) and entry[0] in libraries}
    return diffusers.PipelineQuantizationConfig(quant_mapping=mapping)


def load_pipeline(spec: ModelSpec, settings: Settings, quantization: Quantization = Quantization.NONE,
                  **components):
    """The model's diffusers pipeline in its recipe dtype (its transformer and text encoders at `quantization`),
    from local files; never downloads."""
    try:
        with LOADING:
            import torch

            source = model_source(spec, settings)
            pipeline_class = spec.family.pipeline_class()
            if quantization is not Quantization.NONE:
                components["quantization_config"] = quantization_config(spec, source, quantization)
            return pipeline_class.from_pretrained(source, dtype=getattr(torch, spec.dtype), local_files_only=True,
                                                  **components)
    except OSError as error:
        hf_home = os.environ.get("HF_HOME", str(Path.home() / ".cache" / "huggingface"))
        raise ModelUnavailable(
            f"model {spec.name!r} ({spec.repo}) is not on this host: not under ACCELDEMO_MODEL_DIR "
            f"({settings.model_dir or 'unset'}) and not in the Hugging Face cache ({hf_home}). "
            f"Downloads are off here: ACCELDEMO_DOWNLOAD=1 (or --download) lets the app fetch it, or fetch it on a "
            f"connected host with `hf download {spec.repo}` and copy it here. "
            f"({type(error).__name__}: {str(error)[:200]})") from None
