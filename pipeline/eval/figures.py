"""The eval stage's figures as PNG files: what an exported model learned, and how its stage trained.

    from pipeline.eval.figures import model_figures, source_loss_curve
    written, skipped = model_figures(model, images, Path("RUN_DIR/figures"))
    path_or_reason = source_loss_curve("runs/exp/pretrain/export", ["sqlite:///runs/exp/mlflow.db"], out)

`model_figures` draws the ViT paper's Figure 7 (pipeline.models.analysis): position-embedding
similarity, principal components of the patch-embedding filters, mean attention distance per layer.
A figure the model has nothing for (no absolute position embedding, a hybrid stem) is skipped and its
reason returned, never raised: the caller logs the note. Rank 0 only; nothing here communicates.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from pipeline.compare import open_client, plot_metric  # MLflow reads live in compare
from pipeline.data.batching import MASK_IGNORE
from pipeline.models.analysis import (
    mean_attention_distance,
    new_figure,
    patch_embed_components,
    pos_embed_similarity,
)
from pipeline.tracking import RUN_ID_FILE, read_run_id

if TYPE_CHECKING:
    from matplotlib.figure import Figure  # loaded by pipeline.models.analysis only when it draws

log = logging.getLogger(__name__)

MAX_COMPONENTS = 28  # the paper's 4 x 7 grid


def _num_components(model: nn.Module) -> int:
    proj = getattr(getattr(model, "patch_embed", None), "proj", None)
    if proj is None or not hasattr(proj, "weight"):
        return MAX_COMPONENTS  # analysis raises the informative error
    d, c, ph, pw = proj.weight.shape
    return min(MAX_COMPONENTS, d, c * ph * pw)


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def model_figures(
    model: nn.Module, images: torch.Tensor | None, out_dir: Path
) -> tuple[list[Path], dict[str, str]]:
    """Write the analysis PNGs of `model` under out_dir; images [B, 3, H, W] normalised, on the model's
    device (for attention distance). Returns (written files, {figure name: why it was skipped})."""
    drawers = {
        "pos_embed_similarity": lambda: pos_embed_similarity(model)[1],
        "patch_embed_components": lambda: patch_embed_components(model, _num_components(model))[1],
        "mean_attention_distance": lambda: mean_attention_distance(model, images)[1],
    }
    written: list[Path] = []
    skipped: dict[str, str] = {}
    if images is None:
        del drawers["mean_attention_distance"]
        skipped["mean_attention_distance"] = "no readable eval image on this rank"
    for name, draw in drawers.items():
        try:
            fig = draw()
        except (TypeError, ValueError) as exc:  # the model has no such thing (analysis says which)
            skipped[name] = str(exc)
            log.info("figure %s skipped: %s", name, exc)
            continue
        written.append(_save(fig, out_dir / f"{name}.png"))
    return written, skipped


def source_stage_dir(init_from: str | Path) -> Path:
    """The training stage's run directory that wrote an export: RUN_DIR of RUN_DIR/export[/model.safetensors]."""
    path = Path(init_from)
    export_dir = path if path.is_dir() else path.parent
    return export_dir.parent


def source_loss_curve(init_from: str | Path, tracking_uris: list[str], out: Path) -> Path | str:
    """Plot train/loss of the run that produced `init_from` (read from MLflow through the stage's
    mlflow_run.json); returns the PNG, or why there is none. The first store that holds the run wins."""
    run_file = source_stage_dir(init_from) / RUN_ID_FILE  # beside the stage's export/
    run_id = read_run_id(run_file)
    if run_id is None:
        return f"no {run_file} (the export did not come from a tracked training stage)"
    for uri in dict.fromkeys(tracking_uris):  # in order, without repeats
        try:
            client = open_client(uri)
            run = client.get_run(run_id)
        except Exception:  # a missing or unreadable store, or no such run there: try the next
            continue
        if "train/loss" not in run.data.metrics:
            return f"source run {run_id} logged no train/loss"
        out.parent.mkdir(parents=True, exist_ok=True)
        plot_metric(
            client, [run], "train/loss", out, title=f"train/loss of {run.info.run_name or run_id[:8]}"
        )
        return out
    return f"source run {run_id} not found in {', '.join(dict.fromkeys(tracking_uris))}"


def _palette(n: int) -> np.ndarray:
    """[n, 3] float RGB in 0..1: black for class 0 (background), then tab20's distinct colours."""
    from matplotlib import colormaps  # heavy: see pipeline.models.analysis.new_figure

    colours = colormaps["tab20"](np.arange(max(n - 1, 1)) % 20)[:, :3]
    return np.concatenate([np.zeros((1, 3)), colours])[:n]


