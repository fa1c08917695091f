"""MAE and masked patch prediction: `.venv/bin/python -m pytest tests/test_mae.py -q`."""

import pytest
import torch
import torch.nn.functional as F
from conftest import models_for

from pipeline.models import create_model
from pipeline.models.mae import MaskedAutoencoderViT, patchify, random_masking, unpatchify
from pipeline.models.masked_patch import (
    CLEAN,
    KEPT,
    MASKED,
    SWAPPED,
    corrupt_patches,
    mean_colour_classes,
)

pytestmark = pytest.mark.unit


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_every_parameter_has_a_gradient(model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


# ---------------------------------------------------------------------- MAE


def test_mae_forward_backward_every_parameter_gets_a_gradient():
    torch.manual_seed(0)
    model = create_model("mae_vit_debug")
    imgs = torch.randn(2, 3, 32, 32)
    loss, pred, mask = model(imgs, generator=gen(0))
    assert pred.shape == (2, 16, 8 * 8 * 3) and mask.shape == (2, 16)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    assert_every_parameter_has_a_gradient(model)
    # The fixed tables are buffers, outside the state dict: rebuilt from the shape, never trained.
    names = dict(model.named_buffers())
    assert "decoder_pos_embed_fixed" in names and "encoder.pos_embed_fixed" in names
    assert not any("pos_embed_fixed" in k for k in model.state_dict())
    assert model.decoder_pos_embed_fixed.shape == (1, 17, 32)
    assert torch.all(model.decoder_pos_embed_fixed[:, 0] == 0)  # class token row


def test_random_masking_keeps_an_exact_count_and_the_mask_marks_the_rest():
    B, N, D = 3, 16, 5
    x = torch.arange(B * N, dtype=torch.float32).reshape(B, N, 1).expand(B, N, D)
    kept, mask, ids_restore = random_masking(x, 0.75, gen(1))
    assert kept.shape == (B, int(N * (1 - 0.75)), D)
    assert torch.all(mask.sum(dim=1) == N - kept.shape[1]) and mask.mean() == 0.75
    for b in range(B):
        kept_ids = kept[b, :, 0].long() - b * N  # the tokens encode their own index
        assert torch.all(mask[b, kept_ids] == 0)  # 0 is keep, 1 is remove
    # ids_restore undoes the shuffle: (kept tokens, then the removed ones) in patch order
    assert torch.equal(torch.sort(ids_restore, dim=1).values, torch.arange(N).expand(B, N))


def test_mask_ratio_of_the_model_and_its_override():
    model = create_model("mae_vit_debug")
    imgs = torch.randn(2, 3, 32, 32)
    latent, mask, _ = model.forward_encoder(imgs, model.mask_ratio, gen(0))
    assert latent.shape == (2, 1 + int(16 * 0.25), 64)  # class token + the visible patches
    assert mask.mean() == 0.75
    _, _, mask = model(imgs, mask_ratio=0.5, generator=gen(0))
    assert mask.mean() == 0.5
    with pytest.raises(ValueError, match="mask_ratio"):
        model(imgs, mask_ratio=1.0)


def test_masks_follow_the_generator_and_leave_the_global_rng_alone():
    model = create_model("mae_vit_debug")
    imgs = torch.randn(4, 3, 32, 32)
    state = torch.get_rng_state()
    _, _, m1 = model(imgs, generator=gen(7))
    _, _, m2 = model(imgs, generator=gen(7))
    _, _, m3 = model(imgs, generator=gen(8))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(m1, m2)
    assert not torch.equal(m1, m3)


def test_norm_pix_loss_changes_the_loss_and_normalises_each_patch():
    torch.manual_seed(0)
    plain = create_model("mae_vit_debug")
    normed = create_model("mae_vit_debug", norm_pix_loss=True)
    normed.load_state_dict(plain.state_dict())
    imgs = torch.rand(2, 3, 32, 32) * 5 + 3  # far from zero mean, unit variance
    loss_plain, pred, mask = plain(imgs, generator=gen(0))
    loss_normed, pred_n, mask_n = normed(imgs, generator=gen(0))
    assert torch.equal(mask, mask_n) and torch.allclose(pred, pred_n)
    assert not torch.isclose(loss_plain, loss_normed)
    target = patchify(imgs, 8)
    target = (target - target.mean(-1, keepdim=True)) / (target.var(-1, keepdim=True) + 1e-6) ** 0.5
    expected = ((pred - target) ** 2).mean(-1)[mask.bool()].mean()  # masked patches only
    assert torch.allclose(loss_normed, expected, atol=1e-6)


def test_patchify_unpatchify_round_trip():
    imgs = torch.randn(2, 3, 32, 48)
    patches = patchify(imgs, 8)  # [B, 4 * 6, 8*8*3]
    assert patches.shape == (2, 24, 192)
    # Patch 1 is row 0, column 1; inside a patch the pixels are (p, q, c).
    assert torch.equal(patches[1, 1].reshape(8, 8, 3), imgs[1, :, :8, 8:16].permute(1, 2, 0))
    assert torch.equal(unpatchify(patches, 8, grid=(4, 6)), imgs)
    square = torch.randn(1, 3, 32, 32)
    assert torch.equal(unpatchify(patchify(square, 8), 8), square)


def test_export_encoder_gives_the_encoder_features_as_a_plain_vit():
    torch.manual_seed(0)
    model = create_model("mae_vit_debug", num_classes=7).eval()
    imgs = torch.randn(2, 3, 32, 32)
    vit = model.export_encoder()
    assert vit.pos_embed_kind == "learned" and vit.num_classes == 7
    assert torch.all(vit.pos_embed[:, 0] == 0)  # class token row
    assert torch.equal(vit.pos_embed[:, 1:], model.encoder.pos_embed_fixed)
    with torch.no_grad():
        expected = vit.eval().forward_features(imgs)  # [B, 1+N, D]
        latent, mask, ids_restore = model.forward_encoder(imgs, 0.0, gen(0))
    assert mask.sum() == 0
    patches = torch.gather(latent[:, 1:], 1, ids_restore[..., None].expand(-1, -1, 64))  # unshuffle
    assert torch.allclose(latent[:, 0], expected[:, 0], atol=1e-5)
    assert torch.allclose(patches, expected[:, 1:], atol=1e-5)
    assert torch.all(vit(imgs) == 0)  # fresh zero-initialised classifier

    gap = model.export_encoder(pool="gap", num_classes=3, drop_path_rate=0.1)
    assert gap.cls_token is None and gap.pos_embed.shape == (1, 16, 64)
    assert torch.equal(gap.blocks[0].attn.qkv.weight, model.encoder.blocks[0].attn.qkv.weight)
    assert gap(imgs).shape == (2, 3)


def test_overrides_change_any_option():
    model = create_model(
        "mae_vit_debug",
        img_size=64,
        mask_ratio=0.5,
        norm_pix_loss=True,
        decoder_embed_dim=16,
        decoder_depth=1,
    )
    assert model.encoder.grid_size == (8, 8) and model.mask_ratio == 0.5 and model.norm_pix_loss
    assert len(model.decoder_blocks) == 1 and model.mask_token.shape == (1, 1, 16)
    assert model.decoder_pos_embed_fixed.shape == (1, 65, 16)
    assert create_model("mae_vit_debug", patch_size=4).decoder_pred.out_features == 4 * 4 * 3
    with pytest.raises(ValueError, match="relative"):
        create_model("mae_vit_debug", pos_embed="relative")


# The MAE paper's sizes: the ViT each encoder is, its patch and width. Every registered MAE size but the
# debug one is checked against this table, so a new size fails until its published shape is written here.
MAE_PAPER = {
    "mae_vit_b16": ("vit_b16", 16, 768),
    "mae_vit_l16": ("vit_l16", 16, 1024),
    "mae_vit_h14": ("vit_h14", 14, 1280),
}


@pytest.mark.parametrize("mae_name", models_for("mae", debug=False))
def test_mae_encoders_have_the_published_vit_shapes(mae_name):
    assert mae_name in MAE_PAPER, f"{mae_name}: add its published (ViT, patch, width) to MAE_PAPER"
    vit_name, patch, width = MAE_PAPER[mae_name]
    with torch.device("meta"):  # count without allocating weights
        mae = create_model(mae_name)
        vit = create_model(vit_name, num_classes=1000)
    n_mae = sum(p.numel() for p in mae.encoder.parameters())
    n_vit = sum(p.numel() for p in vit.parameters())
    tokens = 1 + (224 // patch) ** 2
    # The MAE encoder has no classifier and a fixed (buffer) position table instead of a learned one.
    assert n_mae == n_vit - (width * 1000 + 1000) - tokens * width
    # The paper's decoder for every size: 8 blocks, width 512, 16 heads, MLP 4x.
    assert len(mae.decoder_blocks) == 8 and mae.decoder_embed.out_features == 512
    assert mae.decoder_blocks[0].attn.num_heads == 16 and mae.decoder_blocks[0].mlp.fc1.out_features == 2048
    assert mae.decoder_pred.out_features == patch * patch * 3


def block_param_count(width: int, mlp: int) -> int:
    """Two LayerNorms, qkv, projection and the MLP of one pre-LN block."""
    return (
        2 * 2 * width
        + (3 * width * width + 3 * width)
        + (width * width + width)
        + 2 * width * mlp
        + mlp
        + width
    )


def test_mae_b16_decoder_size():
    with torch.device("meta"):
        mae = create_model("mae_vit_b16")
    assert isinstance(mae, MaskedAutoencoderViT)
    decoder = sum(p.numel() for n, p in mae.named_parameters() if not n.startswith("encoder."))
    embed, pred = 768 * 512 + 512, 512 * 16 * 16 * 3 + 16 * 16 * 3
    assert decoder == embed + 512 + 8 * block_param_count(512, 2048) + 2 * 512 + pred  # + mask token, norm
    # 111.9M with the two frozen position tables the reference counts as parameters (buffers here).
    total = sum(p.numel() for p in mae.parameters()) + 197 * 768 + 197 * 512
    assert abs(total - 111.9e6) / 111.9e6 < 0.001


# ---------------------------------------------------------------------- masked patch prediction


def test_mean_colour_classes_of_known_colours():
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255), (0, 0, 0), (31, 32, 223)]
    expected = [7 * 64, 7 * 8, 7, 511, 0, 0 * 64 + 1 * 8 + 6]  # 31 -> 0, 32 -> 1, 223 -> 6
    img = torch.zeros(1, 3, 16, 24, dtype=torch.uint8)  # a 2 x 3 grid of 8px patches
    for i, c in enumerate(colours):
        r, col = divmod(i, 3)
        img[0, :, r * 8 : (r + 1) * 8, col * 8 : (col + 1) * 8] = torch.tensor(c, dtype=torch.uint8)[
            :, None, None
        ]
    classes = mean_colour_classes(img, 8)
    assert classes.dtype == torch.long and classes.tolist() == [expected]
    # A patch half black, half white has mean 127.5 in every channel: bin 3 each.
    half = torch.zeros(1, 3, 8, 8, dtype=torch.uint8)
    half[..., 4:] = 255
    assert mean_colour_classes(half, 8).item() == 3 * 64 + 3 * 8 + 3


