"""Write scikit-learn's handwritten digits (1,797 8×8 images, shipped inside scikit-learn) as PNG
files in one folder per class, the ImageFolder layout diloco reads:

    python examples/digits/prepare.py runs/digits/images      # then: diloco run --config examples/digits/run.toml
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits


def prepare(out: Path) -> int:
    digits = load_digits()
    for i, (image, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        folder = out / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        # 0..16 intensities to 0..255 grey levels, written losslessly
        Image.fromarray((image * 255 / 16).round().astype(np.uint8), mode="L").save(folder / f"{i:04d}.png")
    return len(digits.target)


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/digits/images")
    print(f"{prepare(target)} images in {target}")
