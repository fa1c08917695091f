"""Named model variants: `create_model("vit_b16", num_classes=10)`, `list_models()`.

A name selects a published shape (ViT paper, Table 1); keyword overrides change any option.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from pipeline.models.vit import VisionTransformer

_REGISTRY: dict[str, Callable[..., nn.Module]] = {}


def register(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    _REGISTRY[fn.__name__] = fn
    return fn


def list_models() -> list[str]:
    return sorted(_REGISTRY)


def create_model(name: str, **overrides) -> nn.Module:
    if name not in _REGISTRY:
        raise KeyError(f"unknown model {name!r}; registered: {', '.join(list_models())}")
    return _REGISTRY[name](**overrides)


def _vit(patch_size: int, embed_dim: int, depth: int, num_heads: int, mlp_dim: int, /, **overrides):
    # Positional-only shape, so an override may name any of them (create_model("vit_b16", depth=2)).
    kw = dict(patch_size=patch_size, embed_dim=embed_dim, depth=depth, num_heads=num_heads, mlp_dim=mlp_dim)
    return VisionTransformer(**{**kw, **overrides})


@register
def vit_debug(**kw):
    """Tiny ViT for tests and smoke runs: 32px images, 8px patches, 4 blocks of width 64."""
    return _vit(8, 64, 4, 4, 128, **{"img_size": 32, **kw})


@register
def vit_ti16(**kw):
    return _vit(16, 192, 12, 3, 768, **kw)


@register
def vit_s16(**kw):
    return _vit(16, 384, 12, 6, 1536, **kw)


@register
def vit_b16(**kw):
    return _vit(16, 768, 12, 12, 3072, **kw)


@register
def vit_b32(**kw):
    return _vit(32, 768, 12, 12, 3072, **kw)


@register
def vit_l16(**kw):
    return _vit(16, 1024, 24, 16, 4096, **kw)


@register
def vit_l32(**kw):
    return _vit(32, 1024, 24, 16, 4096, **kw)


@register
def vit_h14(**kw):
    return _vit(14, 1280, 32, 16, 5120, **kw)


@register
def vit_g14(**kw):
    return _vit(14, 1408, 40, 16, 6144, **kw)


@register
def vit_G14(**kw):
    """ViT-G/14 of "Scaling Vision Transformers" (Zhai et al. 2022): width 1664, depth 48, MLP 8192, 16 heads."""
    return _vit(14, 1664, 48, 16, 8192, **kw)


@register
def vit_r50_b16(**kw):
    """R50+ViT-B/16 hybrid: ResNet-50 stages (3, 4, 9) at stride 16 feed 1x1 patches into ViT-B."""
    return _vit(16, 768, 12, 12, 3072, **{"hybrid_layers": (3, 4, 9), **kw})
