"""Image-text causal LMs (issue #32): text-only and image prompts decode exactly as plain `generate`
(greedy and seeded sampling), trees with accepted multi-token paths included; what cannot be exact is
refused up front, naming why."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY
from test_decoding import OracleDrafter
from test_support import copying_drafter

import hf_bpd
from hf_bpd import BlockDraftHeads
from hf_bpd.tools.forward_counter import ForwardCounter

TEXT = {**TINY, "vocab_size": 128}  # room for the image tokens
VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=16, patch_size=4
)
IMAGE = 100  # image placeholder token id


def gemma3():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(TEXT, head_dim=8, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    config = Gemma3Config(
        text_config=text,
        vision_config=VISION,
        mm_tokens_per_image=4,
        image_token_index=IMAGE,
        boi_token_index=101,
        eoi_token_index=102,
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # initialised to zeros: random, so that the image changes the output
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 1.0)

    def prompt(with_image: bool):
        # as Gemma 3's processor lays an image out: <boi> <image> * mm_tokens_per_image <eoi>
        image = [101] + [IMAGE] * 4 + [102] if with_image else []
        ids = torch.tensor([[1, 5, 6, *image, 7, 8, 9]])
        if not with_image:
            return dict(input_ids=ids)
        g = torch.Generator().manual_seed(3)
        return dict(
            input_ids=ids, pixel_values=torch.randn(1, 3, 16, 16, generator=g), token_type_ids=(ids == IMAGE).long()
        )

    return model, prompt


def llava():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**VISION, projection_dim=32),
        text_config=LlamaConfig(**TEXT),
        image_token_id=IMAGE,
        vision_feature_layer=-1,
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()

    def prompt(with_image: bool):
        # CLIP's 16 patches of a 16 x 16 image (default strategy drops the CLS token): 16 image tokens
        image = [IMAGE] * 16 if with_image else []
        ids = torch.tensor([[1, 5, *image, 6, 7, 8]])
        if not with_image:
            return dict(input_ids=ids)
        g = torch.Generator().manual_seed(3)
        return dict(input_ids=ids, pixel_values=torch.randn(1, 3, 16, 16, generator=g))

    return model, prompt


FAMILIES = {"gemma3": gemma3, "llava": llava}


def decode(model, inputs, drafter=None, **kw):
    extra = dict(custom_generate=hf_bpd.generate, assistant=drafter) if drafter is not None else {}
    return model.generate(**inputs, pad_token_id=0, eos_token_id=None, **kw, **extra)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return FAMILIES[request.param]()


@pytest.mark.parametrize("with_image", [False, True], ids=["text", "image"])
def test_greedy_matches_generate(family, with_image):
    model, prompt = family
    inputs = prompt(with_image)
    ref = decode(model, inputs, max_new_tokens=24, do_sample=False)
    drafter = copying_drafter(model)
    assert decode(model, inputs, drafter, max_new_tokens=24, do_sample=False).tolist() == ref.tolist()
    assert max(drafter.stats.tree_sizes) > 1
    # an oracle drafts plain generate's tokens: whole multi-token paths are accepted
    oracle = OracleDrafter(BlockDraftHeads.for_base_model(model, num_heads=3), ref, top_k=3, max_tree_tokens=12)
    assert decode(model, inputs, oracle, max_new_tokens=24, do_sample=False).tolist() == ref.tolist()
    assert max(oracle.stats.accepted_lengths) == 4  # h drafts + the bonus token


@pytest.mark.parametrize("with_image", [False, True], ids=["text", "image"])
def test_seeded_sampling_matches_generate(family, with_image):
    model, prompt = family
    inputs = prompt(with_image)
    drafter = copying_drafter(model)  # built before the seed: making heads draws random numbers
    torch.manual_seed(7)
    ref = decode(model, inputs, max_new_tokens=16, do_sample=True, top_k=0)
    torch.manual_seed(7)
    out = decode(model, inputs, drafter, max_new_tokens=16, do_sample=True, top_k=0)
    assert out.tolist() == ref.tolist()
    assert max(drafter.stats.tree_sizes) > 1


def test_the_image_reaches_the_prefill(family):
    # two images whose plain outputs differ: hf_bpd follows each (it would give one answer for both if the
    # images did not reach its prefill)
    model, prompt = family
    inputs = prompt(True)
    other = dict(inputs, pixel_values=-4 * inputs["pixel_values"])
    drafter = copying_drafter(model)
    refs = [
        decode(model, x, max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
        for x in (inputs, other)
    ]
    assert not torch.equal(refs[0].logits[0], refs[1].logits[0])
    for x, ref in zip((inputs, other), refs):
        out = decode(
            model, x, drafter, max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        assert out.sequences.tolist() == ref.sequences.tolist()
        torch.testing.assert_close(out.logits[0], ref.logits[0])


def test_multimodal_rotary_positions_with_an_image_are_refused_before_any_forward():
    # Qwen2-VL: an image gives 3D (M-RoPE) positions offset by rope_deltas, which tree forwards do not pass
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = dict(TEXT, rope_parameters=dict(rope_type="default", mrope_section=[1, 1, 2], rope_theta=10000.0))
    vision = dict(
        depth=1,
        embed_dim=32,
        hidden_size=32,
        num_heads=4,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        in_channels=3,
    )
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=103)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).eval()
    grid = torch.tensor([[1, 4, 4]])  # 16 patches, merged 2 x 2: 4 image tokens
    ids = torch.tensor([[1, 5, *[IMAGE] * 4, 6, 7]])
    pixels = torch.randn(16, 3 * 2 * 4 * 4)
    drafter = copying_drafter(model)
    with ForwardCounter(model) as counter, pytest.raises(ValueError, match="M-RoPE"):
        decode(
            model,
            dict(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == IMAGE).long()),
            drafter,
            max_new_tokens=8,
        )
    assert counter.count == 0
    text_only = dict(input_ids=torch.tensor([[1, 5, 6, 7]]))  # no image: positions are plain text ones
    ref = decode(model, text_only, max_new_tokens=16, do_sample=False)
    assert decode(model, text_only, drafter, max_new_tokens=16, do_sample=False).tolist() == ref.tolist()
