"""Single-device model code: no torch.distributed, DeepSpeed, Ray or MLflow in this package."""

from pipeline.models.mae import MaskedAutoencoderViT  # registers mae_vit_*
from pipeline.models.masked_patch import MaskedPatchPredictionViT  # registers mpp_vit_*
from pipeline.models.param_groups import layer_id, param_groups
from pipeline.models.registry import create_model, list_models, register
from pipeline.models.vit import VisionTransformer

__all__ = [
    "MaskedAutoencoderViT",
    "MaskedPatchPredictionViT",
    "VisionTransformer",
    "create_model",
    "layer_id",
    "list_models",
    "param_groups",
    "register",
]
