"""Public checkpoints in and out: the state-dict layout timm, DeiT and MAE publish.

    sd = torch.load("deit_base_distilled_patch16_224.pth")["model"]
    load_timm_state_dict(model, sd)           # resamples pos_embed when the grid differs
    torch.save(export_timm_state_dict(model), "vit.pth")

Our parameter names already are that layout, so conversion is: drop what the target does not use
(MAE's decoder, `mask_token`), resample position embeddings to the model's grid, and refuse with the
full list of missing and unexpected keys instead of loading half a model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from pipeline.models.pos_embed import resample_abs_pos_embed
from pipeline.models.vit import VisionTransformer

# Keys that published pretraining checkpoints carry and a plain ViT has no use for.
_IGNORED_PREFIXES = ("decoder_", "mask_token")

# Published names of our models: timm's (without the resolution suffix), DeiT's and MAE's file names. A
# checkpoint file or folder so named (or a timm folder whose config.json names its architecture) is checked
# against model.name before loading; an export records the timm name of its model (`timm_name`).
TIMM_NAMES: dict[str, str] = {
    "vit_tiny_patch16": "vit_ti16",
    "vit_small_patch16": "vit_s16",
    "vit_base_patch16": "vit_b16",
    "vit_base_patch32": "vit_b32",
    "vit_large_patch16": "vit_l16",
    "vit_large_patch32": "vit_l32",
    "vit_huge_patch14": "vit_h14",
    "vit_giant_patch14": "vit_g14",
    "vit_gigantic_patch14": "vit_G14",
    "deit_tiny_patch16": "vit_ti16",
    "deit_small_patch16": "vit_s16",
    "deit_base_patch16": "vit_b16",
    "deit_tiny_distilled_patch16": "vit_ti16",  # with the distillation token: objective distill
    "deit_small_distilled_patch16": "vit_s16",
    "deit_base_distilled_patch16": "vit_b16",
    "mae_pretrain_vit_base": "vit_b16",  # MAE's encoders (the decoder is dropped)
    "mae_pretrain_vit_large": "vit_l16",
    "mae_pretrain_vit_huge": "vit_h14",
    "mae_finetuned_vit_base": "vit_b16",
    "mae_finetuned_vit_large": "vit_l16",
    "mae_finetuned_vit_huge": "vit_h14",
}
# Our wrappers of a ViT (their encoder is what a public ViT checkpoint initialises).
_WRAPPERS = ("mae_", "mpp_", "setr_pup_", "setr_naive_", "detr_")


def published_name(path: str) -> str | None:
    """The TIMM_NAMES key a checkpoint at `path` is published under: a timm folder's config.json
    `architecture` (beside the weights), else the file's or folder's name ("deit_base_patch16_224-b5f2ef4d.pth",
    "vit_base_patch16_224.augreg_in21k", "mae_pretrain_vit_base.pth"); None for any other name."""
    p = Path(str(path).split("?", 1)[0])
    names = []
    config = (p if p.is_dir() else p.parent) / "config.json"
    if "://" not in str(path) and config.is_file():
        try:
            names.append(str(json.loads(config.read_text()).get("architecture") or ""))
        except (json.JSONDecodeError, OSError, AttributeError):
            pass
    names += [p.name, p.parent.name] if p.suffix else [p.name]
    for name in names:
        found = [k for k in TIMM_NAMES if name == k or name.startswith((f"{k}_", f"{k}-", f"{k}."))]
        if found:
            return max(found, key=len)
    return None


def encoder_name(model_name: str) -> str:
    """The plain ViT inside one of our wrappers (mae_vit_b16, setr_pup_vit_b16 -> vit_b16); others as given."""
    return next((model_name.removeprefix(w) for w in _WRAPPERS if model_name.startswith(w)), model_name)


def check_published_architecture(path: str, model_name: str) -> None:
    """Refuse a public checkpoint whose published name is another model than `model_name` (the encoder of a
    wrapper: mae_vit_b16 and setr_pup_vit_b16 take vit_b16's), naming both, before any tensor is compared."""
    published = published_name(path)
    if published is None:
        return
    base = encoder_name(model_name)
    if TIMM_NAMES[published] != base:
        raise ValueError(
            f"model.init_from {path} is {published} (our {TIMM_NAMES[published]}), but model.name is "
            f"{model_name}: set model.name: {TIMM_NAMES[published]} (img_size as you train; position "
            "embeddings are resampled)"
        )


def timm_name(model_name: str, img_size: int) -> str | None:
    """timm's name of our plain ViT `model_name` at `img_size` (vit_b16, 224 -> vit_base_patch16_224)."""
    found = next((k for k, v in TIMM_NAMES.items() if v == model_name and k.startswith("vit_")), None)
    return f"{found}_{img_size}" if found else None


class CheckpointMismatch(KeyError):
    def __init__(self, missing: list[str], unexpected: list[str], shape_errors: list[str]):
        self.missing, self.unexpected, self.shape_errors = missing, unexpected, shape_errors
        parts = []
        if missing:
            parts.append(f"missing keys ({len(missing)}): {', '.join(missing)}")
        if unexpected:
            parts.append(f"unexpected keys ({len(unexpected)}): {', '.join(unexpected)}")
        if shape_errors:
            parts.append(f"shape mismatches: {'; '.join(shape_errors)}")
        super().__init__("state dict does not fit the model: " + " | ".join(parts))

    def __str__(self) -> str:
        return self.args[0]


def unwrap_state_dict(state_dict: dict) -> dict[str, torch.Tensor]:
    """Unwrap {'model': ...} / {'state_dict': ...} and DDP's `module.` prefix."""
    for key in ("model", "state_dict"):
        if key in state_dict and isinstance(state_dict[key], dict):
            state_dict = state_dict[key]
    return {k.removeprefix("module."): v for k, v in state_dict.items()}


def load_timm_state_dict(
    model: nn.Module, state_dict: dict, strict_head: bool = True, reset_head: bool = False
) -> nn.Module:
    """Load a timm/DeiT/MAE-layout state dict into `model`, resampling a ViT's `pos_embed` to its grid.

    Any registered family loads the same way (its names are its own layout); only the plain ViT has
    absolute position embeddings to resample.

    strict_head=False drops `head.*` / `head_dist.*` of another class count (fine-tuning a new head);
    reset_head=True keeps the model's own freshly initialised heads whatever the checkpoint holds.
    """
    sd = {k: v for k, v in unwrap_state_dict(state_dict).items() if not k.startswith(_IGNORED_PREFIXES)}
    own = model.state_dict()
    if reset_head:
        sd = {k: v for k, v in sd.items() if not k.startswith(("head.", "head_dist."))}
        sd.update({k: v for k, v in own.items() if k.startswith(("head.", "head_dist."))})
    resample = isinstance(model, VisionTransformer) and "pos_embed" in sd and "pos_embed" in own
    if resample and sd["pos_embed"].shape != own["pos_embed"].shape:
        src = sd["pos_embed"]
        n_src = src.shape[1] - model.num_prefix_tokens
        side = int(round(n_src**0.5))
        if side * side != n_src:
            raise CheckpointMismatch(
                [],
                [],
                [
                    f"pos_embed {tuple(src.shape)} is not a square grid plus {model.num_prefix_tokens} prefix tokens"
                ],
            )
        sd["pos_embed"] = resample_abs_pos_embed(src, model.grid_size, model.num_prefix_tokens, (side, side))
    if not strict_head:
        for k in [
            k
            for k in sd
            if k.startswith(("head.", "head_dist.")) and k in own and sd[k].shape != own[k].shape
        ]:
            sd.pop(k)
            sd[k] = own[k]  # keep the model's freshly initialised head
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    shapes = [
        f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}"
        for k in sorted(set(sd) & set(own))
        if sd[k].shape != own[k].shape
    ]
    if missing or unexpected or shapes:
        raise CheckpointMismatch(missing, unexpected, shapes)
    model.load_state_dict(sd)
    return model


