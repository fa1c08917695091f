"""CvT (Wu et al. 2021): parameter counts, analytic FLOPs, resolution freedom, the class token, SimMIM."""

import pytest
import torch
from conftest import counted_macs, meta_model

import pipeline.models.cvt  # noqa: F401  (registers cvt_13, cvt_21, cvt_debug)
from pipeline.models.cvt import ConvAttention, ConvolutionalVisionTransformer
from pipeline.models.registry import create_model, list_models

pytestmark = pytest.mark.unit

CVT_NAMES = ["cvt_debug", "cvt_13", "cvt_21"]


def cvt_param_count(dims, depths, classes, in_chans=3, mlp_ratio=4):
    """The exact parameter count of a CvT (official layout, qkv bias, class token in the last stage)."""
    total, chans = 0, in_chans
    for d, depth, k in zip(dims, depths, (7, 3, 3)):
        total += chans * k * k * d + d + 2 * d  # token embedding conv (with bias) + LayerNorm
        block = (
            2 * d  # norm1
            + 3 * (9 * d + 2 * d)  # depthwise 3x3 (no bias) + BatchNorm, for q, k and v
            + 4 * (d * d + d)  # proj_q, proj_k, proj_v, proj
            + 2 * d  # norm2
            + 2 * mlp_ratio * d * d
            + mlp_ratio * d
            + d  # fc1, fc2
        )
        total += depth * block
        chans = d
    d = dims[-1]
    return total + d + 2 * d + d * classes + classes  # class token, final norm, head


def test_names_registered():
    assert set(CVT_NAMES) <= set(list_models())


@pytest.mark.parametrize(
    "name,dims,depths,paper",
    [
        ("cvt_13", (64, 192, 384), (1, 2, 10), 20e6),
        ("cvt_21", (64, 192, 384), (1, 4, 16), 32e6),
    ],
)
def test_parameter_counts_match_paper_and_formula(name, dims, depths, paper):
    model = meta_model(name, num_classes=1000)
    n = sum(p.numel() for p in model.parameters())
    assert n == cvt_param_count(dims, depths, 1000)
    assert abs(n - paper) / paper < 0.02  # 19.997M and 31.623M (timm / Hugging Face: 20.0M, 31.6M)


def test_debug_variant_is_tiny():
    model = meta_model("cvt_debug")
    assert sum(p.numel() for p in model.parameters()) < 300_000
    assert model.forward_macs() == model.forward_macs(32)  # built for 32 px


# ---------------------------------------------------------------------- FLOPs


@pytest.mark.parametrize(
    "name,built,counted,overrides,device",
    [
        ("cvt_debug", 32, 32, {}, "cpu"),
        ("cvt_debug", 32, 32, {"distilled": True}, "cpu"),
        ("cvt_debug", 32, 48, {"stride_kv": 1}, "cpu"),  # unsqueezed keys, at another size than built
        ("cvt_13", 224, 224, {}, "meta"),  # FlopCounterMode works on meta tensors: shapes are all it needs
        ("cvt_21", 224, 224, {"num_classes": 0}, "meta"),
        ("cvt_13", 64, 96, {}, "meta"),  # built at 64, run at 96: 24 -> 12 -> 6 tokens a side, keys 3 a side
    ],
)
def test_analytic_macs_match_flop_counter(name, built, counted, overrides, device):
    torch.manual_seed(0)
    with torch.device(device):
        model = create_model(name, img_size=built, **overrides)
    analytic = model.forward_macs(None if counted == built else counted)
    assert analytic == pytest.approx(counted_macs(model, counted, device), rel=0.02)


def test_macs_match_the_papers_gflops():
    """Table 2: CvT-13 4.5G, CvT-21 7.1G multiply-accumulates at 224 px (timm: 4.6 and 7.2)."""
    assert meta_model("cvt_13").forward_macs() == pytest.approx(4.5e9, rel=0.03)
    assert meta_model("cvt_21").forward_macs() == pytest.approx(7.1e9, rel=0.03)