def test_mpp_forward_backward_every_parameter_gets_a_gradient():
    torch.manual_seed(0)
    model = create_model("mpp_vit_debug")
    images_uint8 = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8)
    targets = mean_colour_classes(images_uint8, 8)
    images = (images_uint8.float() / 255 - 0.5) / 0.5
    loss, logits, corrupted = model(images, targets, generator=gen(0))
    assert logits.shape == (4, 16, 512) and model.num_bins == 8
    assert corrupted.dtype == torch.bool and torch.all(corrupted.sum(dim=1) == 8)  # 50% per image
    expected = F.cross_entropy(logits[corrupted], targets[corrupted])
    assert torch.allclose(loss, expected)
    loss.backward()
    assert_every_parameter_has_a_gradient(model)


def test_mpp_loss_ignores_clean_patches_and_follows_the_generator():
    model = create_model("mpp_vit_debug").eval()
    images = torch.randn(2, 3, 32, 32)
    targets = torch.randint(0, 512, (2, 16))
    state = torch.get_rng_state()
    with torch.no_grad():
        loss, _, corrupted = model(images, targets, generator=gen(3))
        other_targets = torch.where(corrupted, targets, (targets + 1) % 512)  # change clean patches only
        loss2, _, corrupted2 = model(images, other_targets, generator=gen(3))
        _, _, corrupted3 = model(images, targets, generator=gen(4))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(corrupted, corrupted2) and torch.equal(loss, loss2)
    assert not torch.equal(corrupted, corrupted3)


