"""The ViT paper's Figure 7 analyses on crafted models whose answers are known in closed form."""

import itertools
import math

import numpy as np
import pytest
import torch

from pipeline.models import create_model
from pipeline.models.analysis import mean_attention_distance, patch_embed_components, pos_embed_similarity

pytestmark = pytest.mark.unit


def assert_png(fig, path) -> None:
    fig.savefig(path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 1024


def mean_pairwise_patch_distance(grid: int, patch: int) -> float:
    """Mean Euclidean distance in pixels over all ordered pairs of patches (self-pairs included)."""
    cells = list(itertools.product(range(grid), range(grid)))
    total = sum(math.dist(a, b) for a in cells for b in cells)
    return patch * total / len(cells) ** 2


# ---------------------------------------------------------------------- position embeddings


@pytest.mark.parametrize("pos_embed", ["learned", "learned_2d", "sincos2d"])
def test_pos_embed_similarity_shape_and_unit_diagonal(pos_embed, tmp_path):
    torch.manual_seed(0)
    model = create_model("vit_debug", pos_embed=pos_embed)  # 4x4 grid
    sim, fig = pos_embed_similarity(model)
    assert sim.shape == (16, 4, 4)
    for i in range(16):
        assert sim[i].reshape(-1)[i] == pytest.approx(1.0, abs=1e-6)  # each patch with itself
    assert np.all(np.abs(sim) <= 1 + 1e-6)
    assert_png(fig, tmp_path / "sim.png")


def test_pos_embed_similarity_colour_scale_spans_the_patches_similarities():
    """All similarities between different patches in 0.8..1 (a shared offset dominates) still get the whole
    colour scale: the figure's limits are the smallest and largest similarity of two different patches."""
    torch.manual_seed(0)
    model = create_model("vit_debug")
    with torch.no_grad():
        model.pos_embed.copy_(torch.randn(1, 1, 64) * 3 + 0.3 * torch.randn_like(model.pos_embed))
    sim, fig = pos_embed_similarity(model)
    others = sim.reshape(16, 16)[~np.eye(16, dtype=bool)]
    assert others.min() > 0.8  # a -1..1 scale would paint this one colour
    assert fig.axes[0].images[0].get_clim() == pytest.approx((others.min(), others.max()))


def test_sincos_neighbours_are_more_similar_than_far_patches():
    model = create_model("vit_debug", pos_embed="sincos2d", img_size=64)  # 8x8 grid
    sim, _ = pos_embed_similarity(model)
    rows, cols = np.meshgrid(np.arange(8), np.arange(8), indexing="ij")
    for i in range(64):
        r, c = divmod(i, 8)
        distance = np.hypot(rows - r, cols - c)  # [8, 8] in patches
        assert sim[i][distance == 1].min() > sim[i][distance >= 2].max()
    # Sin-cos similarity is not monotone at long range (its high frequencies wrap): only near offsets.
    along_row = sim[0][0, :4]
    assert np.all(np.diff(along_row) < 0)


def test_pos_embed_similarity_needs_an_absolute_embedding():
    for kind in ("relative", "none"):
        with pytest.raises(ValueError, match="no absolute position embedding"):
            pos_embed_similarity(create_model("vit_debug", pos_embed=kind))


def test_an_mae_model_is_analysed_through_its_encoder():
    sim, _ = pos_embed_similarity(create_model("mae_vit_debug"))
    assert sim.shape == (16, 4, 4)


# ---------------------------------------------------------------------- patch-embedding filters


def test_patch_embed_components_are_orthonormal_and_ordered_by_variance(tmp_path):
    torch.manual_seed(0)
    model = create_model("vit_debug")  # 64 filters of 3x8x8
    comps, fig = patch_embed_components(model, n=28)
    assert comps.shape == (28, 3, 8, 8)
    flat = comps.reshape(28, -1)
    np.testing.assert_allclose(flat @ flat.T, np.eye(28), atol=1e-8)
    w = model.patch_embed.proj.weight.detach().double().reshape(64, -1).numpy()
    variance = ((w - w.mean(0)) @ flat.T).var(axis=0)  # [28], variance of the filters along each
    assert variance[0] == variance.max()
    assert np.all(np.diff(variance) <= 1e-12)
    assert_png(fig, tmp_path / "filters.png")


def test_first_component_recovers_a_planted_direction():
    torch.manual_seed(0)
    model = create_model("vit_debug")
    direction = torch.randn(3 * 8 * 8, dtype=torch.float64)
    direction /= direction.norm()
    scale = torch.randn(64, 1, dtype=torch.float64) * 10  # filters spread mostly along `direction`
    weight = scale * direction + 0.01 * torch.randn(64, 3 * 8 * 8, dtype=torch.float64)
    with torch.no_grad():
        model.patch_embed.proj.weight.copy_(weight.reshape(64, 3, 8, 8))
    comps, _ = patch_embed_components(model, n=4)
    assert abs(comps[0].reshape(-1) @ direction.numpy()) == pytest.approx(1.0, abs=1e-3)


def test_patch_embed_components_refuses_the_hybrid_and_too_many_components():
    with torch.device("meta"):
        hybrid = create_model("vit_r50_b16", img_size=32)
    with pytest.raises(ValueError, match="hybrid"):
        patch_embed_components(hybrid)
    with pytest.raises(ValueError, match="n must be"):
        patch_embed_components(create_model("vit_debug"), n=65)


# ---------------------------------------------------------------------- attention distance


def zero_qkv(model) -> None:
    """All attention logits equal: every query attends uniformly to every token."""
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.qkv.weight.zero_()
            blk.attn.qkv.bias.zero_()


@pytest.mark.parametrize("overrides", [{}, {"pool": "gap"}, {"distilled": True}])
def test_uniform_attention_gives_the_mean_pairwise_patch_distance(overrides, tmp_path):
    torch.manual_seed(0)
    model = create_model("vit_debug", **overrides)  # 4x4 grid of 8-pixel patches, 4 blocks x 4 heads
    zero_qkv(model)
    model.train()
    dist, fig = mean_attention_distance(model, torch.randn(2, 3, 32, 32))
    assert dist.shape == (4, 4)
    # Prefix tokens take a share of the attention but are no patch: the patch weights are renormalised.
    np.testing.assert_allclose(dist, mean_pairwise_patch_distance(4, 8), rtol=1e-10)
    assert model.training  # mode restored
    assert all(not blk.attn._forward_pre_hooks for blk in model.blocks)  # hooks removed
    assert_png(fig, tmp_path / "distance.png")


def test_relative_bias_reaches_the_recomputed_attention():
    # A bias that allows only the zero offset: every patch attends to itself, distance 0.
    model = create_model("vit_debug", pos_embed="relative")
    zero_qkv(model)
    first_patch = model.num_prefix_tokens  # the index covers [P+N, P+N] tokens
    with torch.no_grad():
        for blk in model.blocks:
            table = blk.rel_pos.relative_position_bias_table  # [offsets (+ prefix entries), heads]
            table.fill_(-1e4)
            table[blk.rel_pos.relative_position_index[first_patch, first_patch]] = 0.0  # offset (0, 0)
    dist, _ = mean_attention_distance(model, torch.randn(1, 3, 32, 32))
    np.testing.assert_allclose(dist, 0.0, atol=1e-6)


def test_trained_like_attention_distance_is_within_the_image():
    torch.manual_seed(0)
    model = create_model("vit_debug", pos_embed="sincos2d")
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.qkv.weight.normal_(std=0.5)  # peaked, head-specific attention
    dist, _ = mean_attention_distance(model, torch.randn(3, 3, 32, 32))
    assert dist.shape == (4, 4)
    assert np.all(dist >= 0) and np.all(dist <= 8 * math.hypot(3, 3))
    assert dist.std() > 0  # heads differ
