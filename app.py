"""Entry point of the demo (Hugging Face Space `app_file`). Until the web UI lands, a CLI run on the embedded model."""
import sys

from acceldemo.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["generate", "--prompt", "a red circle on a blue background, top left",
                                   "--mode", "compiled", "--size", "64x64", "--size", "128x64", "--size", "64x64"]))
