"""Evaluation of trained models: classification metrics, few-shot ridge regression, linear probe.

from pipeline.eval import topk_accuracy, mean_average_precision, fewshot_ridge, linear_probe
"""

from pipeline.eval.fewshot import fewshot_ridge, linear_probe
from pipeline.eval.metrics import (
    MetricState,
    average_precision_per_class,
    mean_average_precision,
    precision_at_1,
    top1_is_positive,
    topk_accuracy,
    topk_correct,
)

__all__ = [
    "MetricState",
    "average_precision_per_class",
    "fewshot_ridge",
    "linear_probe",
    "mean_average_precision",
    "precision_at_1",
    "top1_is_positive",
    "topk_accuracy",
    "topk_correct",
]
