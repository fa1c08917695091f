"""Metrics, few-shot ridge regression and the linear probe on crafted inputs with known answers.

.venv/bin/python -m pytest tests/test_eval_metrics.py -q
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipeline.eval.fewshot import fewshot_indices, fewshot_ridge, linear_probe, ridge_fit
from pipeline.eval.metrics import (
    MetricState,
    average_precision_per_class,
    mean_average_precision,
    precision_at_1,
    top1_is_positive,
    topk_accuracy,
    topk_correct,
)

pytestmark = pytest.mark.unit

# ---------------------------------------------------------------- top-k


def _topk_case() -> tuple[torch.Tensor, torch.Tensor]:
    row = [0.1, 0.9, 0.3, 0.2, 0.0, 0.05]
    ties = [0.5] * 6
    logits = torch.tensor([row, row, row, ties, ties])
    # target ranks: 0 (hit), 1 (top-5 only), 5 (lowest score: miss), 0 and 5 (all tied: lower index first)
    targets = torch.tensor([1, 2, 4, 0, 5])
    return logits, targets


def test_topk_accuracy_hand_computed():
    logits, targets = _topk_case()
    assert topk_accuracy(logits, targets) == {"top1": pytest.approx(2 / 5), "top5": pytest.approx(3 / 5)}
    hits = topk_correct(logits, targets, ks=(1, 2, 6))
    assert hits["top1"].tolist() == [1, 0, 0, 1, 0]
    assert hits["top2"].tolist() == [1, 1, 0, 1, 0]
    assert hits["top6"].tolist() == [1, 1, 1, 1, 1]


def test_topk_ties_follow_argmax_and_k_is_clamped():
    logits = torch.tensor([[1.0, 1.0, 1.0]])
    # Of tied scores the lowest index ranks first, as torch.argmax picks it.
    assert topk_accuracy(logits, torch.tensor([int(logits.argmax())]), ks=(1,))["top1"] == 1.0
    assert topk_accuracy(logits, torch.tensor([1]), ks=(1,))["top1"] == 0.0
    # Top-5 of a 3-class task is clamped to top-3: every target is in it.
    assert topk_accuracy(logits, torch.tensor([2]), ks=(5,))["top5"] == 1.0


def test_topk_rejects_bad_shapes():
    with pytest.raises(ValueError, match="logits"):
        topk_accuracy(torch.zeros(4, 3), torch.zeros(5, dtype=torch.long))


# ---------------------------------------------------------------- mAP and precision@1


def test_mean_average_precision_hand_computed():
    scores = torch.tensor(
        [
            [0.9, 0.1, 0.3],
            [0.8, 0.4, 0.2],
            [0.7, 0.35, 0.9],
            [0.6, 0.8, 0.1],
            [0.5, 0.2, 0.5],
        ]
    )
    multi_hot = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 0], [0, 1, 0]])
    # class 0: positives at ranks 1 and 3 -> (1/1 + 2/3) / 2 = 5/6
    # class 1: ranking s3 s1 s2 s4 s0, positives s1 (rank 2) and s4 (rank 4) -> (1/2 + 2/4) / 2 = 1/2
    # class 2: no positive -> NaN, left out of the mean
    ap = average_precision_per_class(scores, multi_hot)
    assert ap[0].item() == pytest.approx(5 / 6)
    assert ap[1].item() == pytest.approx(1 / 2)
    assert math.isnan(ap[2].item())
    assert mean_average_precision(scores, multi_hot) == pytest.approx((5 / 6 + 1 / 2) / 2)


def test_average_precision_ties_form_one_threshold():
    # Thresholds 0.5 (tp 1, fp 1: P 1/2, R 1/2) and 0.2 (P 2/3, R 1): AP = 1/2 * 1/2 + 1/2 * 2/3 = 7/12,
    # whichever of the two tied samples is the positive.
    scores = torch.tensor([[0.5], [0.5], [0.2]])
    for labels in ([[0], [1], [1]], [[1], [0], [1]]):
        assert mean_average_precision(scores, torch.tensor(labels)) == pytest.approx(7 / 12)


def test_average_precision_matches_sklearn():
    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (64, 7), generator=gen).double() / 5  # coarse scores: many ties
    multi_hot = (torch.rand(64, 7, generator=gen) < 0.3).long()
    expected = [sklearn_metrics.average_precision_score(multi_hot[:, k], scores[:, k]) for k in range(7)]
    assert average_precision_per_class(scores, multi_hot).tolist() == pytest.approx(expected)


def test_mean_average_precision_without_positives_is_nan():
    assert math.isnan(mean_average_precision(torch.rand(3, 2), torch.zeros(3, 2)))


def test_precision_at_1_hand_computed():
    scores = torch.tensor([[0.2, 0.9, 0.1], [0.5, 0.5, 0.0], [0.3, 0.3, 0.9], [0.1, 0.2, 0.3]])
    multi_hot = torch.tensor([[0, 1, 0], [0, 1, 0], [1, 0, 0], [0, 0, 0]])
    # hit; tie -> class 0, a miss; class 2 is not a label; no label at all counts as a miss
    assert top1_is_positive(scores, multi_hot).tolist() == [1, 0, 0, 0]
    assert precision_at_1(scores, multi_hot) == pytest.approx(1 / 4)


# ---------------------------------------------------------------- running sums


def test_metric_state_masks_padding_and_sums_like_an_all_reduce():
    logits, targets = _topk_case()
    multi_hot = torch.nn.functional.one_hot(targets, 6)
    names = ["top1", "top5", "prec@1"]

    def per_sample(lg: torch.Tensor, y: torch.Tensor, mh: torch.Tensor) -> dict[str, torch.Tensor]:
        return {**topk_correct(lg, y, (1, 5)), "prec@1": top1_is_positive(lg, mh)}

    # Two "ranks", each with a padded row that would be a hit (and a NaN logit) if counted.
    ranks = []
    for lo, hi in ((0, 3), (3, 5)):
        lg = torch.cat([logits[lo:hi], torch.tensor([[float("nan")] + [0.0] * 5])])
        y = torch.cat([targets[lo:hi], torch.tensor([0])])
        mh = torch.cat([multi_hot[lo:hi], torch.ones(1, 6, dtype=multi_hot.dtype)])
        valid = torch.tensor([True] * (hi - lo) + [False])
        state = MetricState(names)
        state.update(per_sample(lg, y, mh), valid)
        ranks.append(state)
    total = MetricState(names)
    total.sums.copy_(ranks[0].sums + ranks[1].sums)  # what dist.all_reduce(state.sums) does
    assert total.count == 5
    assert total.compute() == {
        "top1": pytest.approx(2 / 5),
        "top5": pytest.approx(3 / 5),
        "prec@1": pytest.approx(2 / 5),
    }


def test_metric_state_empty_is_nan_and_missing_name_is_an_error():
    state = MetricState(["top1"])
    assert math.isnan(state.compute()["top1"])
    with pytest.raises(KeyError, match="top1"):
        state.update({"top5": torch.ones(2)})


# ---------------------------------------------------------------- few-shot ridge and linear probe


def _clusters(num_classes: int, per_class: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Well separated Gaussian blobs: class means 10 apart on average, noise std 0.5."""
    rng = np.random.default_rng(seed)
    means = np.random.default_rng(123).normal(0, 10, (num_classes, dim))
    labels = np.repeat(np.arange(num_classes), per_class)
    return means[labels] + rng.normal(0, 0.5, (len(labels), dim)), labels