def test_keys_and_values_are_squeezed_and_the_class_token_is_not_convolved():
    """Stage 3 at 64 px: a 4x4 map; queries 1 + 16 tokens, keys and values 1 + 2x2 (stride 2)."""
    torch.manual_seed(0)
    model = create_model("cvt_debug", img_size=64).eval()
    attn = model.stage2.blocks[0].attn
    seen = {}

    def grab(name):
        return lambda module, args, out: seen.__setitem__(name, (args[0].shape, out.shape))

    for name in ("proj_q", "proj_k", "proj_v"):
        getattr(attn, name).register_forward_hook(grab(name))
    model(torch.randn(2, 3, 64, 64))
    assert seen["proj_q"][0] == (2, 1 + 16, 64)
    assert seen["proj_k"][0] == seen["proj_v"][0] == (2, 1 + 4, 64)

    # The class token reaches q, k and v as it is: the convolutions see only the map, yet the patch
    # tokens attend to it.
    attn.conv_proj_k.register_forward_hook(lambda m, a, out: seen.setdefault("conv_k", []).append(out))
    x = torch.randn(2, 1 + 16, 64)
    y = x.clone()
    y[:, 0] += 1.0  # change the class token only
    with torch.no_grad():
        out_x, out_y = attn(x, 4, 4), attn(y, 4, 4)
    conv_x, conv_y = seen["conv_k"]
    assert conv_x.shape == (2, 4, 64)  # the 2x2 squeezed map, no class token
    torch.testing.assert_close(conv_x, conv_y)
    assert not torch.allclose(out_x[:, 1:], out_y[:, 1:])


# ---------------------------------------------------------------------- resolution


def test_runs_at_a_resolution_other_than_built_for():
    """No position embedding: one set of weights runs at 64, 96 and 48 px; a 224 px build has the same shapes."""
    torch.manual_seed(0)
    model = create_model("cvt_debug", img_size=64, num_classes=7).eval()
    assert not [n for n, _ in model.named_parameters() if "pos" in n]
    assert not [n for n, _ in model.named_buffers() if "pos" in n]
    for size in (64, 96, 48):
        assert model(torch.randn(2, 3, size, size)).shape == (2, 7)
    # The image size changes nothing in the parameters: weights load strictly across builds.
    other = create_model("cvt_debug", img_size=224, num_classes=7).eval()
    other.load_state_dict(model.state_dict(), strict=True)
    x = torch.randn(1, 3, 96, 96)
    torch.testing.assert_close(other.forward_features(x), model.forward_features(x))


# ---------------------------------------------------------------------- training behaviour


def _grad_check(model: ConvolutionalVisionTransformer, x: torch.Tensor) -> None:
    """Every parameter gets a finite, nonzero gradient (the zero-initialised heads are probed around).

    The probe covers every output token, not only the class token: the last block's query convolution
    shapes only the patch tokens, which the classifier never reads (see the test below).
    """
    out = model(x)
    out = out[0] + out[1] if isinstance(out, tuple) else out
    feats = model.forward_features(x)  # [B, P + N, C]
    loss = out.logsumexp(-1).sum() + (feats * torch.randn_like(feats)).sum()
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        if not name.startswith(("head.weight", "head_dist.weight")):
            assert p.grad.abs().sum() > 0, name


def test_classifier_loss_reaches_all_but_the_last_query_convolution():
    """The class token is not convolved, so in the last block the query conv + BatchNorm only shape
    patch-token outputs that nothing reads: a classification loss gives them a zero gradient (present,
    not None, so optimisers and ZeRO see it). The official model behaves the same."""
    torch.manual_seed(0)
    model = create_model("cvt_debug", num_classes=5)
    torch.nn.init.normal_(model.head.weight, std=0.02)  # a trained head: the zero one passes nothing back
    logits = model(torch.randn(2, 3, 32, 32))
    torch.nn.functional.cross_entropy(logits, torch.tensor([1, 3])).backward()
    assert all(p.grad is not None for p in model.parameters())
    zero = sorted(n for n, p in model.named_parameters() if p.grad.abs().sum() == 0)
    assert zero == [
        "stage2.blocks.1.attn.conv_proj_q.bn.bias",
        "stage2.blocks.1.attn.conv_proj_q.bn.weight",
        "stage2.blocks.1.attn.conv_proj_q.conv.weight",
    ]


