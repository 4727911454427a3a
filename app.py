"""Entry point of the demo (Hugging Face Space `app_file`): serves the page at http://127.0.0.1:7860."""
import atexit
import os
import shutil
import signal
import sys
import tempfile

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
if "GRADIO_TEMP_DIR" not in os.environ:
    # Generated images go to a private (0700) folder of this process, removed when it exits.
    os.environ["GRADIO_TEMP_DIR"] = tempfile.mkdtemp(prefix="acceldemo-images-")
    atexit.register(shutil.rmtree, os.environ["GRADIO_TEMP_DIR"], True)

from acceldemo.ui.server import main  # noqa: E402

if __name__ == "__main__":
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again for the handler it found: make that an
    # exit that runs the atexit clean-ups (the image folder, any worker pool) instead of a kill that skips them.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    main()
