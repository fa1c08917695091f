"""Single-device model code: no torch.distributed, DeepSpeed, Ray or MLflow in this package."""

from pipeline.models.registry import create_model, list_models, register
from pipeline.models.vit import VisionTransformer

__all__ = ["VisionTransformer", "create_model", "list_models", "register"]
