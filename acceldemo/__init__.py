"""acceldemo: diffusers text-to-image on Trainium, TPU, CUDA and CPU, with compile caches made visible."""
from .config import Settings, apply_environment

apply_environment(Settings.from_env())