@pytest.mark.parametrize("overrides", [{}, {"distilled": True}, {"grad_checkpointing": True}])
def test_debug_trains_every_parameter_gets_a_gradient(overrides):
    torch.manual_seed(0)
    model = create_model("cvt_debug", num_classes=5, **overrides)
    logits = model(torch.randn(2, 3, 32, 32))
    assert logits.shape == (2, 5)
    assert torch.all(logits == 0)  # zero-initialised head: logits start at the head bias
    _grad_check(model, torch.randn(2, 3, 32, 32))


def test_cvt_13_at_64px_forward_backward():
    torch.manual_seed(0)
    model = create_model("cvt_13", img_size=64, num_classes=3, depths=(1, 1, 1))
    _grad_check(model, torch.randn(2, 3, 64, 64))


def test_grad_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    ref = create_model("cvt_debug", num_classes=4, drop_path_rate=0.0, head_bias_init=0.0)
    ckpt = create_model("cvt_debug", num_classes=4, drop_path_rate=0.0, grad_checkpointing=True)
    ckpt.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 32, 32)
    grads = []
    for m in (ref, ckpt):
        (m.forward_head(m.forward_features(x), pre_logits=True) ** 2).sum().backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], msg=name)


def test_distillation_heads_and_feature_extractor():
    torch.manual_seed(0)
    m = create_model("cvt_debug", num_classes=5, distilled=True, head_bias_init=-2.0)
    assert m.stage2.dist_token is not None and m.stage0.cls_token is None
    x = torch.randn(2, 3, 32, 32)
    assert torch.all(m(x) == -2.0)  # both heads zero-initialised, averaged
    m.distilled_training = True
    out = m(x)
    assert isinstance(out, tuple) and out[0].shape == out[1].shape == (2, 5)
    m.eval()
    assert m(x).shape == (2, 5)  # eval: averaged even in distilled training

    fe = create_model("cvt_debug", num_classes=0).eval()
    assert isinstance(fe.head, torch.nn.Identity)
    assert fe(x).shape == (2, fe.num_features) == (2, 64)
    torch.testing.assert_close(fe(x), fe.forward_features(x)[:, 0])


def test_shape_overrides_and_validation():
    m = meta_model("cvt_13", depths=(1, 1, 2), dims=(32, 64, 128), num_heads=(1, 2, 4))
    assert len(m.stage2.blocks) == 2 and m.num_features == 128
    with pytest.raises(ValueError, match="3 stages"):
        meta_model("cvt_13", depths=(1, 2))
    with pytest.raises(ValueError, match="not divisible"):
        ConvAttention(64, 3)


# ---------------------------------------------------------------------- SimMIM


def test_forward_mim_shape_and_mask_token_gradient():
    torch.manual_seed(0)
    model = create_model("cvt_debug", mask_token=True)
    assert model.supports_mim and model.mim_patch_size == 4 and model.mim_stride == 16
    assert model.mask_token.shape == (1, 1, 16)
    x = torch.randn(2, 3, 64, 64)
    mask = torch.rand(2, 16, 16) < 0.6  # [B, H/4, W/4]
    out = model.forward_mim(x, mask)
    assert out.shape == (2, 64, 4, 4)  # [B, C_last, H/16, W/16]
    out.square().mean().backward()
    assert model.mask_token.grad is not None and model.mask_token.grad.abs().sum() > 0
    # Masking changes the features; an all-False mask is the plain backbone.
    model.eval()
    with torch.no_grad():
        plain = model.forward_features(x)[:, 1:].transpose(1, 2).reshape(2, 64, 4, 4)
        torch.testing.assert_close(model.forward_mim(x, torch.zeros_like(mask)), plain)
        assert not torch.allclose(model.forward_mim(x, mask), plain)
    with pytest.raises(ValueError, match="mask must be"):
        model.forward_mim(x, mask[:, :8])
    with pytest.raises(RuntimeError, match="mask_token=True"):
        create_model("cvt_debug").forward_mim(x, mask)


def test_no_mask_token_unless_asked():
    assert meta_model("cvt_debug").mask_token is None
    assert not [n for n, _ in meta_model("cvt_13").named_parameters() if "mask" in n]
