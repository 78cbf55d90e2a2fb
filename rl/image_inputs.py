"""Screenshots as model inputs: a PNG -> a fixed grid of patches for the ``<image>`` slots.

An env's observation may carry a PNG (``Observation.image``, e.g. the browser's image mode);
the agent loop keeps it on the tool message, and ``ChatTemplate(image_tokens=n)`` writes ``n``
``<image>`` placeholders before that message's text. ``ImageInputs.for_messages`` turns the
messages' images, in order, into the ``[P, C*p*p]`` patches that ``MoETransformer(...,
image_patches=...)`` projects into those slots (``model/image.py``): every image is resized to
``height x width`` RGB so that each takes the same ``num_tokens`` slots.

Engines and the learner hand the model ``slot_patches(...)``: the n-th ``<image>`` id of a
sequence takes the sequence's n-th patch row; an ``<image>`` past the rows given (one the model
sampled itself: no screenshot behind it) takes a zero row. Both sides apply the same rule, so
their log-probs agree whatever the policy samples.
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

    @classmethod
    def for_patch_dim(cls, patch_dim: int) -> ImageInputs | None:
        """The inputs of a model with ``MoEConfig.image_patch_dim = patch_dim`` (square RGB patches
        of side p: 3·p·p features); None for a text-only model (0)."""
        if patch_dim == 0:
            return None
        side = round((patch_dim / 3) ** 0.5)
        if 3 * side * side != patch_dim:
            raise ValueError(f"config key 'model.image_patch_dim' = {patch_dim} is not 3·p·p (square RGB "
                             "patches of side p); allowed: 0 (text only), 192 (p=8), 768 (p=16), ...")
        return cls(patch=side, height=7 * side, width=10 * side)  # 70 slots per screenshot

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


def slot_patches(token_ids: list[int], patches: torch.Tensor | None, image_token_id: int, patch_dim: int,
                 start: int = 0, end: int | None = None) -> torch.Tensor:
    """``image_patches`` rows for the ``<image>`` ids in ``token_ids[start:end]``: the sequence's
    n-th ``<image>`` takes ``patches[n]``, one past the rows given takes zeros; [m, patch_dim]."""
    end = len(token_ids) if end is None else end
    k = token_ids[:start].count(image_token_id)
    m = token_ids[start:end].count(image_token_id)
    have = patches[k:k + m] if patches is not None else torch.zeros(0, patch_dim)
    if have.shape[0] < m:
        have = torch.cat([have, have.new_zeros(m - have.shape[0], patch_dim)])
    return have
