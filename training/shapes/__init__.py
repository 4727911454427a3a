"""Training and evaluation of the embedded tiny-shapes model, whose weights live in `acceldemo/models/shapes/weights`.

Run from the repository root: `python -m training.shapes.train --out DIR`, `python -m training.shapes.evaluate`.
"""
