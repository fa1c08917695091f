"""TNT (Transformer in Transformer): paper sizes, analytic FLOPs, the inner stream, SimMIM masking.

.venv/bin/python -m pytest tests/test_model_tnt.py -q
"""

import copy

import pytest
import torch
from conftest import counted_macs, meta_model
from torch import nn

import pipeline.models.tnt  # noqa: F401  (registers tnt_*)
from pipeline.models import create_model, list_models

pytestmark = pytest.mark.unit

NAMES = ["tnt_debug", "tnt_s16", "tnt_b16"]


def debug_model(**kw) -> nn.Module:
    torch.manual_seed(0)
    return create_model("tnt_debug", **kw).eval()


def test_registry_lists_the_family_and_every_name_builds_on_meta():
    assert set(NAMES) <= set(list_models())
    for name in NAMES:
        model = meta_model(name)
        assert model.supports_mim and model.num_features == model.embed_dim


@pytest.mark.parametrize("name,paper", [("tnt_s16", 23.8e6), ("tnt_b16", 65.6e6)])
def test_parameter_counts_match_paper(name, paper):
    count = sum(p.numel() for p in meta_model(name).parameters())
    assert count == pytest.approx(paper, rel=0.02)  # measured 23.77M and 65.43M (timm: 23.76M, 65.41M)


def test_debug_variant_is_tiny():
    model = meta_model("tnt_debug")
    assert sum(p.numel() for p in model.parameters()) < 400_000
    assert model.num_words == 16 and model.grid_size == (4, 4)  # 32px, 8px patches, 4x4 words each


@pytest.mark.parametrize(
    "name,img_size,overrides,device",
    [
        ("tnt_debug", 32, {}, "cpu"),
        ("tnt_debug", 32, {"distilled": True}, "cpu"),
        ("tnt_debug", 32, {"num_classes": 0}, "cpu"),
        ("tnt_s16", 64, {"depth": 2}, "cpu"),  # a real forward; full depth only costs init time
        ("tnt_s16", 224, {}, "meta"),  # FlopCounterMode needs only shapes: meta runs the same ops
        ("tnt_b16", 64, {"depth": 2}, "meta"),  # TNT-B at 224 is checked against the paper below
    ],
)
def test_analytic_macs_match_flop_counter(name, img_size, overrides, device):
    torch.manual_seed(0)
    with torch.device(device):
        model = create_model(name, img_size=img_size, **overrides)
    analytic = model.forward_macs()
    assert analytic == pytest.approx(counted_macs(model, img_size, device), rel=0.02)
    assert meta_model(name, **overrides).forward_macs(img_size) == analytic  # counts at another size


@pytest.mark.parametrize("name,gmacs", [("tnt_s16", 5.2), ("tnt_b16", 14.1)])  # paper, Table 3
def test_published_forward_gmacs(name, gmacs):
    assert meta_model(name).forward_macs() / 1e9 == pytest.approx(gmacs, rel=0.01)


def test_default_widths_train_at_64px():
    torch.manual_seed(0)  # TNT-S widths, heads and patches; 2 blocks keep initialisation fast
    model = create_model("tnt_s16", img_size=64, num_classes=10, depth=2).train()
    x = torch.randn(2, 3, 64, 64)
    out = model(x)
    assert out.shape == (2, 10)
    out.sum().backward()
    assert model.blocks[0].inner.attn.qkv.weight.grad is not None


@pytest.mark.parametrize("overrides", [{}, {"distilled": True}])
def test_every_parameter_gets_a_gradient(overrides):
    model = debug_model(num_classes=5, **overrides).train()
    nn.init.normal_(model.head.weight, std=0.02)  # the zero-initialised head would stop all gradients
    if model.head_dist is not None:
        nn.init.normal_(model.head_dist.weight, std=0.02)
    model(torch.randn(2, 3, 32, 32)).square().sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert not missing


def test_heads_distillation_and_feature_extractor():
    x = torch.randn(2, 3, 32, 32)
    model = debug_model(num_classes=7, distilled=True, head_bias_init=-2.0)
    assert not model.head.weight.any() and torch.all(model.head.bias == -2.0)
    assert model(x).shape == (2, 7) and torch.allclose(model(x), torch.full((2, 7), -2.0))
    model.train()
    model.distilled_training = True
    logits, logits_dist = model(x)
    assert logits.shape == logits_dist.shape == (2, 7)

    features = debug_model(num_classes=0)
    assert isinstance(features.head, nn.Identity)
    assert features(x).shape == (2, 64)
    assert features.forward_features(x).shape == (2, 1 + 16, 64)  # class token + 4x4 patches


def test_grad_checkpointing_gives_the_same_loss_and_gradients():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    plain = debug_model(num_classes=3, drop_path_rate=0.0).train()
    nn.init.normal_(plain.head.weight, std=0.02)
    ckpt = copy.deepcopy(plain)
    ckpt.grad_checkpointing = True
    for model in (plain, ckpt):
        model(x).sum().backward()
    grads = zip(plain.parameters(), ckpt.parameters(), strict=True)
    assert all(torch.allclose(a.grad, b.grad, atol=1e-6) for a, b in grads)


