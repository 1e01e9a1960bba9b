"""The digits' preprocess (data.preprocess), run by data workers: no torch needed here.

Each 8×8 grey image becomes float32 pixels [1, 8, 8] scaled to [0, 1], and, since a run reads its
data once, four more copies shifted by one pixel up, down, left and right: five views of each
digit, the same on every data worker (the shifts are fixed, not random).
"""

from __future__ import annotations

import numpy as np

SHIFTS = ((0, 0), (1, 0), (-1, 0), (0, 1), (0, -1))


def pixels(records: list[dict]) -> dict[str, np.ndarray]:
    images = np.stack([r["image"] for r in records]).astype(np.float32) / 255.0  # [N, 8, 8]
    labels = np.array([r["label"] for r in records], dtype=np.int64)
    views = [np.roll(images, shift, axis=(1, 2)) for shift in SHIFTS]
    return {
        "pixels": np.concatenate(views)[:, None],  # [5N, 1, 8, 8]
        "label": np.tile(labels, len(SHIFTS)),
    }
