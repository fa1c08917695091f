"""Registry-generated smoke tests and the ViT variants: position embeddings, pooling, distillation, hybrid."""

import pytest
import torch
from conftest import is_debug_size, meta_model, models_for

from pipeline.models import VisionTransformer, create_model, layer_id, param_groups
from pipeline.models.convert import CheckpointMismatch, export_timm_state_dict, load_timm_state_dict
from pipeline.models.pos_embed import POS_EMBED_KINDS

pytestmark = pytest.mark.unit


def _grad_check(model: VisionTransformer, x: torch.Tensor) -> None:
    """Every parameter gets a finite, nonzero gradient (the zero-initialised head is probed separately)."""
    out = model(x)
    out = out[0] + out[1] if isinstance(out, tuple) else out
    probe = torch.randn(x.shape[0], model.embed_dim)
    loss = (
        out.logsumexp(-1).sum()
        + (model.forward_head(model.forward_features(x), pre_logits=True) * probe).sum()
    )
    if model.dist_token is not None:  # the distillation token reaches the loss only through head_dist
        loss = loss + (model.forward_features(x)[:, 1] * probe).sum()
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        if not name.startswith(("head.weight", "head_dist.weight")):
            assert p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("name", models_for("vit"))
def test_every_registered_vit_trains(name):
    """Forward and backward of every registered ViT; big ones at reduced depth and a 2x2 patch grid."""
    torch.manual_seed(0)
    patch = meta_model(name).patch_embed.patch_size
    kw = {} if is_debug_size(name) else {"img_size": 2 * patch, "depth": 1}
    model = create_model(name, num_classes=3, **kw)
    size = model.grid_size[0] * patch
    _grad_check(model, torch.randn(2, 3, size, size))


@pytest.mark.parametrize("pos_embed", POS_EMBED_KINDS)
@pytest.mark.parametrize("pool", ["cls", "gap"])
def test_position_embeddings_and_pooling(pos_embed, pool):
    torch.manual_seed(0)
    model = create_model("vit_debug", num_classes=4, pos_embed=pos_embed, pool=pool)
    _grad_check(model, torch.randn(2, 3, 32, 32))


def test_position_embedding_breaks_permutation_symmetry():
    """Without position information a gap model is invariant to shuffling the patches; with it, not."""
    torch.manual_seed(0)
    x = torch.randn(1, 3, 32, 32)
    # Swap two 8x8 patches.
    y = x.clone()
    y[..., :8, :8], y[..., 8:16, 8:16] = x[..., 8:16, 8:16], x[..., :8, :8]
    for kind, invariant in (
        ("none", True),
        ("learned", False),
        ("learned_2d", False),
        ("sincos2d", False),
        ("relative", False),
    ):
        m = create_model("vit_debug", pos_embed=kind, pool="gap").eval()
        same = torch.allclose(m.forward_features(x).mean(1), m.forward_features(y).mean(1), atol=1e-5)
        assert same == invariant, kind


def test_distillation_token_two_heads_averaged_at_inference():
    torch.manual_seed(0)
    m = create_model("vit_debug", num_classes=5, distilled=True)
    for head in (m.head, m.head_dist):
        torch.nn.init.normal_(head.weight)
    x = torch.randn(2, 3, 32, 32)
    m.distilled_training = True
    cls_logits, dist_logits = m.train()(x)
    m.eval()
    assert torch.allclose(m(x), (cls_logits + dist_logits) / 2, atol=1e-6)
    assert m.pos_embed.shape == (1, 2 + 16, 64)
    with pytest.raises(ValueError, match="distilled=True needs pool='cls'"):
        create_model("vit_debug", distilled=True, pool="gap")


def test_stochastic_depth_and_layer_scale():
    m = create_model("vit_debug", drop_path_rate=0.2, init_values=1e-5)
    assert [round(b.drop_path.p, 4) if hasattr(b.drop_path, "p") else 0.0 for b in m.blocks] == [
        0.0,
        0.0667,
        0.1333,
        0.2,
    ]
    assert torch.all(m.blocks[0].ls1.gamma == 1e-5)
    x = torch.randn(2, 3, 32, 32)
    m.eval()
    assert torch.equal(m.forward_features(x), m.forward_features(x))  # no randomness at eval
    m.train()
    x = torch.randn(16, 3, 32, 32)  # 16 samples in 3 blocks with drop path: two seeds' draws differ
    torch.manual_seed(1)
    a = m.forward_features(x)
    torch.manual_seed(2)
    b = m.forward_features(x)
    assert not torch.equal(a, b)  # branches dropped at random in training


def test_activation_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    a = create_model("vit_debug", pool="gap")
    b = create_model("vit_debug", pool="gap", grad_checkpointing=True)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 3, 32, 32)
    for m in (a, b):
        m.forward_features(x).square().sum().backward()
    compared = 0
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        if n.startswith(("fc_norm", "head")):
            continue  # not used by forward_features
        assert torch.allclose(p.grad, q.grad, atol=1e-6), n
        compared += 1
    assert compared > 20


