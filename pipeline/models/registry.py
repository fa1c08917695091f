"""Named model variants: `create_model("vit_b16", num_classes=10)`, `list_models()`.

A name selects a published shape; keyword overrides change any option. Each family registers its
variants in its own module (`vit.py`: vit_*, `mae.py`: mae_vit_*, ...); importing `pipeline.models`
imports them all.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

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
