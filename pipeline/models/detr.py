"""DETR (Carion et al. 2020, "End-to-End Object Detection with Transformers") on a plain ViT backbone: the
encoder's patch tokens are the memory of a small transformer decoder whose learned object queries each
predict a class (or "no object") and a box; training matches predictions to objects one-to-one
(`pipeline.models.boxes`). The ViT paper's successors judged backbones this way (ViT-FRCNN, ViTDet, YOLOS).

    model = create_model("detr_vit_b16", num_classes=80, img_size=512, num_queries=100)
    logits, boxes = model(images)     # [L, B, Q, K + 1], [L, B, Q, 4]: every decoder layer's predictions
    scores, labels, boxes = detections(logits[-1], boxes[-1])

Boxes are (centre x, centre y, w, h) as fractions of the image (a sigmoid), so one model serves every
image size. The decoder is DETR's with pre-norm layers (its `normalize_before`, steadier from scratch):
self-attention among the queries (from the second layer on: the first one's queries are all zero),
cross-attention to the projected patch tokens with a fixed 2-D sin-cos position code, an MLP; the
queries' learned positions are added to queries and keys at every layer, and one final norm and the
shared class and box heads read every layer's output (DETR's auxiliary losses use them all; evaluation
the last).

Every plain ViT size is registered (`detr_vit_debug` ... `detr_vit_G14`); any ViT option (pos_embed, pool,
drop_path_rate, ...) passes through to the encoder. Pretrained weights load into the encoder from any ViT
export (supervised, or MAE / masked-patch-prediction encoders) with position embeddings resampled, or a
DETR export whole (`load_pretrained`, used by `init_from`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.convert import load_encoder_export
from pipeline.models.layers import Mlp, init_linear_and_norm
from pipeline.models.macs import linear_macs
from pipeline.models.pos_embed import sincos_2d
from pipeline.models.registry import register
from pipeline.models.vit import VIT_SHAPES, VisionTransformer


class CrossAttention(nn.Module):
    """Multi-head attention of queries [B, Q, D] over keys [B, N, D] and values [B, N, D]."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"decoder width {dim} is not divisible by {num_heads} heads")
        self.num_heads = num_heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, nq, d = q.shape
        h = self.num_heads

        def heads(x: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, H, T, D/H]
            return x.reshape(b, x.shape[1], h, d // h).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q(q)), heads(self.k(k)), heads(self.v(v)))
        return self.proj(out.transpose(1, 2).reshape(b, nq, d))

    def forward_macs(self, queries: int, keys: int) -> int:
        d = self.q.out_features
        projections = linear_macs(self.q, queries) + linear_macs(self.k, keys) + linear_macs(self.v, keys)
        return projections + 2 * queries * keys * d + linear_macs(self.proj, queries)  # + QK^T and AV


class DecoderLayer(nn.Module):
    """Pre-norm DETR decoder layer: self-attention, cross-attention to the memory, MLP. The `first` layer
    takes all-zero queries: it has no self-attention (among equal queries it would only pass on its value
    bias; DETR's first one learns nothing else) and its cross-attention is asked by the query positions."""

    def __init__(self, dim: int, num_heads: int, mlp_dim: int, first: bool = False):
        super().__init__()
        self.first = first
        if not first:
            self.norm1, self.self_attn = nn.LayerNorm(dim), CrossAttention(dim, num_heads)
            self.norm2 = nn.LayerNorm(dim)
        self.cross_attn = CrossAttention(dim, num_heads)
        self.norm3, self.mlp = nn.LayerNorm(dim), Mlp(dim, mlp_dim)

    def forward(
        self, x: torch.Tensor, query_pos: torch.Tensor, memory: torch.Tensor, memory_pos: torch.Tensor
    ) -> torch.Tensor:
        keys = memory + memory_pos
        if self.first:  # x is all zeros
            x = self.cross_attn(query_pos, keys, memory)
        else:
            y = self.norm1(x)
            x = x + self.self_attn(y + query_pos, y + query_pos, y)
            x = x + self.cross_attn(self.norm2(x) + query_pos, keys, memory)
        return x + self.mlp(self.norm3(x))

    def forward_macs(self, queries: int, tokens: int) -> int:
        mlp = self.mlp
        own = 0 if self.first else self.self_attn.forward_macs(queries, queries)
        return (
            own
            + self.cross_attn.forward_macs(queries, tokens)
            + linear_macs(mlp.fc1, queries)
            + linear_macs(mlp.fc2, queries)
        )


class DETR(nn.Module):
    def __init__(
        self,
        num_classes: int = 2,
        num_queries: int = 100,
        decoder_dim: int = 256,
        decoder_depth: int = 6,
        decoder_heads: int = 8,
        decoder_mlp_dim: int = 2048,
        img_size: int = 224,
        head_bias_init: float = 0.0,
        **encoder_kwargs,
    ):
        super().__init__()
        if encoder_kwargs.get("distilled"):
            raise ValueError(
                "DETR decodes patch tokens: a distillation token has no use here (distilled=False)"
            )
        if encoder_kwargs.get("hybrid_layers"):
            raise ValueError("DETR here takes plain ViT encoders (no hybrid_layers)")
        if encoder_kwargs.get("patch_dropout"):
            raise ValueError("DETR decodes every patch: patch_dropout must be 0")
        if num_queries < 1 or decoder_depth < 1:
            raise ValueError(
                f"num_queries {num_queries} and decoder_depth {decoder_depth} must be at least 1"
            )
        self.encoder = VisionTransformer(img_size=img_size, num_classes=1, **encoder_kwargs)
        self.encoder.head = nn.Identity()  # the decoder is the head; loading drops a classifier's head
        self.num_classes, self.num_queries = num_classes, num_queries
        self.patch_size = self.encoder.patch_embed.patch_size
        d = decoder_dim
        if d % 4:
            raise ValueError(f"decoder_dim {d}: the 2-D sin-cos position code needs a multiple of 4")
        self.input_proj = nn.Linear(self.encoder.embed_dim, d)
        self.query_pos = nn.Parameter(torch.randn(num_queries, d))  # DETR's nn.Embedding: N(0, 1)
        self._memory_pos: dict[tuple, torch.Tensor] = {}  # (grid, width, device, dtype) -> [1, N, d]
        self.layers = nn.ModuleList(
            DecoderLayer(d, decoder_heads, decoder_mlp_dim, first=i == 0) for i in range(decoder_depth)
        )
        self.norm = nn.LayerNorm(d)
        self.class_head = nn.Linear(d, num_classes + 1)  # + "no object", last
        self.box_head = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 4))
        for module in (self.input_proj, self.layers, self.norm, self.class_head, self.box_head):
            module.apply(init_linear_and_norm)
        nn.init.constant_(self.class_head.bias, head_bias_init)

    def memory(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Images [B, 3, H, W] -> (the projected patch tokens [B, N, d], their 2-D position code [1, N, d])."""
        enc = self.encoder
        h, w = x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size
        tokens = enc.fc_norm(enc.forward_features(x)[:, enc.num_prefix_tokens :])  # [B, N, D]
        memory = self.input_proj(tokens)
        # Fixed: made in fp32 and joined in the activations' dtype (a bf16 engine leaves buffers fp32), once per
        # grid and device. Made on every step it was a blocking copy from pageable memory to the GPU: the host
        # waited there for the encoder's forward before it could queue the decoder.
        key = (h, w, memory.shape[-1], memory.device, memory.dtype)
        pos = self._memory_pos.get(key)
        if pos is None:
            pos = self._memory_pos[key] = sincos_2d(h, w, key[2]).to(
                device=memory.device, dtype=memory.dtype
            )[None]
        return memory, pos

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Images [B, 3, H, W] -> (class logits [L, B, Q, K + 1], boxes [L, B, Q, 4] as (cx, cy, w, h)
        fractions of the image), one row per decoder layer, the last layer's last."""
        memory, memory_pos = self.memory(x)
        # [B, Q, d]: a copy, not a view of the parameter (a view of a leaf still "requires grad" under no_grad)
        query_pos = self.query_pos.to(memory.dtype).repeat(x.shape[0], 1, 1)
        q = torch.zeros_like(query_pos)
        outputs = []
        for layer in self.layers:
            q = layer(q, query_pos, memory, memory_pos)
            outputs.append(self.norm(q))
        out = torch.stack(outputs)  # [L, B, Q, d]
        # The heads at their weights' precision, outside autocast: an evaluation (fp32 weights, bf16 autocast)
        # would otherwise rank bf16 scores, whose ties AP merges. Boxes in fp32 whatever the weights: a bf16
        # sigmoid in [0.5, 1) moves in steps of 2^-8 of the image side (5.2 px at 1333).
        with torch.autocast(out.device.type, enabled=False):
            out = out.to(self.class_head.weight.dtype)
            return self.class_head(out), self.box_head(out).float().sigmoid()

    # ------------------------------------------------------------------ FLOPs

    def forward_macs(self, img_size: int | None = None, mask_ratio: float | None = None) -> int:
        """Forward multiply-accumulates for one image: the encoder, the memory's projection, every decoder
        layer (projections, QK^T and AV of both attentions, the MLP) and both heads on every layer's output."""
        if mask_ratio:
            raise ValueError("DETR decodes every patch: no mask_ratio")
        macs, n = self.encoder.encoder_macs(img_size)
        q = self.num_queries
        macs += linear_macs(self.input_proj, n)
        macs += sum(layer.forward_macs(q, n) for layer in self.layers)
        heads = linear_macs(self.class_head, q) + sum(
            linear_macs(m, q) for m in self.box_head if isinstance(m, nn.Linear)
        )
        return macs + len(self.layers) * heads

    # ------------------------------------------------------------------ weights

    def load_pretrained(self, state: dict[str, torch.Tensor], init_head: bool) -> None:
        """Load an export: a DETR's (encoder and, with `init_head`, decoder and heads), or any plain ViT's
        into the encoder alone. Position embeddings are resampled to this model's grid."""
        load_encoder_export(self, state, init_head, "DETR decoder")


@torch.no_grad()
def detections(logits: torch.Tensor, boxes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DETR's post-processing of one layer's predictions (logits [B, Q, K + 1], boxes [B, Q, 4]): every query
    is a detection of its most likely real class, scored by that probability (the softmax over all K + 1,
    "no object" included) -> (scores [B, Q], labels [B, Q], boxes [B, Q, 4] (cx, cy, w, h) fractions)."""
    scores, labels = logits.float().softmax(-1)[..., :-1].max(-1)
    return scores, labels, boxes.float()


def _register(shape: str) -> None:
    name = f"detr_vit_{shape}"
    defaults = dict(VIT_SHAPES[shape])
    if shape == "debug":  # a decoder of the debug encoder's width: every test runs it in seconds
        defaults.update(num_queries=10, decoder_dim=64, decoder_depth=2, decoder_heads=4, decoder_mlp_dim=128)

    def build(**kw) -> DETR:
        return DETR(**{**defaults, **kw})

    build.__name__ = name
    build.__doc__ = f"DETR on ViT {shape}."
    register(build)


for _shape in VIT_SHAPES:
    _register(_shape)

__all__ = ["DETR", "detections"]