def test_hybrid_stem_shape():
    m = create_model("vit_r50_b16", img_size=64, depth=1, num_classes=2)
    assert m.grid_size == (4, 4) and m.patch_embed.backbone.out_channels == 1024
    assert [len(s) for s in m.patch_embed.backbone.stages] == [3, 4, 9]
    assert m(torch.randn(1, 3, 64, 64)).shape == (1, 2)


@pytest.mark.parametrize("pos_embed", ["learned", "learned_2d", "sincos2d", "relative"])
def test_resolution_change_resamples_position_embeddings(pos_embed):
    torch.manual_seed(0)
    m = create_model("vit_debug", pos_embed=pos_embed, distilled=True, num_classes=3)
    before = m.pos_embed[:, :2].clone() if pos_embed == "learned" else None
    m.set_grid(48)
    assert m.grid_size == (6, 6)
    out = m(torch.randn(1, 3, 48, 48))
    assert out.shape == (1, 3)
    if pos_embed == "learned":
        assert m.pos_embed.shape == (1, 2 + 36, 64)
        assert torch.equal(m.pos_embed[:, :2], before)  # class and distillation rows kept as they are


def test_resampling_a_smooth_embedding_stays_close():
    """Bicubic resampling 4x4 -> 8x8 -> 4x4 of a smooth table returns close to where it started."""
    from pipeline.models.pos_embed import resample_abs_pos_embed, sincos_2d

    table = torch.cat([torch.zeros(1, 1, 64), sincos_2d(4, 4, 64, temperature=4.0)[None]], dim=1)
    back = resample_abs_pos_embed(resample_abs_pos_embed(table, (8, 8), 1), (4, 4), 1)
    assert torch.equal(back[:, :1], table[:, :1])
    assert (back - table).abs().max() < 0.15


def test_timm_layout_round_trip_and_resampled_load():
    torch.manual_seed(0)
    src = create_model("vit_debug", num_classes=5, distilled=True).eval()
    for head in (src.head, src.head_dist):
        torch.nn.init.normal_(head.weight)
    sd = export_timm_state_dict(src)
    expected = {
        "patch_embed.proj.weight",
        "cls_token",
        "dist_token",
        "pos_embed",
        "blocks.0.norm1.weight",
        "blocks.0.attn.qkv.weight",
        "blocks.0.attn.proj.bias",
        "blocks.3.mlp.fc2.weight",
        "norm.weight",
        "head.weight",
        "head_dist.bias",
    }
    assert expected <= set(sd)
    dst = load_timm_state_dict(create_model("vit_debug", num_classes=5, distilled=True), {"model": sd}).eval()
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(dst(x), src(x))
    # Another grid: position embeddings are resampled, the forward still runs.
    big = load_timm_state_dict(create_model("vit_debug", num_classes=5, distilled=True, img_size=48), sd)
    assert big.pos_embed.shape == (1, 2 + 36, 64)
    # A new head for another class count.
    ft = load_timm_state_dict(create_model("vit_debug", num_classes=7, distilled=True), sd, strict_head=False)
    assert torch.all(ft.head.weight == 0)


def test_mismatched_checkpoint_lists_missing_and_unexpected_keys():
    sd = export_timm_state_dict(create_model("vit_debug"))
    sd.pop("blocks.1.attn.qkv.weight")
    sd["blocks.9.extra"] = torch.zeros(1)
    sd["decoder_embed.weight"] = torch.zeros(1)  # MAE's decoder is ignored, not an error
    with pytest.raises(CheckpointMismatch) as err:
        load_timm_state_dict(create_model("vit_debug"), sd)
    assert err.value.missing == ["blocks.1.attn.qkv.weight"]
    assert err.value.unexpected == ["blocks.9.extra"]
    assert "missing keys (1): blocks.1.attn.qkv.weight" in str(err.value)


def test_param_groups_and_layer_ids():
    m = create_model("vit_debug", num_classes=3)
    assert layer_id("patch_embed.proj.weight", 4) == 0 and layer_id("cls_token", 4) == 0
    assert layer_id("blocks.2.attn.qkv.weight", 4) == 3 and layer_id("head.weight", 4) == 5
    groups = param_groups(m, weight_decay=0.05, layer_decay=0.5)
    by_param = {id(p): g for g in groups for p in g["params"]}
    named = dict(m.named_parameters())
    assert by_param[id(named["pos_embed"])]["weight_decay"] == 0.0
    assert by_param[id(named["blocks.0.norm1.weight"])]["weight_decay"] == 0.0
    assert by_param[id(named["blocks.0.attn.qkv.bias"])]["weight_decay"] == 0.0
    assert by_param[id(named["blocks.0.attn.qkv.weight"])]["weight_decay"] == 0.05
    assert by_param[id(named["head.weight"])]["lr_scale"] == 1.0
    assert by_param[id(named["blocks.3.mlp.fc1.weight"])]["lr_scale"] == 0.5
    assert by_param[id(named["patch_embed.proj.weight"])]["lr_scale"] == 0.5**5
    assert sum(len(g["params"]) for g in groups) == len(named)
