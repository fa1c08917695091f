"""Analytic FLOPs against torch's FlopCounterMode (small models) and timm's published GMACs (large ones).

FlopCounterMode does not count CPU `scaled_dot_product_attention` when it dispatches to the fused
`_scaled_dot_product_flash_attention_for_cpu` kernel (no mask): it reports 0 attention FLOPs. Forcing
the math backend (`sdpa_kernel(SDPBackend.MATH)`) runs QK^T and AV as `bmm`, which it counts; on the
meta device SDPA takes the math path anyway.
"""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from pipeline.models import create_model, list_models
from pipeline.models.flops import estimate_mfu, flops_per_image, flops_per_train_step

pytestmark = pytest.mark.unit


def counted_flops(model: torch.nn.Module, img_size: int, device: str = "cpu", *args) -> int:
    """FLOPs torch counts for one forward of one image (matmuls and convolutions)."""
    model.eval()
    x = torch.randn(1, 3, img_size, img_size, device=device)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        model(x, *args)
    return counter.get_total_flops()


def test_flop_counter_misses_fused_cpu_attention_and_counts_the_math_path():
    """Why the comparisons below force the math backend."""
    q = torch.randn(1, 2, 5, 8)
    with FlopCounterMode(display=False) as fused:
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as math:
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert math.get_total_flops() == 2 * (2 * 2 * 5 * 5 * 8)  # QK^T and AV
    assert fused.get_total_flops() in (0, math.get_total_flops())  # 0 on torch 2.13 CPU


@pytest.mark.parametrize(
    "name,img_size,overrides,device",
    [
        ("vit_debug", None, {}, "cpu"),
        ("vit_debug", None, {"pool": "gap"}, "cpu"),
        ("vit_debug", None, {"distilled": True}, "cpu"),
        ("vit_debug", None, {"pos_embed": "relative"}, "cpu"),
        ("vit_debug", None, {"pos_embed": "learned_2d"}, "cpu"),
        ("vit_debug", None, {"pos_embed": "sincos2d", "pool": "gap"}, "cpu"),
        ("vit_ti16", 64, {}, "cpu"),
        ("vit_ti16", 224, {}, "meta"),  # FlopCounterMode works on meta tensors: shapes are all it needs
        ("vit_r50_b16", 64, {}, "meta"),  # the ResNet convolutions take seconds on CPU
    ],
)
def test_analytic_flops_match_flop_counter(name, img_size, overrides, device):
    kw = overrides if img_size is None else {"img_size": img_size, **overrides}
    torch.manual_seed(0)
    with torch.device(device):
        model = create_model(name, **kw)
    size = img_size or model.patch_embed.grid_size[0] * model.patch_embed.patch_size
    analytic = flops_per_image(name, img_size=img_size, **overrides)
    assert analytic == pytest.approx(counted_flops(model, size, device), rel=0.02)
    assert flops_per_image(model) == analytic  # a built model counts the same as its name


@pytest.mark.parametrize(
    "name,gmacs",
    [
        ("vit_b16", 17.6),
        ("vit_l16", 61.6),
        ("vit_h14", 167.4),
        ("vit_G14", 965.3 / 2),
    ],  # G/14: Zhai et al. 2022
)
def test_published_forward_gmacs(name, gmacs):
    assert flops_per_image(name, img_size=224) / 2 / 1e9 == pytest.approx(gmacs, rel=0.01)


def test_attention_grows_quadratically_with_tokens():
    # At 4x the tokens the linear layers cost 4x; only the attention products grow by 16x.
    small, big = flops_per_image("vit_debug", img_size=32), flops_per_image("vit_debug", img_size=64)
    assert 4 < big / small < 16


def test_mask_ratio_on_a_vit_drops_encoder_tokens_only():
    full = flops_per_image("vit_debug", pool="gap")
    masked = flops_per_image("vit_debug", pool="gap", mask_ratio=0.75)
    embed = 2 * 16 * (3 * 8 * 8) * 64  # the patch embedding still runs on all 16 patches
    assert masked < full / 3
    assert masked > embed
    with pytest.raises(ValueError, match="mask_ratio"):
        flops_per_image("vit_debug", mask_ratio=1.0)


def test_train_step_and_mfu():
    fwd = flops_per_image("vit_b16")
    assert flops_per_train_step("vit_b16") == 3 * fwd
    # 3 x 35.1 GFLOPs x 3000 images/s = 316 TFLOP/s: 32% of a 989 TFLOP/s H100.
    assert estimate_mfu(3 * fwd, 3000.0) == pytest.approx(3 * fwd * 3000 / 989e12)
    assert estimate_mfu(1e12, 1.0, peak_flops=2e12) == 0.5


