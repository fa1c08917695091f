"""Reading an export: the consolidated weights a training stage writes (`pipeline.train.export`) and the
public checkpoints a stage may start from, for every stage above the models (`pipeline.stage`, the teacher
of `pipeline.objectives`, the eval stages).

RUN_DIR/export/model.safetensors   fp32 weights in the timm layout (a plain ViT for MAE / masked
                                   patch prediction: their encoder, as fine-tuning starts from)
RUN_DIR/export/model_ema.safetensors  the weight EMA (optim.ema_decay), in the same layout
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
from safetensors.torch import load_file

from data_prep.storage import Store, child, is_uri
from pipeline.models.convert import unwrap_state_dict

WEIGHTS, META = "model.safetensors", "model.json"
EMA_WEIGHTS = "model_ema.safetensors"  # the weight EMA (optim.ema_decay), in the same layout


def ema_weights(path: str | Path) -> str | None:
    """The EMA weights beside an export (a folder, local or a storage URI, or its model.safetensors), or None
    where it has none."""
    if is_uri(path):
        base, _, query = str(path).partition("?")
        folder = base.rstrip("/").removesuffix(f"/{WEIGHTS}") + (f"?{query}" if query else "")
        return child(folder, EMA_WEIGHTS) if Store(folder).exists(EMA_WEIGHTS) else None
    local = Path(path)
    folder = local if local.is_dir() else local.parent if local.name == WEIGHTS else None
    if folder is None or not (folder / EMA_WEIGHTS).is_file():
        return None
    return str(folder / EMA_WEIGHTS)


def export_preprocessing(path: str | Path) -> dict | None:
    """The preprocessing {"mean", "std", "interpolation"} that weights at `path` (an export folder or its
    weights file, local or a storage URI) were trained with: our model.json's record, or the pretrained_cfg of
    a timm/Hugging Face folder's config.json; None where neither says. A read that fails (storage out of
    reach) raises, naming the file: every rank reads it, and one that took the family's statistics instead
    would train on other inputs than the rest, silently."""
    for name in (META, "config.json"):
        try:
            if is_uri(path):  # an export folder in storage (as load_exported reads it): one GET
                raw = Store(str(path)).read_bytes(name)
                text = raw.decode() if raw is not None else None
            else:
                folder = Path(path) if Path(path).is_dir() else Path(path).parent
                text = (folder / name).read_text() if (folder / name).is_file() else None
        except UnicodeDecodeError:
            text = None
        except OSError as exc:
            raise OSError(f"model.init_from {path}: could not read its {name}: {exc}") from exc
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
    """(state dict, description) of an export folder or a weights file in one (model.safetensors,
    model_ema.safetensors, a public checkpoint), local or on object storage."""
    if is_uri(path):
        base, _, query = str(path).partition("?")
        base, name = base.rstrip("/"), None
        if base.endswith((".safetensors", ".pth", ".pt", ".bin")):
            base, _, name = base.rpartition("/")
        store = Store(f"{base}?{query}" if query else base)
        if name is None:  # a folder: the file _weights_in would take, and only it (not the EMA beside it)
            files = store.list_files("")
            name = next((n for n in (WEIGHTS, "pytorch_model.bin") if n in files), None)
            pth = [n for n in files if n.endswith(".pth")]
            name = name or (pth[0] if len(pth) == 1 else WEIGHTS)
        with tempfile.TemporaryDirectory(prefix="vitpipe-export-") as tmp:
            for n in (name, META, "config.json"):
                if n == name or store.exists(n):
                    try:
                        store.download_file(n, Path(tmp) / n)
                    except FileNotFoundError:
                        raise FileNotFoundError(f"{store.describe(n)}: no exported weights there") from None
            state, meta = load_exported(Path(tmp) / name)
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
