"""Consolidated weights for the next stage and for users: safetensors plus a JSON description, in the
layout that `pipeline.exported` describes and reads."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from data_prep import atomic
from pipeline.exported import EMA_WEIGHTS, META, WEIGHTS
from pipeline.models import create_model
from pipeline.models.convert import encoder_name, timm_name


def export_weights(
    state: dict[str, torch.Tensor],
    model_name: str,
    model_kwargs: dict,
    out_dir: Path,
    step: int,
    preprocessing: dict | None = None,
    ema: dict[str, torch.Tensor] | None = None,
    ema_decay: float | None = None,
) -> Path:
    """Rebuild the model on CPU from the consolidated state, take its plain-ViT form, write it atomically;
    with `ema` (the weight EMA's parameters; buffers come from `state`) also EMA_WEIGHTS, the same way."""
    model = create_model(model_name, **model_kwargs)
    exported = "encoder" if hasattr(model, "export_encoder") else "model"
    out_dir.mkdir(parents=True, exist_ok=True)
    plain = None
    for name, weights in ((WEIGHTS, state), (EMA_WEIGHTS, None if ema is None else {**state, **ema})):
        if weights is None:
            (out_dir / name).unlink(missing_ok=True)  # an earlier export's EMA is not this one's
            continue
        model.load_state_dict(weights)
        plain = model.export_encoder() if exported == "encoder" else model
        tensors = {k: v.detach().float().contiguous() for k, v in plain.state_dict().items()}
        with atomic.writing(out_dir / name) as tmp:
            save_file(tensors, str(tmp), metadata={"model": model_name, "step": str(step)})
    meta = {
        "model": model_name,
        "model_kwargs": model_kwargs,
        "exported": exported,
        "step": step,
        "num_params": sum(v.numel() for v in tensors.values()),
        **({"preprocessing": preprocessing} if preprocessing else {}),
        **({"ema": {"weights": EMA_WEIGHTS, "decay": ema_decay}} if ema is not None else {}),
    }
    grid = getattr(plain, "grid_size", None)  # a plain ViT's: its timm name (timm.create_model takes it)
    patch = getattr(getattr(plain, "patch_embed", None), "patch_size", None)
    if grid is not None and grid[0] == grid[1] and isinstance(patch, int):
        found = timm_name(encoder_name(model_name), grid[0] * patch)
        if found:
            meta["timm_name"] = found
    atomic.write_json(out_dir / META, meta, indent=2, default=str)
    return out_dir / WEIGHTS