def segmentation_figure(
    images: torch.Tensor, true: torch.Tensor, pred: torch.Tensor, class_names: list[str], out: Path
) -> Path:
    """Rows of (image, true mask, predicted mask), one per eval image: images uint8 [n, 3, H, W],
    masks [n, H, W] class indices (MASK_IGNORE pixels drawn white); a legend names the colours."""
    from matplotlib.patches import Patch  # heavy: see pipeline.models.analysis.new_figure

    n = images.shape[0]
    palette = np.concatenate([_palette(len(class_names)), np.ones((1, 3))])  # the last: ignored pixels

    def colour(mask: torch.Tensor) -> np.ndarray:
        m = mask.long().numpy()
        return palette[np.where(m == MASK_IGNORE, len(class_names), np.minimum(m, len(class_names) - 1))]

    fig = new_figure((6.0, 2.0 * n + 0.8))
    axes = fig.subplots(n, 3, squeeze=False)
    for i in range(n):
        panels = (images[i].permute(1, 2, 0).numpy(), colour(true[i]), colour(pred[i]))
        for j, (panel, title) in enumerate(zip(panels, ("image", "true", "predicted"))):
            ax = axes[i][j]
            ax.imshow(panel, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                ax.set_title(title)
    handles = [Patch(color=palette[k], label=name) for k, name in enumerate(class_names)]
    fig.legend(handles=handles, loc="lower center", ncol=min(4, len(handles)), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.6 / (2.0 * n + 0.8) + 0.02, 1, 1))
    return _save(fig, out)


FIGURE_SCORE = 0.5  # predicted boxes drawn: those scored at least this (DETR's demo draws >= 0.7)


def detection_figure(
    images: torch.Tensor,
    true: list[tuple[np.ndarray, np.ndarray]],
    predicted: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
    class_names: list[str],
    out: Path,
    min_score: float = FIGURE_SCORE,
) -> Path:
    """Rows of (true boxes, predicted boxes) drawn on each eval image: images uint8 [n, 3, H, W] as the model
    saw them; `true` per image (boxes [k, 4], classes [k]) and `predicted` (boxes [q, 4], scores [q],
    classes [q]), boxes (x0, y0, x1, y1) as fractions of the image. Predictions scored below `min_score`
    are left out; a box's colour is its class, a legend names them, predictions carry their score."""
    from matplotlib import patheffects  # heavy: see pipeline.models.analysis.new_figure
    from matplotlib.patches import Patch, Rectangle

    outline = [patheffects.withStroke(linewidth=3, foreground="black")]  # seen on objects of its colour

    n = images.shape[0]
    palette = _palette(len(class_names) + 1)[1:]  # no black: boxes go on images
    fig = new_figure((5.0, 2.5 * n + 0.8))
    axes = fig.subplots(n, 2, squeeze=False)
    for i in range(n):
        h, w = images.shape[2], images.shape[3]
        boxes_true, classes_true = true[i]
        boxes_pred, scores, classes_pred = predicted[i]
        shown = scores >= min_score
        rows = (
            (boxes_true, classes_true, None, "true"),
            (boxes_pred[shown], classes_pred[shown], scores[shown], f"predicted (score >= {min_score:g})"),
        )
        for j, (boxes, classes, score, title) in enumerate(rows):
            ax = axes[i][j]
            ax.imshow(images[i].permute(1, 2, 0).numpy(), interpolation="nearest")
            for k, ((x0, y0, x1, y1), c) in enumerate(zip(boxes, classes)):
                colour = palette[int(c) % len(palette)]
                rect = Rectangle(
                    (x0 * w - 0.5, y0 * h - 0.5), (x1 - x0) * w, (y1 - y0) * h, fill=False, lw=1.5, ec=colour
                )
                rect.set_path_effects(outline)
                ax.add_patch(rect)
                if score is not None:
                    ax.text(
                        x0 * w,
                        y0 * h,
                        f"{score[k]:.2f}",
                        color=colour,
                        fontsize=6,
                        va="bottom",
                        path_effects=outline,
                    )
            ax.set_xlim(-0.5, w - 0.5)
            ax.set_ylim(h - 0.5, -0.5)
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                ax.set_title(title, fontsize=8)
    handles = [Patch(color=palette[k % len(palette)], label=name) for k, name in enumerate(class_names)]
    fig.legend(handles=handles, loc="lower center", ncol=min(3, len(handles)), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.6 / (2.5 * n + 0.8) + 0.02, 1, 1))
    return _save(fig, out)