def test_fewshot_ridge_separable_features_reach_100_percent():
    train_x, train_y = _clusters(5, 30, 32, seed=0)
    test_x, test_y = _clusters(5, 20, 32, seed=1)
    res = fewshot_ridge(train_x, train_y, test_x, test_y, seeds=(0, 1))
    assert set(res) == {f"{s}shot" for s in (1, 5, 10, 25)} | {
        f"{s}shot-seed-{k}" for s in (1, 5, 10, 25) for k in (0, 1)
    }
    assert all(v == 1.0 for v in res.values()), res


def test_fewshot_ridge_random_labels_are_near_chance():
    rng = np.random.default_rng(0)
    res = fewshot_ridge(
        rng.normal(size=(600, 32)),
        rng.integers(0, 10, 600),
        rng.normal(size=(2000, 32)),
        rng.integers(0, 10, 2000),
    )
    for s in (1, 5, 10, 25):
        assert 0.05 < res[f"{s}shot"] < 0.16, res  # chance is 0.10; 2000 test samples: std about 0.007


def test_fewshot_subsets_are_nested_and_seeded():
    labels = np.repeat(np.arange(3), 10)
    a = fewshot_indices(labels, 3, (1, 5), seed=0)
    assert len(a[1]) == 3 and len(a[5]) == 15
    assert set(a[1]) <= set(a[5])  # 5-shot extends 1-shot, as in big_vision
    assert np.array_equal(a[5], fewshot_indices(labels, 3, (1, 5), seed=0)[5])
    assert not np.array_equal(a[5], fewshot_indices(labels, 3, (1, 5), seed=1)[5])


@pytest.mark.parametrize("num_points", [8, 64])  # fewer and more samples than dimensions
def test_ridge_fit_solves_the_normal_equations(num_points: int):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(num_points, 16, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 4, (num_points,), generator=gen)
    w, mean, std = ridge_fit(x, y, 4, l2_reg=3.0)
    xw = torch.nn.functional.pad((x - mean) / std, (0, 1), value=100.0)
    targets = 2.0 * torch.nn.functional.one_hot(y, 4).double() - 1.0
    lhs = (xw.T @ xw + 3.0 * torch.eye(17, dtype=torch.float64)) @ w
    torch.testing.assert_close(lhs, xw.T @ targets)


def test_linear_probe_separable_features_and_determinism():
    train_x, train_y = _clusters(5, 30, 32, seed=0)
    test_x, test_y = _clusters(5, 20, 32, seed=1)
    res = linear_probe(train_x, train_y, test_x, test_y, steps=50)
    assert res["accuracy"] >= 0.99 and res["train_accuracy"] == 1.0, res
    assert linear_probe(train_x, train_y, test_x, test_y, steps=50) == res


def test_linear_probe_random_labels_do_not_generalise():
    rng = np.random.default_rng(0)
    res = linear_probe(
        rng.normal(size=(300, 16)),
        rng.integers(0, 5, 300),
        rng.normal(size=(1000, 16)),
        rng.integers(0, 5, 1000),
        steps=50,
    )
    assert res["accuracy"] < 0.3, res  # chance is 0.2
