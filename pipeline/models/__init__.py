"""Single-device model code: no torch.distributed, DeepSpeed, Ray or MLflow in this package."""

from pipeline.models.cvt import ConvolutionalVisionTransformer  # registers cvt_*
from pipeline.models.detr import DETR  # registers detr_vit_*
from pipeline.models.levit import Levit  # registers levit_*
from pipeline.models.mae import MaskedAutoencoderViT  # registers mae_vit_*
from pipeline.models.masked_patch import MaskedPatchPredictionViT  # registers mpp_vit_*
from pipeline.models.param_groups import layer_id, param_groups
from pipeline.models.registry import create_model, list_models, register
from pipeline.models.setr import SETR  # registers setr_{naive,pup}_vit_*
from pipeline.models.simmim import SimMIM  # registers simmim_* (after the encoders it wraps)
from pipeline.models.swin import SwinTransformer  # registers swin_*
from pipeline.models.tnt import TNT  # registers tnt_*
from pipeline.models.vit import VisionTransformer

__all__ = [
    "ConvolutionalVisionTransformer",
    "DETR",
    "Levit",
    "MaskedAutoencoderViT",
    "MaskedPatchPredictionViT",
    "SETR",
    "SimMIM",
    "SwinTransformer",
    "TNT",
    "VisionTransformer",
    "create_model",
    "layer_id",
    "list_models",
    "param_groups",
    "register",
]
