"""The registry: ViT sizes against the paper, and what every registered model is (the selection that
every registry-generated test sweeps, tests/conftest.py `models_for`)."""

import pytest
import torch
from conftest import KINDS, is_debug_size, meta_model, model_kinds, models_for

from pipeline.models import create_model, list_models

pytestmark = pytest.mark.unit


def vit_param_count(patch, width, depth, mlp, classes, img=224, channels=3):
    """The exact parameter count of a class-token ViT (timm layout)."""
    tokens = (img // patch) ** 2 + 1
    embed = channels * patch * patch * width + width + width + tokens * width
    block = (
        2 * 2 * width
        + (3 * width * width + 3 * width)
        + (width * width + width)
        + 2 * (width * mlp)
        + mlp
        + width
    )
    return embed + depth * block + 2 * width + width * classes + classes


@pytest.mark.parametrize(
    "name,shape,paper",
    [
        ("vit_b16", (16, 768, 12, 3072), 86e6),
        ("vit_l16", (16, 1024, 24, 4096), 307e6),
        ("vit_h14", (14, 1280, 32, 5120), 632e6),
        ("vit_G14", (14, 1664, 48, 8192), 1843e6),  # Zhai et al. 2022, Table 2
    ],
)
def test_parameter_counts_match_paper_and_formula(name, shape, paper):
    with torch.device("meta"):  # count without allocating weights
        model = create_model(name, num_classes=1000)
    n = sum(p.numel() for p in model.parameters())
    assert n == vit_param_count(*shape, classes=1000)
    assert abs(n - paper) / paper < 0.01


def test_vit_debug_forward_backward_every_parameter_gets_a_gradient():
    torch.manual_seed(0)
    model = create_model("vit_debug", num_classes=5)
    x = torch.randn(2, 3, 32, 32)
    logits = model(x)
    assert logits.shape == (2, 5)
    assert torch.all(logits == 0)  # zero-initialised head: logits start at the head bias
    # The zero head passes no gradient back, so probe the features with a random projection too.
    probe = torch.randn(2, model.embed_dim)
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor([1, 2]))
    loss = loss + (model.forward_head(model.forward_features(x), pre_logits=True) * probe).sum()
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_gap_pooling_and_head_bias_overrides():
    model = create_model("vit_debug", num_classes=3, pool="gap", head_bias_init=-10.0)
    assert model.cls_token is None
    out = model(torch.randn(1, 3, 32, 32))
    assert torch.allclose(out, torch.full((1, 3), -10.0))


def test_registry_lists_the_family_and_rejects_unknown_names():
    assert {"vit_debug", "vit_ti16", "vit_b16", "vit_h14", "vit_g14", "vit_G14"} <= set(list_models())
    with pytest.raises(KeyError, match="unknown model 'vit_x'"):
        create_model("vit_x")


@pytest.mark.parametrize("name", list_models())
def test_every_registered_model_is_of_a_kind_the_tests_sweep(name):
    """A new model lands in the registry-generated tests by what it is; one of no known kind fails here."""
    kinds = model_kinds(name)
    assert kinds <= set(KINDS) and kinds & {"classifier", "masked_image", "segmentation", "detection"}, (
        name,
        kinds,
    )


def test_every_family_has_a_debug_size():
    """Training and CPU-heavy tests sweep the debug sizes: a family without one would train in no test."""
    families = {type(meta_model(n)) for n in list_models()}
    with_debug = {type(meta_model(n)) for n in list_models() if is_debug_size(n)}
    assert families == with_debug, f"families without a *_debug size: {families - with_debug}"
    for name in filter(is_debug_size, list_models()):
        assert sum(p.numel() for p in meta_model(name).parameters()) < 1_000_000, name


def test_model_selection_rejects_unknown_kinds_and_exclusions_without_a_reason():
    with pytest.raises(ValueError, match="kind must be one of"):
        models_for("resnet")
    with pytest.raises(ValueError, match="name no selected vit model"):
        models_for("vit", exclude={"swin_debug": "not a ViT"})
    with pytest.raises(ValueError, match="needs a reason"):
        models_for("vit", exclude={"vit_debug": " "})
    assert "vit_debug" not in models_for("vit", exclude={"vit_debug": "a reason"})


@pytest.mark.parametrize("name", models_for("masked_image", debug=True))
def test_every_masked_image_model_exports_a_classifier(name):
    """MAE, masked patch prediction and SimMIM (any size: the code is the same) hand fine-tuning a plain
    classifier of their encoder's family: no decoder or mask token, a new zero-initialised head."""
    torch.manual_seed(0)
    classifier = create_model(name, num_classes=7).export_encoder().eval()
    assert hasattr(classifier, "forward_features") and hasattr(classifier, "forward_head")
    assert not any("mask_token" in k or k.startswith("decoder") for k in classifier.state_dict())
    with torch.no_grad():
        assert torch.all(classifier(torch.randn(2, 3, 32, 32)) == torch.zeros(2, 7))
