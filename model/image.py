"""Optional image input: patches → one linear projection → tokens in the text sequence.

An image enters the sequence as one `<image>` placeholder id (`MoEConfig.image_token_id`, the byte
tokenizer's `<image>`) per patch; the model replaces those positions' embeddings with
`image_proj(patch)`, in reading order over the batch, and everything after is the same transformer.
`patchify` cuts a [C, H, W] image into flattened p×p patches (row-major, channels innermost per
pixel block); H and W must divide by p. Shapes: P patches, F = C·p·p patch features, H hidden.
"""

from __future__ import annotations

import torch
from torch import nn


def patchify(image_CHW: torch.Tensor, patch: int) -> torch.Tensor:
    """[C, H, W] → [P, C·patch·patch], P = (H/patch)·(W/patch), patches in row-major order."""
    C, H, W = image_CHW.shape
    if H % patch or W % patch:
        raise ValueError(f"image of size {H}x{W} does not split into {patch}x{patch} patches")
    x = image_CHW.reshape(C, H // patch, patch, W // patch, patch)
    return x.permute(1, 3, 0, 2, 4).reshape((H // patch) * (W // patch), C * patch * patch)


class ImageProjector(nn.Module):
    """`proj: Linear(F, H)`; `merge` writes projected patches over the placeholder embeddings."""

    def __init__(self, patch_dim: int, hidden_size: int, image_token_id: int) -> None:
        super().__init__()
        self.image_token_id = image_token_id
        self.proj = nn.Linear(patch_dim, hidden_size, bias=False)

    def merge(self, x_BTH: torch.Tensor, input_ids: torch.Tensor, patches_PF: torch.Tensor) -> torch.Tensor:
        """x with the embedding of the n-th `<image>` token (row-major over [B, T]) replaced by
        proj(patches[n]); ValueError unless there is exactly one patch per placeholder."""
        slots_BT = input_ids == self.image_token_id
        if patches_PF.dim() != 2 or patches_PF.shape[0] != int(slots_BT.sum()):
            raise ValueError(f"image_patches must be [num <image> tokens = {int(slots_BT.sum())}, "
                             f"{self.proj.in_features}], got {tuple(patches_PF.shape)}")
        x_BTH = x_BTH.clone()
        x_BTH[slots_BT] = self.proj(patches_PF.to(x_BTH.dtype))
        return x_BTH
