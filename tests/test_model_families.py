"""Every registered non-ViT family (TNT, CvT, LeViT, Swin) and its SimMIM wrapper, generated from the
registry: forward and backward at a small size, FLOPs against torch's counter, and short training runs
of each family through the real loop (2 gloo ranks, every ZeRO stage, supervised, DeiT and SimMIM)."""

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from pipeline.models import create_model, list_models
from pipeline.models.flops import flops_per_image

FAMILIES = ("tnt_", "cvt_", "levit_", "swin_")
NAMES = [n for n in list_models() if n.startswith(FAMILIES)]
SIMMIM = [n for n in list_models() if n.startswith("simmim_")]
SIZE = 64


@pytest.mark.unit
def test_every_family_is_registered():
    for prefix in FAMILIES:
        assert any(n.startswith(prefix) for n in NAMES), f"no {prefix}* model registered"
    assert {"tnt_s16", "tnt_b16", "cvt_13", "cvt_21", "levit_128s", "levit_128", "levit_192", "levit_256",
            "levit_384", "swin_t", "swin_s", "swin_b"} <= set(NAMES)  # fmt: skip


@pytest.mark.unit
@pytest.mark.parametrize("name", NAMES)
def test_forward_backward_every_parameter_gets_a_gradient(name):
    torch.manual_seed(0)
    model = create_model(name, img_size=SIZE, num_classes=5, drop_path_rate=0.0)
    model.train()
    x = torch.randn(2, 3, SIZE, SIZE)
    features = model.forward_head(model.forward_features(x), pre_logits=True)
    out = model.forward_head(model.forward_features(x))
    assert features.shape == (2, model.num_features) and out.shape == (2, 5)
    # The heads start at zero, so the backbone's gradient comes through the pooled features.
    (features.square().mean() + out.sum()).backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None]
    assert not no_grad, f"{name}: parameters without a gradient: {no_grad}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert torch.isfinite(out).all() and torch.isfinite(features).all()


@pytest.mark.unit
@pytest.mark.parametrize("name", NAMES)
def test_distillation_head_returns_both_logits_in_training(name):
    model = create_model(name, img_size=SIZE, num_classes=4, distilled=True)
    model.distilled_training = True
    cls, dist = model.train()(torch.randn(2, 3, SIZE, SIZE))
    assert cls.shape == dist.shape == (2, 4)
    assert model.eval()(torch.randn(2, 3, SIZE, SIZE)).shape == (2, 4)  # averaged at inference


def counted_flops(model, size: int) -> int:
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        model.eval()(torch.randn(1, 3, size, size))
    return counter.get_total_flops()


@pytest.mark.unit
@pytest.mark.parametrize("name", NAMES)
def test_flops_match_torch_flop_counter(name):
    model = create_model(name, img_size=SIZE, num_classes=10)
    analytic = flops_per_image(name, img_size=SIZE, num_classes=10)
    assert analytic == flops_per_image(model)  # the meta-device count equals the built model's
    assert analytic == pytest.approx(counted_flops(model, SIZE), rel=0.02)


