"""Entry point of the demo (Hugging Face Space `app_file`): serves the page at http://127.0.0.1:7860."""
import atexit
import os
import shutil
import tempfile

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
if "GRADIO_TEMP_DIR" not in os.environ:
    # Generated images go to a private (0700) folder of this process, removed when it exits.
    os.environ["GRADIO_TEMP_DIR"] = tempfile.mkdtemp(prefix="acceldemo-images-")
    atexit.register(shutil.rmtree, os.environ["GRADIO_TEMP_DIR"], True)

from acceldemo.ui.server import main  # noqa: E402

if __name__ == "__main__":
    main()
