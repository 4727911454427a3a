"""Held-out captions and the judge as a program, for measurements made outside the training code (the app's bench
does not import it): `python -m training.shapes.score captions N` prints N held-out captions as JSON;
`python -m training.shapes.score judge DIR` reads DIR/captions.json and every DIR/<set>/<i>.png, and prints each
set's accuracy as JSON: per part over the captions that ask for it, and `scene` (every part asked for right)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from PIL import Image

from acceldemo.models.shapes.phrasing import Caption

from .dataset import held_out_captions
from .evaluate import accuracy
from .judge import judge

# The families whose captions name every part (a scene is judged on all four), then the rest.
FAMILY = "template"


def captions(count: int) -> list[dict]:
    return [dataclasses.asdict(caption) for caption in held_out_captions(FAMILY, count)]


def scores(folder: Path) -> dict[str, dict[str, float | None]]:
    asked = [Caption(**entry) for entry in json.loads((folder / "captions.json").read_text())]
    found = {}
    for images_dir in sorted(p for p in folder.iterdir() if p.is_dir()):
        images = [Image.open(images_dir / f"{i}.png").convert("RGB") for i in range(len(asked))]
        scene = sum(all(judge(image).matches(caption).values()) for image, caption in zip(images, asked))
        found[images_dir.name] = {**accuracy(images, asked), "scene": scene / len(asked)}
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.shapes.score", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("captions").add_argument("count", type=int)
    commands.add_parser("judge").add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    print(json.dumps(captions(args.count) if args.command == "captions" else scores(args.folder)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
