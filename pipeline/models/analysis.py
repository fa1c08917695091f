"""The ViT paper's Figure 7: what a trained Vision Transformer learned, as arrays and figures.

    from pipeline.models.analysis import (
        mean_attention_distance, patch_embed_components, pos_embed_similarity)
    sim, fig = pos_embed_similarity(model)                 # center: position-embedding similarity
    comps, fig = patch_embed_components(model, n=28)       # left: principal components of the filters
    dist, fig = mean_attention_distance(model, images)     # right: attention distance per head and depth
    fig.savefig("pos_embed_similarity.png", dpi=150)

Figures are `matplotlib.figure.Figure` objects built without pyplot's global state, so this runs in
training jobs and threads without a display. Models are read, never modified: attention weights are
recomputed from each block's input and its `attn.qkv`. An MAE model (anything with an `encoder` ViT)
is analysed through its encoder.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from pipeline.models.hybrid import HybridEmbed
from pipeline.models.vit import VisionTransformer

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def new_figure(figsize: tuple[float, float]) -> Figure:
    # Imported here: matplotlib takes seconds to load, and only drawing needs it (not the arrays, nor
    # the training and evaluation processes that import this module and never draw).
    from matplotlib.figure import Figure

    return Figure(figsize=figsize)


def _vit(model: nn.Module) -> VisionTransformer:
    if isinstance(model, VisionTransformer):
        return model
    encoder = getattr(model, "encoder", None)
    if isinstance(encoder, VisionTransformer):  # MAE, masked patch prediction
        return encoder
    raise TypeError(
        f"expected a VisionTransformer or a model with an `encoder` ViT, got {type(model).__name__}"
    )


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float64).numpy()


# ---------------------------------------------------------------------- position embeddings


def pos_embed_similarity(model: nn.Module) -> tuple[np.ndarray, Figure]:
    """Cosine similarity of each patch's position embedding with every other patch's.

    Returns sim [H*W, H, W]: sim[i] is the similarity map of patch i (row-major) over the grid, and a
    figure with one small map per patch position laid out on the grid (Figure 7, center).
    """
    vit = _vit(model)
    pos = vit.patch_pos_embed()  # [1, N, D] or None
    if pos is None:
        raise ValueError(
            f"the model has no absolute position embedding (pos_embed={vit.pos_embed_kind!r}); "
            "use 'learned', 'learned_2d' or 'sincos2d'"
        )
    h, w = vit.grid_size
    e = _numpy(pos[0])  # [N, D]
    e = e / np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-12)
    sim = (e @ e.T).reshape(h * w, h, w)  # [N, H, W]
    return sim, _similarity_figure(sim, h, w)


def _similarity_figure(sim: np.ndarray, h: int, w: int) -> Figure:
    # One mosaic image with NaN gutters instead of H*W subplots: the same picture, drawn in a fraction
    # of the time (196 axes for ViT-B/16 take seconds to lay out).
    mosaic = np.full((h * (h + 1) - 1, w * (w + 1) - 1), np.nan)
    for i in range(h * w):
        r, c = divmod(i, w)
        mosaic[r * (h + 1) : r * (h + 1) + h, c * (w + 1) : c * (w + 1) + w] = sim[i]
    # The colour scale spans the similarities between different patches: a patch with itself is always 1,
    # and a fixed -1..1 scale paints a model whose similarities all lie in 0.8..1 one flat colour.
    others = sim.reshape(h * w, h * w)[~np.eye(h * w, dtype=bool)]
    lo, hi = (float(others.min()), float(others.max())) if others.size else (-1.0, 1.0)
    fig = new_figure((6.0, 5.2))
    ax = fig.add_subplot()
    img = ax.imshow(mosaic, cmap="viridis", vmin=lo, vmax=max(hi, lo + 1e-6), interpolation="nearest")
    ax.set_xticks([c * (w + 1) + (w - 1) / 2 for c in range(w)], [str(c + 1) for c in range(w)], fontsize=6)
    ax.set_yticks([r * (h + 1) + (h - 1) / 2 for r in range(h)], [str(r + 1) for r in range(h)], fontsize=6)
    ax.set_xlabel("Input patch column")
    ax.set_ylabel("Input patch row")
    ax.set_title("Position embedding similarity")
    fig.colorbar(img, ax=ax, label=f"Cosine similarity (scale {lo:.2f} to {hi:.2f})")
    return fig


# ---------------------------------------------------------------------- patch-embedding filters


def patch_embed_components(model: nn.Module, n: int = 28) -> tuple[np.ndarray, Figure]:
    """The first n principal components of the patch-embedding filters [n, C, p, p] and their figure.

    Each of the D filters of `patch_embed.proj` [D, C, p, p] is one sample; components are the
    eigenvectors of their covariance, largest variance first, each of unit norm (Figure 7, left).
    """
    vit = _vit(model)
    if isinstance(vit.patch_embed, HybridEmbed):
        raise ValueError(
            "the hybrid stem embeds 1x1 patches of ResNet features: its projection has no image-space "
            "filters to decompose"
        )
    weight = vit.patch_embed.proj.weight  # [D, C, p, p]
    d, c, ph, pw = weight.shape
    x = _numpy(weight).reshape(d, c * ph * pw)  # [D, C*p*p]: one row per filter
    x = x - x.mean(axis=0, keepdims=True)  # PCA is over the filters' spread about their mean
    if not 1 <= n <= min(d, c * ph * pw):
        raise ValueError(
            f"n must be in [1, {min(d, c * ph * pw)}] for {d} filters of size {c}x{ph}x{pw}, got {n}"
        )
    _, _, vt = np.linalg.svd(x, full_matrices=False)  # rows of vt: components, by decreasing variance
    components = vt[:n].reshape(n, c, ph, pw)  # [n, C, p, p]
    return components, _components_figure(components)


def _components_figure(components: np.ndarray) -> Figure:
    n, c = components.shape[:2]
    cols = min(n, 7)  # the paper's 4 x 7 grid for 28 components
    rows = -(-n // cols)
    fig = new_figure((cols * 0.9, rows * 0.9 + 0.4))
    fig.suptitle("RGB embedding filters\n(first principal components)", fontsize=8)
    for i, comp in enumerate(components):
        ax = fig.add_subplot(rows, cols, i + 1)
        # Scale each component to [0, 1] on its own: sign and scale of a component are arbitrary.
        lo, hi = comp.min(), comp.max()
        comp = (comp - lo) / (hi - lo) if hi > lo else np.zeros_like(comp)
        ax.imshow(comp.transpose(1, 2, 0) if c == 3 else comp.mean(axis=0), cmap=None if c == 3 else "gray")
        ax.set_axis_off()
    return fig


# ---------------------------------------------------------------------- attention distance


def _patch_distances(grid: tuple[int, int], patch_size: int) -> torch.Tensor:
    """Pixel distance between the centres of every pair of patches [N, N]."""
    rows, cols = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing="ij")
    coords = torch.stack([rows.flatten(), cols.flatten()], dim=1).double()  # [N, 2]
    return torch.cdist(coords, coords) * patch_size


def _attention_weights(attn: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + bias) exactly as layers.Attention computes it, [B, heads, T, T]."""
    b, t, d = x.shape
    heads = attn.num_heads
    qkv = attn.qkv(x).reshape(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
    q, k = qkv[0].double(), qkv[1].double()  # [B, heads, T, d/heads]
    logits = q @ k.transpose(-2, -1) * (d // heads) ** -0.5  # [B, heads, T, T]
    if bias is not None:
        logits = logits + bias.double()  # [heads, T, T], broadcast over B
    return logits.softmax(dim=-1)


@torch.no_grad()
def mean_attention_distance(model: nn.Module, images: torch.Tensor) -> tuple[np.ndarray, Figure]:
    """Attention-weighted mean distance in pixels between query and key patches [depth, heads].

    For every layer and head: for each patch query, the mean distance to the patches it attends to,
    weighted by attention; then averaged over queries and images (the "attention distance" of
    Figure 7, right, analogous to a CNN's receptive field). Prefix tokens (class, distillation) are
    left out as queries and as keys; the weights over patch keys are renormalised to sum to one,
    since the mass on a prefix token has no position.
    """
    vit = _vit(model)
    if images.ndim != 4:
        raise ValueError(f"images must be [B, C, H, W], got shape {tuple(images.shape)}")
    prefix = vit.num_prefix_tokens
    dist = _patch_distances(vit.grid_size, vit.patch_embed.patch_size).to(images.device)  # [N, N]
    per_layer: list[torch.Tensor] = []

    def record(attn: nn.Module, args: tuple, kwargs: dict) -> None:
        # The normed block input and the position bias, however the block passes them.
        x = args[0] if args else kwargs["x"]
        bias = args[1] if len(args) > 1 else kwargs.get("attn_bias")
        a = _attention_weights(attn, x, bias)[:, :, prefix:, prefix:]  # [B, heads, N, N]
        a = a / a.sum(dim=-1, keepdim=True)
        per_query = (a * dist).sum(dim=-1)  # [B, heads, N]
        per_layer.append(per_query.mean(dim=(0, 2)))  # [heads]

    hooks = [blk.attn.register_forward_pre_hook(record, with_kwargs=True) for blk in vit.blocks]
    was_training = vit.training
    try:
        vit.eval()  # no drop path: the attention of the model as it is used
        vit.forward_features(images)
    finally:
        vit.train(was_training)
        for h in hooks:
            h.remove()
    result = _numpy(torch.stack(per_layer))  # [depth, heads]
    return result, _distance_figure(result, images.shape[-1])


def _distance_figure(dist: np.ndarray, img_size: int) -> Figure:
    depth, heads = dist.shape
    fig = new_figure((4.5, 3.5))
    ax = fig.add_subplot()
    layers = np.repeat(np.arange(1, depth + 1), heads)
    ax.scatter(layers, dist.reshape(-1), s=10, alpha=0.7)
    ax.set_xlabel("Network depth (layer)")
    ax.set_ylabel("Mean attention distance (pixels)")
    ax.set_xlim(0, depth + 1)
    ax.set_ylim(0, img_size)
    ax.set_title(f"Mean attention distance, {heads} heads")
    fig.tight_layout()
    return fig