def export_timm_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights in the timm layout (detached CPU copies), ready for `torch.save` or safetensors."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def load_encoder_export(model: nn.Module, state: dict, init_head: bool, task: str) -> None:
    """Load an export into a model that wraps a plain ViT `encoder` under a task head (SETR, DETR): the
    model's own export (the encoder and, with `init_head`, the rest, which must fit exactly), or any plain
    ViT's into the encoder alone (supervised, MAE or masked-patch-prediction encoders). Position embeddings
    are resampled to the model's grid; a classifier head in the export is left out. `task` names the head
    in errors ("a SETR decoder")."""
    if any(k.startswith("encoder.") for k in state):
        encoder = {k.removeprefix("encoder."): v for k, v in state.items() if k.startswith("encoder.")}
        load_timm_state_dict(model.encoder, encoder, strict_head=False, reset_head=True)
        if init_head:
            theirs = {k: v for k, v in state.items() if not k.startswith("encoder.")}
            own = {k: v for k, v in model.state_dict().items() if not k.startswith("encoder.")}
            shapes = [
                f"{k}: export {tuple(theirs[k].shape)}, model {tuple(v.shape)}"
                for k, v in own.items()
                if k in theirs and theirs[k].shape != v.shape
            ]
            if set(theirs) != set(own) or shapes:
                raise CheckpointMismatch(
                    sorted(set(own) - set(theirs)), sorted(set(theirs) - set(own)), shapes
                )
            model.load_state_dict({**model.state_dict(), **theirs})
        return
    if init_head:
        raise KeyError(
            f"the export is a plain ViT's (no encoder.* keys): it has no {task} to load; use it with "
            "init_head: false to start from its encoder"
        )
    load_timm_state_dict(model.encoder, state, strict_head=False, reset_head=True)
