"""Optional image input: patches → linear projection → the `<image>` token positions."""

from __future__ import annotations

import pytest
import torch

from jointrl.model import MoEConfig, MoETransformer
from jointrl.model.image import patchify
from jointrl.model.tokenizer import ByteTokenizer

CFG = MoEConfig.preset("tiny_hybrid", image_patch_dim=3 * 4 * 4)


def test_patchify_order_and_shape():
    img = torch.arange(3 * 8 * 12, dtype=torch.float32).reshape(3, 8, 12)
    patches = patchify(img, 4)
    assert patches.shape == (6, 48)
    assert torch.equal(patches[1].reshape(3, 4, 4), img[:, 0:4, 4:8])   # second patch: top row, middle
    assert torch.equal(patches[3].reshape(3, 4, 4), img[:, 4:8, 0:4])
    with pytest.raises(ValueError, match="patches"):
        patchify(img, 5)


def test_image_tokens_take_the_projected_patches_and_train_the_projection():
    assert CFG.image_token_id == ByteTokenizer().special_ids["<image>"]
    model = MoETransformer.from_config(CFG, seed=0)
    tok = ByteTokenizer()
    patches = patchify(torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(0)), 4)  # 4 patches
    ids = torch.tensor([tok.encode("look: ") + [CFG.image_token_id] * 4 + tok.encode(" what?")])
    out = model(ids, image_patches=patches)
    with torch.no_grad():
        other = model(ids, image_patches=patches.flip(0)).logits
        text_only = model(ids).logits  # placeholders keep their token embedding
    n = len(tok.encode("look: "))
    assert (out.logits[:, :n] - other[:, :n]).abs().max() < 1e-6  # causal: nothing before the image changes
    assert (out.logits[:, n:] - other[:, n:]).abs().max() > 1e-4
    assert (out.logits[:, n:] - text_only[:, n:]).abs().max() > 1e-4
    out.logits.sum().backward()
    assert model.model.image_projector.proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="image_patches"):
        model(ids, image_patches=patches[:3])
    with pytest.raises(ValueError, match="image_patch_dim"):
        MoETransformer.from_config(MoEConfig.preset("tiny_hybrid"))(ids, image_patches=patches)
