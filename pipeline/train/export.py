"""Consolidated weights for the next stage and for users: safetensors plus a JSON description.

RUN_DIR/export/model.safetensors   fp32 weights in the timm layout (a plain ViT for MAE / masked
                                   patch prediction: their encoder, as fine-tuning starts from)
RUN_DIR/export/model.json          which model, its constructor arguments, the step, the source
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from data_prep import atomic
from data_prep.storage import Store, is_uri
from pipeline.models import create_model

WEIGHTS, META = "model.safetensors", "model.json"


def export_weights(
    state: dict[str, torch.Tensor], model_name: str, model_kwargs: dict, out_dir: Path, step: int
) -> Path:
    """Rebuild the model on CPU from the consolidated state, take its plain-ViT form, write it atomically."""
    model = create_model(model_name, **model_kwargs)
    model.load_state_dict(state)
    exported = "encoder" if hasattr(model, "export_encoder") else "model"
    plain = model.export_encoder() if exported == "encoder" else model
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().float().contiguous() for k, v in plain.state_dict().items()}
    with atomic.writing(out_dir / WEIGHTS) as tmp:
        save_file(tensors, str(tmp), metadata={"model": model_name, "step": str(step)})
    meta = {
        "model": model_name,
        "model_kwargs": model_kwargs,
        "exported": exported,
        "step": step,
        "num_params": sum(v.numel() for v in tensors.values()),
    }
    atomic.write_json(out_dir / META, meta, indent=2, default=str)
    return out_dir / WEIGHTS


def load_exported(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict, description) of an export folder or its .safetensors file, local or on object storage."""
    if is_uri(path):
        with tempfile.TemporaryDirectory(prefix="vitpipe-export-") as tmp:
            local = Store(str(path)).download_dir("", Path(tmp) / "export")
            if not (local / WEIGHTS).is_file():
                raise FileNotFoundError(f"{path}: no exported weights ({WEIGHTS}) at this storage location")
            state, meta = load_exported(local)
            return state, {**meta, "source": str(path)}
    path = Path(path)
    weights = path / WEIGHTS if path.is_dir() else path
    if not weights.is_file():
        raise FileNotFoundError(f"{weights}: no exported weights (a stage writes them to RUN_DIR/export/)")
    meta_path = weights.with_name(META)
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    return load_file(str(weights)), meta
