"""Linear evaluation of frozen features: big_vision's few-shot ridge regression and a logistic probe.

    from pipeline.eval.fewshot import fewshot_ridge, linear_probe
    feats = model.forward_head(model.forward_features(x), pre_logits=True)   # [N, D] per split
    fewshot_ridge(train_f, train_y, test_f, test_y)   # {"1shot": 0.41, "1shot-seed-0": ..., "5shot": ...}
    linear_probe(train_f, train_y, test_f, test_y)    # {"accuracy": 0.83, "train_accuracy": ..., ...}

Few-shot follows big_vision's `evaluators/fewshot_utils.py` (the evaluator behind the ViT papers'
few-shot numbers), so results are comparable with theirs:
  - per seed, `np.random.default_rng(seed)` permutes each class's train indices once; the
    `shots`-shot subset is the first `shots` of every class (so 5-shot contains 1-shot);
  - features are whitened with the mean and std of that subset (std + 1e-5), and a constant
    feature of 100 is appended as a bias that the l2 term barely touches;
  - targets are one-hot rescaled to {-1, 1}; W solves (X^T X + l2 I) W = X^T Y in closed form
    (through X X^T when there are fewer samples than dimensions); prediction is argmax of x W.
Both evaluators run on the CPU in float64 by default; they are cheap next to extracting the features.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

BIAS_CONSTANT = 100.0  # big_vision: large, so the bias is almost unregularised
DEFAULT_SHOTS = (1, 5, 10, 25)
DEFAULT_L2_REG = 2.0**10

ArrayLike = np.ndarray | torch.Tensor


def _as_tensor(x: ArrayLike, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
    t = torch.as_tensor(x) if isinstance(x, np.ndarray) else x.detach()
    return t.to(device=device or t.device, dtype=dtype)


def _num_classes(*labels: torch.Tensor) -> int:
    return int(max(int(y.max()) for y in labels if y.numel())) + 1


def ridge_fit(x: torch.Tensor, y: torch.Tensor, num_classes: int, l2_reg: float) -> tuple[torch.Tensor, ...]:
    """Whitened ridge regression on {-1, 1} one-hot targets: returns (W [D+1, C], mean [1, D], std [1, D])."""
    mean = x.mean(0, keepdim=True)
    std = x.std(0, unbiased=False, keepdim=True) + 1e-5  # population std, as jnp.std
    xw = F.pad((x - mean) / std, (0, 1), value=BIAS_CONSTANT)  # [N, D+1]
    targets = 2.0 * F.one_hot(y, num_classes).to(x.dtype) - 1.0  # [N, C]
    num_points, dim = xw.shape
    # Solve in whichever Gram matrix is smaller; both give the same W for l2 > 0.
    if num_points >= dim:
        eye = torch.eye(dim, dtype=x.dtype, device=x.device)
        w = torch.linalg.solve(xw.T @ xw + l2_reg * eye, xw.T @ targets)
    else:
        eye = torch.eye(num_points, dtype=x.dtype, device=x.device)
        w = xw.T @ torch.linalg.solve(xw @ xw.T + l2_reg * eye, targets)
    return w, mean, std


def ridge_predict(w: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Predicted class [N] of features x [N, D] under a `ridge_fit` solution."""
    xw = F.pad((x - mean) / std, (0, 1), value=BIAS_CONSTANT)
    return (xw @ w).argmax(1)


def fewshot_indices(
    labels: np.ndarray, num_classes: int, shots: Sequence[int], seed: int
) -> dict[int, np.ndarray]:
    """{shots: train indices}: the first `shots` of each class after one per-class permutation (big_vision)."""
    rng = np.random.default_rng(seed)
    per_class = [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]
    return {s: np.concatenate([idx[:s] for idx in per_class]) for s in shots}


