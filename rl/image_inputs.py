"""Screenshots as model inputs: a PNG -> a fixed grid of patches for the ``<image>`` slots.

An env's observation may carry a PNG (``Observation.image``, e.g. the browser's image mode);
the agent loop keeps it on the tool message, and ``ChatTemplate(image_tokens=n)`` writes ``n``
``<image>`` placeholders before that message's text. ``ImageInputs.for_messages`` turns the
messages' images, in order, into the ``[P, C*p*p]`` patches that ``MoETransformer(...,
image_patches=...)`` projects into those slots (``model/image.py``): every image is resized to
``height x width`` RGB so that each takes the same ``num_tokens`` slots.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import torch

from jointrl.envs.base import Message
from jointrl.model.image import patchify


@dataclass(frozen=True)
class ImageInputs:
    patch: int = 16
    height: int = 112
    width: int = 160

    def __post_init__(self) -> None:
        if self.patch < 1 or self.height % self.patch or self.width % self.patch:
            raise ValueError(f"image height {self.height} and width {self.width} must be multiples of patch {self.patch}")

    @property
    def num_tokens(self) -> int:
        """``<image>`` slots per image (``ChatTemplate(image_tokens=...)``)."""
        return (self.height // self.patch) * (self.width // self.patch)

    @property
    def patch_dim(self) -> int:
        """Features per patch (``MoEConfig.image_patch_dim``)."""
        return 3 * self.patch * self.patch

    def patches(self, png: bytes) -> torch.Tensor:
        """[num_tokens, patch_dim] in [0, 1], row-major patches of the resized RGB image."""
        from PIL import Image  # Pillow: the "browser" extra

        img = Image.open(io.BytesIO(png)).convert("RGB").resize((self.width, self.height), Image.BILINEAR)
        pixels = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).reshape(self.height, self.width, 3)
        return patchify(pixels.permute(2, 0, 1).float() / 255.0, self.patch)

    def for_messages(self, messages: list[Message]) -> torch.Tensor | None:
        """The patches of every message image, in order (None when there is none)."""
        shots = [self.patches(m.image) for m in messages if m.image is not None]
        return torch.cat(shots) if shots else None