@pytest.mark.unit
@pytest.mark.parametrize("name", SIMMIM)
def test_simmim_masks_reconstructs_and_exports_the_plain_encoder(name):
    torch.manual_seed(0)
    model = create_model(name, img_size=SIZE, mask_patch_size=16)
    x = torch.randn(2, 3, SIZE, SIZE)
    gen = torch.Generator().manual_seed(3)
    loss, rec, mask = model(x, generator=gen)
    assert rec.shape == x.shape
    cells = (SIZE // 16) ** 2
    assert mask.float().mean().item() == pytest.approx(math.ceil(0.6 * cells) / cells)
    # The same generator seed draws the same mask (a resumed step masks as before).
    assert torch.equal(mask, model(x, generator=torch.Generator().manual_seed(3))[2])
    loss.backward()
    assert model.encoder.mask_token.grad is not None and model.encoder.mask_token.grad.abs().sum() > 0
    # L1 over the masked pixels only (SimMIM's loss), every channel.
    p = model.patch_size
    masked = mask.repeat_interleave(p, 1).repeat_interleave(p, 2)[:, None].expand_as(x)
    assert loss.item() == pytest.approx((rec - x).abs()[masked].mean().item(), rel=1e-4)
    encoder = model.export_encoder(num_classes=7)
    assert not any("mask_token" in k for k in encoder.state_dict())
    assert encoder(x).shape == (2, 7)
    assert flops_per_image(model) == pytest.approx(counted_flops_simmim(model, x[:1]), rel=0.02)


def counted_flops_simmim(model, x) -> int:
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        model.eval()(x, generator=torch.Generator().manual_seed(0))
    return counter.get_total_flops()


@pytest.mark.unit
def test_levit_cannot_be_wrapped_by_simmim_and_says_why():
    from pipeline.models.simmim import SimMIM

    with pytest.raises(ValueError, match="levit_debug .* does not support masked image modelling"):
        SimMIM("levit_debug", img_size=32, mask_patch_size=16)


# ---------------------------------------------------------------------- training through the real loop

DEBUG = ["tnt_debug", "cvt_debug", "levit_debug", "swin_debug"]


@pytest.mark.dist
@pytest.mark.slow
def test_each_family_trains_under_every_zero_stage_with_distillation_and_simmim(tmp_path):
    from test_training import history, torchrun, weights  # the same launcher and readers as the ViT runs

    from data_prep.synthetic import class_names, synthetic_samples
    from data_prep.writer import write_dataset

    data = tmp_path / "data"
    write_dataset(data, synthetic_samples(320, 8, seed=0, width=48, height=40), class_names(8), True, 40)
    runs = [f"{m}_zero2:{m}:supervised_softmax:2:40" for m in DEBUG]
    runs += [f"{m}_zero{z}:{m}:supervised_sigmoid:{z}:4" for m in DEBUG for z in (0, 3)]
    runs += ["levit_deit:levit_debug:distill:2:20:TEACHER=swin_debug_zero2",  # LeViT's own distillation head
             "simmim_swin:simmim_swin_debug:simmim:2:40", "simmim_cvt:simmim_cvt_debug:simmim:3:4",
             "simmim_tnt:simmim_tnt_debug:simmim:0:4"]  # fmt: skip
    torchrun("tests/scripts/families.py", str(tmp_path / "out"), str(data), *runs)
    out = tmp_path / "out"
    for m in DEBUG:
        losses = [v for _, v in history(out / f"{m}_zero2")]
        assert len(losses) == 40
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        assert last < 0.9 * first, f"{m}: loss did not fall ({first:.4f} -> {last:.4f})"
        for z in (0, 3):
            short = [v for _, v in history(out / f"{m}_zero{z}")]
            assert len(short) == 4 and all(math.isfinite(v) for v in short), f"{m} ZeRO-{z}: {short}"
            assert weights(out / f"{m}_zero{z}").keys() == weights(out / f"{m}_zero2").keys()
    agreement = [v for _, v in history(out / "levit_deit", "train/teacher_agreement")]
    assert len(agreement) == 20
    assert any(k.startswith("head_dist.") for k in weights(out / "levit_deit"))
    simmim = [v for _, v in history(out / "simmim_swin")]
    assert sum(simmim[-5:]) / 5 < 0.9 * sum(simmim[:5]) / 5, f"SimMIM loss did not fall: {simmim}"
    # SimMIM exports the plain encoder, which the supervised model of the same family loads.
    from pipeline.stage import init_weights

    for run, model in (
        ("simmim_swin", "swin_debug"),
        ("simmim_cvt", "cvt_debug"),
        ("simmim_tnt", "tnt_debug"),
    ):
        plain = create_model(model, num_classes=10)
        init_weights(plain, str(out / run / "export"), init_head=False)
        exported = weights(out / run)
        assert all(
            torch.equal(plain.state_dict()[k], v) for k, v in exported.items() if not k.startswith("head")
        )