def fewshot_ridge(
    train_feats: ArrayLike,
    train_labels: ArrayLike,
    test_feats: ArrayLike,
    test_labels: ArrayLike,
    num_classes: int | None = None,
    shots: Sequence[int] = DEFAULT_SHOTS,
    seeds: Sequence[int] = (0, 1, 2),
    l2_reg: float = DEFAULT_L2_REG,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """Few-shot accuracy of closed-form ridge regression on frozen features.

    train_feats [N, D], train_labels [N] int, test_feats [M, D], test_labels [M] int. Returns
    {f"{s}shot": mean accuracy over seeds, f"{s}shot-seed-{seed}": accuracy of that seed}. A class
    with fewer than `s` train samples contributes all it has, as in big_vision.
    """
    x_train = _as_tensor(train_feats, torch.float64, device)
    x_test = _as_tensor(test_feats, torch.float64, device)
    y_train = _as_tensor(train_labels, torch.long, device)
    y_test = _as_tensor(test_labels, torch.long, device)
    num_classes = num_classes or _num_classes(y_train, y_test)
    labels_np = y_train.cpu().numpy()
    results: dict[str, float] = {}
    per_shot: dict[int, list[float]] = {s: [] for s in shots}
    for seed in seeds:
        for s, idx in fewshot_indices(labels_np, num_classes, shots, seed).items():
            idx_t = torch.as_tensor(idx, device=x_train.device)
            w, mean, std = ridge_fit(x_train[idx_t], y_train[idx_t], num_classes, l2_reg)
            acc = (ridge_predict(w, mean, std, x_test) == y_test).double().mean().item()
            results[f"{s}shot-seed-{seed}"] = acc
            per_shot[s].append(acc)
    for s, accs in per_shot.items():
        results[f"{s}shot"] = float(np.mean(accs))
    return results


def linear_probe(
    train_feats: ArrayLike,
    train_labels: ArrayLike,
    test_feats: ArrayLike,
    test_labels: ArrayLike,
    num_classes: int | None = None,
    steps: int = 100,
    weight_decay: float = 1e-4,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float64,
) -> dict[str, float]:
    """Multinomial logistic regression on frozen features, full-batch L-BFGS for `steps` iterations.

    Features are standardised with the train mean and std so one `weight_decay` fits any backbone.
    The loss is mean cross-entropy + weight_decay / 2 * ||W||^2 (bias not decayed). Weights start at
    zero and the problem is convex, so the result is deterministic and needs no seed.
    Returns {"accuracy", "train_accuracy", "train_loss"}. Full batch: the train features must fit
    in memory (1.28M x 768 float32 is about 4 GB; pass dtype=torch.float32, device="cuda" then).
    """
    x_train = _as_tensor(train_feats, dtype, device)
    x_test = _as_tensor(test_feats, dtype, device)
    y_train = _as_tensor(train_labels, torch.long, device)
    y_test = _as_tensor(test_labels, torch.long, device)
    num_classes = num_classes or _num_classes(y_train, y_test)
    mean = x_train.mean(0, keepdim=True)
    std = x_train.std(0, unbiased=False, keepdim=True) + 1e-5
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std

    weight = torch.zeros(
        x_train.shape[1], num_classes, dtype=dtype, device=x_train.device, requires_grad=True
    )
    bias = torch.zeros(num_classes, dtype=dtype, device=x_train.device, requires_grad=True)
    optimizer = torch.optim.LBFGS(
        [weight, bias],
        lr=1.0,
        max_iter=steps,
        history_size=20,
        line_search_fn="strong_wolfe",
        tolerance_grad=1e-9,
        tolerance_change=1e-12,
    )

    def objective() -> torch.Tensor:
        loss = F.cross_entropy(x_train @ weight + bias, y_train) + 0.5 * weight_decay * weight.square().sum()
        return loss

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = objective()
        loss.backward()
        return loss

    optimizer.step(closure)  # one step() runs up to max_iter L-BFGS iterations
    with torch.no_grad():
        train_loss = objective().item()
        train_acc = ((x_train @ weight + bias).argmax(1) == y_train).double().mean().item()
        test_acc = ((x_test @ weight + bias).argmax(1) == y_test).double().mean().item()
    return {"accuracy": test_acc, "train_accuracy": train_acc, "train_loss": train_loss}
