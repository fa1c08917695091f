"""Consolidated weights for the next stage and for users: safetensors plus a JSON description.

RUN_DIR/export/model.safetensors   fp32 weights in the timm layout (a plain ViT for MAE / masked
                                   patch prediction: their encoder, as fine-tuning starts from)
RUN_DIR/export/model.json          which model, its constructor arguments, the step, the source, and
                                   the preprocessing its inputs had (mean, std, eval interpolation),
                                   which a stage that starts from it takes unless it sets its own
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from data_prep import atomic
from data_prep.storage import Store, is_uri
from pipeline.models import create_model
from pipeline.models.convert import encoder_name, timm_name, unwrap_state_dict

WEIGHTS, META = "model.safetensors", "model.json"


def export_weights(
    state: dict[str, torch.Tensor],
    model_name: str,
    model_kwargs: dict,
    out_dir: Path,
    step: int,
    preprocessing: dict | None = None,
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
        **({"preprocessing": preprocessing} if preprocessing else {}),
    }
    grid = getattr(plain, "grid_size", None)  # a plain ViT's: its timm name (timm.create_model takes it)
    patch = getattr(getattr(plain, "patch_embed", None), "patch_size", None)
    if grid is not None and grid[0] == grid[1] and isinstance(patch, int):
        found = timm_name(encoder_name(model_name), grid[0] * patch)
        if found:
            meta["timm_name"] = found
    atomic.write_json(out_dir / META, meta, indent=2, default=str)
    return out_dir / WEIGHTS


def export_preprocessing(path: str | Path) -> dict | None:
    """The preprocessing {"mean", "std", "interpolation"} that weights at `path` (an export folder or its
    weights file, local or a storage URI) were trained with: our model.json's record, or the pretrained_cfg of
    a timm/Hugging Face folder's config.json; None where neither says."""
    for name in (META, "config.json"):
        try:
            if is_uri(path):  # an export folder in storage (as load_exported reads it): one GET
                raw = Store(str(path)).read_bytes(name)
                text = raw.decode() if raw is not None else None
            else:
                folder = Path(path) if Path(path).is_dir() else Path(path).parent
                text = (folder / name).read_text() if (folder / name).is_file() else None
        except (OSError, UnicodeDecodeError):
            text = None
        if text is None:
            continue
        try:
            found = json.loads(text)
        except json.JSONDecodeError:
            continue
        record = found.get("preprocessing") if name == META else found.get("pretrained_cfg")
        if isinstance(record, dict) and record.get("mean") and record.get("std"):
            interpolation = record.get("interpolation")
            return {
                "mean": [float(v) for v in record["mean"]],
                "std": [float(v) for v in record["std"]],
                "interpolation": interpolation if interpolation in ("bilinear", "bicubic") else None,
            }
    return None


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
    weights = _weights_in(path) if path.is_dir() else path
    if not weights.is_file():
        raise FileNotFoundError(
            f"{weights}: no weights (an export folder holds {WEIGHTS}; public checkpoints are .safetensors, "
            ".pth, .pt or .bin files, or a timm folder)"
        )
    meta_path = weights.with_name(META)
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if weights.suffix == ".safetensors":
        return load_file(str(weights)), meta
    # DeiT's and MAE's .pth ({"model": state dict}), timm's pytorch_model.bin: tensors only, never code
    try:  # MAE's training checkpoints also hold its argparse.Namespace: data, safe to allow
        with torch.serialization.safe_globals([argparse.Namespace]):
            state = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle's errors name nothing; this names the file
        raise ValueError(f"{weights}: not a PyTorch state dict that loads without code ({exc})") from None
    state = unwrap_state_dict(state) if isinstance(state, dict) else state  # DeiT's and MAE's {"model": ...}
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{weights}: expected a state dict (name -> tensor), found {type(state).__name__}")
    return state, meta


def _weights_in(folder: Path) -> Path:
    """The weights file of a folder: an export's (or a timm folder's) model.safetensors, else timm's
    pytorch_model.bin, else its only .pth."""
    for name in (WEIGHTS, "pytorch_model.bin"):
        if (folder / name).is_file():
            return folder / name
    found = sorted(folder.glob("*.pth"))
    return found[0] if len(found) == 1 else folder / WEIGHTS
