"""Optimizer parameter groups: weight-decay exclusions and layer-wise learning-rate decay.

groups = param_groups(model, weight_decay=0.05, layer_decay=0.75)   # each group has "lr_scale"
"""

from __future__ import annotations

from torch import nn

NO_DECAY_NAMES = (
    "pos_embed",
    "pos_embed_row",
    "pos_embed_col",
    "cls_token",
    "dist_token",
    "mask_token",
    "mask_token_pixel",
    "relative_position_bias_table",  # ViT, Swin
    "patch_pos",
    "pixel_pos",  # TNT's position embeddings
    "attention_biases",
)  # LeViT's attention bias by offset


def layer_id(name: str, num_layers: int) -> int:
    """0 for the embeddings, i + 1 for `blocks.i.*`, num_layers + 1 for the final norm and heads (BEiT, MAE)."""
    if name.startswith(("patch_embed", "cls_token", "dist_token", "pos_embed", "mask_token")):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return num_layers + 1


def no_weight_decay(name: str, param: nn.Parameter) -> bool:
    """Norms, biases, position embeddings and tokens carry no weight decay."""
    return param.ndim <= 1 or name.split(".")[-1] in NO_DECAY_NAMES


def _flat_blocks(model: nn.Module) -> tuple[int, str]:
    """(blocks, parameter-name prefix) of the flat block list layer decay follows: the model's, or its
    encoder's (SETR, MAE); (0, "") for a model without one."""
    if hasattr(model, "blocks"):
        return len(model.blocks), ""
    encoder = getattr(model, "encoder", None)
    if encoder is not None and hasattr(encoder, "blocks"):
        return len(encoder.blocks), "encoder."
    return 0, ""


def param_groups(model: nn.Module, weight_decay: float, layer_decay: float | None = None) -> list[dict]:
    """Groups by (decay or not, layer); `lr_scale` = layer_decay ** (num_layers + 1 - layer_id).

    Layer decay follows a flat `blocks` list (ViT, TNT), or its encoder's (SETR: `encoder.blocks`, the
    decoder counting as the head); the hierarchical families (CvT, LeViT, Swin) have none, so every group
    keeps lr_scale 1 there.
    """
    num_layers, prefix = _flat_blocks(model)
    groups: dict[tuple[bool, int], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = not no_weight_decay(name, p)
        lid = layer_id(name.removeprefix(prefix), num_layers) if layer_decay is not None else 0
        scale = layer_decay ** (num_layers + 1 - lid) if layer_decay is not None else 1.0
        g = groups.setdefault(
            (decay, lid), {"params": [], "weight_decay": weight_decay if decay else 0.0, "lr_scale": scale}
        )
        g["params"].append(p)
    return list(groups.values())
