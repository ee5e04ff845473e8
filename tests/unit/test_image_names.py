"""Every image the manifests, samples and workflow name is one the product builds (no drift)."""

from __future__ import annotations

import re
from pathlib import Path

from rollfleet.api.common import SHIPPED_IMAGES

REPO = Path(__file__).resolve().parents[2]
# Images that are not Rollfleet's: the trainer container a user brings.
USERS_OWN = {"your-trainer-image"}


def named_images() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    files = [*REPO.glob("manifests/**/*.yaml"), *REPO.glob(".github/workflows/*.yml")]
    for path in files:
        for image in re.findall(r"(?:\bimage:\s*|\bdocker-image\s+|\s-t\s+)([\w./:-]+)", path.read_text()):
            found.setdefault(image, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_named_image_is_built_by_make_images() -> None:
    unknown = {
        image: files
        for image, files in named_images().items()
        if image not in SHIPPED_IMAGES and image not in USERS_OWN
    }
    assert unknown == {}


def test_the_gpu_sample_names_the_cuda_image() -> None:
    assert any("gpu-fleet.yaml" in f for f in named_images().get(SHIPPED_IMAGES[2], set()))
