"""Screenshots as model inputs: message image -> <image> slots in the template -> patches."""

import io

import pytest
import torch

from jointrl.envs.base import Message
from jointrl.model.chat_template import ChatTemplate
from jointrl.rl.image_inputs import ImageInputs

PIL = pytest.importorskip("PIL.Image", reason="Pillow (the 'browser' extra) turns PNGs into patches")


def png(color, size=(64, 48)):
    buf = io.BytesIO()
    PIL.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def test_template_writes_one_slot_per_patch_and_the_patches_line_up():
    images = ImageInputs(patch=8, height=16, width=32)
    assert (images.num_tokens, images.patch_dim) == (8, 192)
    tpl = ChatTemplate(image_tokens=images.num_tokens)
    slot = tpl.tok.special_ids["<image>"]
    msgs = [Message("user", "look"), Message("tool", "page one", name="goto", image=png((255, 0, 0))),
            Message("tool", "page two", name="goto", image=png((0, 0, 255), (640, 448)))]
    ids = tpl.render(msgs)
    assert ids.count(slot) == 16
    first = ids.index(slot)  # the slots open the tool message, before its text
    assert ids[first - 5:first] == tpl.tok.encode("tool\n") and ids[first + 8:first + 16] == tpl.tok.encode("page one")
    patches = images.for_messages(msgs)
    assert patches.shape == (16, 192)
    red, blue = patches[:8].reshape(8, 3, 8, 8), patches[8:].reshape(8, 3, 8, 8)
    assert torch.allclose(red[:, 0], torch.ones(8, 8, 8)) and torch.allclose(red[:, 2], torch.zeros(8, 8, 8))
    assert torch.allclose(blue[:, 2], torch.ones(8, 8, 8)) and torch.allclose(blue[:, 0], torch.zeros(8, 8, 8))
    assert images.for_messages(msgs[:1]) is None


def test_a_text_only_template_reads_just_the_text():
    msg = Message("tool", "page", name="goto", image=png((1, 2, 3)))
    assert ChatTemplate().render([msg]) == ChatTemplate().render([Message("tool", "page", name="goto")])


def test_bad_grid_is_refused():
    with pytest.raises(ValueError, match="multiples of patch"):
        ImageInputs(patch=16, height=100, width=160)


def test_a_model_with_image_input_gets_screenshots_in_training_and_eval_episodes():
    """`model.image_patch_dim` alone turns it on: the env workers' and eval's template and agent loop."""
    from jointrl.rl.config import load_config
    from jointrl.rl.env_worker import episode_setup

    template, agent_cfg = episode_setup(load_config())
    assert template.image_tokens == 0 and agent_cfg.images is None  # text-only default
    template, agent_cfg = episode_setup(load_config(["model.image_patch_dim=192"]))
    assert agent_cfg.images.patch == 8 and agent_cfg.images.patch_dim == 192
    assert template.image_tokens == agent_cfg.images.num_tokens == 70
    with pytest.raises(ValueError, match=r"model.image_patch_dim.*3·p·p"):
        episode_setup(load_config(["model.image_patch_dim=100"]))
