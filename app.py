"""Entry point of the demo (Hugging Face Space `app_file`): serves the page at http://127.0.0.1:7860 — the same as
`python -m acceldemo serve`, with the same flags."""
import sys

from acceldemo.cli.serve import main, prepare_environment

# Before anything imports Gradio: no analytics, generated images in a private folder removed at exit.
prepare_environment()

if __name__ == "__main__":
    sys.exit(main())