def test_corruption_is_80_10_10_and_each_kind_does_what_it_says():
    B, N, D = 2000, 16, 4
    x = torch.randn(B, N, D)
    token = torch.full((1, 1, D), 100.0)
    out, what = corrupt_patches(x, token, 0.5, gen(0))
    corrupted = what != CLEAN
    assert torch.all(corrupted.sum(dim=1) == N // 2)
    share = {k: (what == k).sum().item() / corrupted.sum().item() for k in (MASKED, SWAPPED, KEPT)}
    assert (
        abs(share[MASKED] - 0.8) < 0.02 and abs(share[SWAPPED] - 0.1) < 0.02 and abs(share[KEPT] - 0.1) < 0.02
    )
    unchanged = (what == CLEAN) | (what == KEPT)
    assert torch.equal(out[unchanged], x[unchanged])
    assert torch.all(out[what == MASKED] == 100.0)
    # A swapped patch holds another patch of the same image, never itself.
    b, i = torch.nonzero(what == SWAPPED, as_tuple=True)
    same = (out[b, i][:, None, :] == x[b]).all(dim=-1)  # [S, N]: which patch of that image it copies
    assert torch.all(same.sum(dim=1) >= 1) and not same[torch.arange(len(i)), i].any()


def test_mpp_export_encoder_is_a_vit_with_a_fresh_classifier():
    model = create_model("mpp_vit_debug", num_classes=5).eval()
    images = torch.randn(2, 3, 32, 32)
    vit = model.export_encoder().eval()
    assert vit.num_classes == 5 and vit is not model.encoder
    with torch.no_grad():
        assert torch.equal(vit.forward_features(images), model.encoder.forward_features(images))
        assert torch.all(vit(images) == 0)
    with torch.device("meta"):
        assert create_model("mpp_vit_b16", img_size=64).encoder.grid_size == (4, 4)
