"""acceldemo: diffusers text-to-image on Trainium, TPU, CUDA and CPU, with compile caches made visible.

Importing it changes nothing in the process: entry points (app.py, the CLI, a pool's worker) build their `Settings`
once and call `acceldemo.hardware.prepare_process` before torch loads.
"""