def test_errors_name_the_problem():
    with pytest.raises(KeyError, match="unknown model"):
        flops_per_image("vit_nope")
    with torch.device("meta"):
        model = create_model("vit_debug")
    with pytest.raises(TypeError, match="overrides"):
        flops_per_image(model, pool="gap")
    with pytest.raises(TypeError, match="cannot count"):
        flops_per_image(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------------- MAE


def mae_flops_by_hand(mask_ratio: float) -> int:
    """mae_vit_debug from its own attributes, token counts written out."""
    with torch.device("meta"):
        model = create_model("mae_vit_debug")
    enc = model.encoder
    n = enc.patch_embed.num_patches
    p = enc.num_prefix_tokens
    visible = p + int(n * (1 - mask_ratio))

    def block(blk, t):
        d = blk.attn.qkv.in_features
        return t * d * 3 * d + 2 * t * t * d + t * d * d + 2 * t * d * blk.mlp.fc1.out_features

    proj = enc.patch_embed.proj
    macs = n * proj.out_channels * proj.in_channels * proj.kernel_size[0] * proj.kernel_size[1]
    macs += sum(block(b, visible) for b in enc.blocks)
    macs += visible * model.decoder_embed.in_features * model.decoder_embed.out_features
    macs += sum(block(b, p + n) for b in model.decoder_blocks)
    macs += (p + n) * model.decoder_pred.in_features * model.decoder_pred.out_features
    return 2 * macs


def test_mae_flops_match_flop_counter_and_token_counts():
    torch.manual_seed(0)
    model = create_model("mae_vit_debug")
    size = model.encoder.patch_embed.grid_size[0] * model.encoder.patch_embed.patch_size
    analytic = flops_per_image(model, mask_ratio=0.75)
    assert analytic == mae_flops_by_hand(0.75)
    model.mask_ratio = 0.75  # the masking inside forward is random; the number of kept tokens is not
    assert analytic == pytest.approx(counted_flops(model, size), rel=0.02)
    assert flops_per_image("mae_vit_debug") == flops_per_image("mae_vit_debug", mask_ratio=model.mask_ratio)


def test_mae_encoder_at_75_percent_masking_costs_about_a_quarter():
    vit = flops_per_image("vit_l16")
    mae = flops_per_image("mae_vit_l16", mask_ratio=0.75)
    mae_unmasked = flops_per_image("mae_vit_l16", mask_ratio=0.0)
    assert mae < 0.45 * mae_unmasked  # MAE's headline: ~3x cheaper pretraining (paper, section 4)
    assert mae < vit


# ---------------------------------------------------------------------- masked patch prediction


def test_masked_patch_prediction_flops_match_flop_counter():
    torch.manual_seed(0)
    model = create_model("mpp_vit_debug")
    targets = torch.zeros(1, model.encoder.patch_embed.num_patches, dtype=torch.long)
    analytic = flops_per_image(model)
    assert analytic == pytest.approx(counted_flops(model, 32, "cpu", targets), rel=0.02)
    # The encoder sees every token (corrupted, not dropped); the head classifies every patch.
    vit = flops_per_image("vit_debug")
    head = 2 * 16 * 64 * 512
    assert analytic == vit - 2 * 64 * 1000 + head
    with pytest.raises(ValueError, match="mask_ratio"):
        flops_per_image(model, mask_ratio=0.5)


# ---------------------------------------------------------------------- every family counts itself


@pytest.mark.parametrize("name", list_models())
def test_every_registered_model_counts_its_own_forward(name):
    """A new family is counted without flops.py knowing it: the model class answers forward_macs."""
    with torch.device("meta"):
        model = create_model(name)
    macs = type(model).forward_macs(model)  # defined on the class, not patched on
    assert isinstance(macs, int) and macs > 0
    assert flops_per_image(model) == 2 * macs == flops_per_image(name)


def _shape(vit) -> tuple:
    blk = vit.blocks[0]
    return vit.embed_dim, vit.depth, vit.grid_size, blk.attn.num_heads, blk.mlp.fc1.out_features


def test_vit_mae_and_masked_patch_share_one_shape_table():
    with torch.device("meta"):
        for size in ("debug", "b16", "l16"):
            vit = _shape(create_model(f"vit_{size}"))
            assert _shape(create_model(f"mae_vit_{size}").encoder) == vit
            assert _shape(create_model(f"mpp_vit_{size}").encoder) == vit
