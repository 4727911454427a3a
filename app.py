"""Entry point of the demo (Hugging Face Space `app_file`): serves the page at http://127.0.0.1:7860."""
import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from acceldemo.ui.server import main  # noqa: E402

if __name__ == "__main__":
    main()