# ---------------------------------------------------------------------- the inner stream


def _perturb_patch(x: torch.Tensor, row: int, col: int, patch: int) -> torch.Tensor:
    y = x.clone()
    y[:, :, row * patch : (row + 1) * patch, col * patch : (col + 1) * patch] += 1.0
    return y


@torch.no_grad()
def test_outer_stream_receives_the_inner_stream_only_through_the_projection():
    model = debug_model(num_classes=0)
    x = torch.randn(2, 3, 32, 32)
    before = model(x)

    cut = copy.deepcopy(model)
    for blk in cut.blocks:
        blk.words_to_patch.proj.weight.zero_()  # LayerNorm(0) = its zero bias: nothing reaches the patch
    after = cut(x)
    assert not torch.allclose(before, after, atol=1e-4)  # the projected words do matter

    # With the projections cut, the inner blocks have no other path to the output.
    for p in cut.blocks[1].inner.parameters():
        p.add_(torch.randn_like(p))
    assert torch.allclose(cut(x), after, atol=1e-6)
    for p in model.blocks[1].inner.parameters():  # ... whereas with them the same change shows
        p.add_(torch.randn_like(p))
    assert not torch.allclose(model(x), before, atol=1e-4)


@torch.no_grad()
def test_word_attention_stays_inside_its_patch():
    model = debug_model(num_classes=0)
    for blk in model.blocks:
        blk.outer = nn.Identity()  # inner stream only: words, then their projection onto each patch
    x = torch.randn(2, 3, 32, 32)
    y = _perturb_patch(x, 1, 2, 8)  # patch index 1 * 4 + 2 = 6
    changed_patch = 6

    words_x, tokens_x = model.embed(x)
    words_y, tokens_y = model.embed(y)
    words_x, tokens_x = model.blocks[0](words_x, tokens_x)
    words_y, tokens_y = model.blocks[0](words_y, tokens_y)
    words_changed = (words_x - words_y).abs().amax(dim=(1, 2)).reshape(2, 16) > 0  # [B, N]
    tokens_changed = (tokens_x - tokens_y).abs().amax(dim=2)[:, 1:] > 0  # [B, N], class token dropped
    expected = torch.zeros(2, 16, dtype=torch.bool)
    expected[:, changed_patch] = True
    assert torch.equal(words_changed, expected) and torch.equal(tokens_changed, expected)
    assert torch.equal(tokens_x[:, 0], tokens_y[:, 0])

    # Across all blocks with the outer attention back, words still never mix between patches.
    full = debug_model(num_classes=0)
    words_x, _ = full.forward_blocks(*full.embed(x))
    words_y, _ = full.forward_blocks(*full.embed(y))
    assert torch.equal((words_x - words_y).abs().amax(dim=(1, 2)).reshape(2, 16) > 0, expected)


# ---------------------------------------------------------------------- masked image modelling


def _mask(batch: int = 2) -> torch.Tensor:
    mask = torch.zeros(batch, 4, 4, dtype=torch.bool)
    mask[:, 1, 2] = True
    mask[0, 0, 0] = True
    mask[1, 3, 1:] = True
    return mask


def test_forward_mim_shape_and_gradients_to_both_mask_tokens():
    model = debug_model(mask_token=True).train()
    assert model.mim_patch_size == model.mim_stride == 8
    assert model.mask_token.shape == (1, 1, 64) and model.mask_token_pixel.shape == (1, 1, 8)
    feats = model.forward_mim(torch.randn(2, 3, 32, 32), _mask())
    assert feats.shape == (2, 64, 4, 4)
    feats.square().sum().backward()
    assert model.mask_token.grad.any() and model.mask_token_pixel.grad.any()


@torch.no_grad()
def test_masked_pixels_do_not_leak_into_forward_mim():
    model = debug_model(mask_token=True)
    x, mask = torch.randn(2, 3, 32, 32), _mask()
    y = _perturb_patch(x, 1, 2, 8)  # masked in both samples
    assert torch.allclose(model.forward_mim(x, mask), model.forward_mim(y, mask), atol=1e-6)
    z = _perturb_patch(x, 0, 1, 8)  # visible: the features must see it
    assert not torch.allclose(model.forward_mim(x, mask), model.forward_mim(z, mask), atol=1e-4)


def test_mask_needs_mask_token_and_the_right_grid():
    x = torch.randn(2, 3, 32, 32)
    with pytest.raises(ValueError, match="mask_token=True"):
        debug_model().forward_mim(x, _mask())
    with pytest.raises(ValueError, match="mask must be"):
        debug_model(mask_token=True).forward_mim(x, torch.zeros(2, 8, 8, dtype=torch.bool))
    assert not any("mask_token" in n for n, _ in debug_model().named_parameters())
