"""LeViT, "a Vision Transformer in ConvNet's Clothing for Faster Inference" (Graham et al. 2021), single-device.

A convolutional stem (four 3x3 stride-2 convolutions, /16) feeds three stages of residual attention and MLP
blocks at falling resolution (14, 7, 4 at 224 px). Every Linear is followed by a BatchNorm over channels
(`LinearNorm`, the paper's Linear_BN) in place of LayerNorm, so that at inference `fuse()` folds every norm
into the weights. Attention has no position embedding: each head learns a bias per relative offset
(|dy|, |dx|). Between stages a shrinking attention block (queries subsampled with stride 2, more heads and
4x wider values, no residual) halves the resolution, followed by a residual MLP. Average pooling, then a
classification head and a distillation head (each BatchNorm1d + Linear); LeViT is distilled by default.

Parameter names follow timm's `levit.py` (`stem.conv1.linear`, `stages.1.downsample.attn_downsample.kv`,
`stages.0.blocks.0.attn.attention_biases`, `head.bn`, `head_dist.linear`), so its state dicts map one to one.

    model = create_model("levit_256", num_classes=100)            # distilled: head + head_dist
    model.eval().fuse()                                            # BatchNorm folded, same outputs
    model.forward_macs()                                           # 1.13 GMACs at 224 px

Masked image modelling is not supported (`supports_mim = False`): the stem's overlapping 3x3 convolutions
give the token of patch [16j, 16j + 15] the pixels [16j - 15, 16j + 15]: almost all of the patch above
and to its left. A visible token thus carries a masked neighbour's pixels, which the decoder can copy to
lower SimMIM's L1 loss on masked pixels. Train-mode BatchNorm in the stem also mixes statistics of the
masked pixels into every token. And the final map is ceil(H/64) wide, not H/mim_stride, unless H is a
multiple of 64. Masking the pixels before the stem would be a different method from the token-level
mask_token replacement the SimMIM wrapper expects. `mask_token=True` is accepted and ignored (no
parameter, no `forward_mim`): the wrapper reads `supports_mim` and refuses.

Tests: `.venv/bin/python -m pytest tests/test_model_levit.py -q`.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeline.models.layers import BatchNorm1d, BatchNorm2d, DropPath, checkpoints_block, classify
from pipeline.models.macs import reject_mask_ratio
from pipeline.models.registry import register


def _halve(res: int) -> int:
    """Side of the output of a stride-2 step with padding 1 (3x3 conv) or of a ::2 subsample."""
    return (res - 1) // 2 + 1


# ---------------------------------------------------------------------- norm-folding building blocks


@torch.no_grad()
def _bn_scale_shift(bn: nn.BatchNorm1d | nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor]:
    """Eval-mode BatchNorm as y = x * scale + shift (per channel)."""
    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    return scale, bn.bias - bn.running_mean * scale


@torch.no_grad()
def _set_weight_bias(layer: nn.Linear | nn.Conv2d, weight: torch.Tensor, bias: torch.Tensor) -> None:
    layer.weight.copy_(weight)
    if layer.bias is None:
        layer.bias = nn.Parameter(bias.to(layer.weight.dtype))  # bias=False layers gain one
    else:
        layer.bias.copy_(bias)


class ConvNorm(nn.Module):
    """Conv2d (no bias) then BatchNorm2d."""

    def __init__(self, in_chs: int, out_chs: int, kernel_size: int = 3, stride: int = 2, padding: int = 1):
        super().__init__()
        self.linear = nn.Conv2d(in_chs, out_chs, kernel_size, stride, padding, bias=False)
        self.bn = BatchNorm2d(out_chs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.linear(x))

    def fuse(self) -> None:
        if isinstance(self.bn, nn.BatchNorm2d):
            scale, shift = _bn_scale_shift(self.bn)
            bias = shift if self.linear.bias is None else self.linear.bias * scale + shift
            _set_weight_bias(self.linear, self.linear.weight * scale[:, None, None, None], bias)
            self.bn = nn.Identity()

    def macs(self, res: int) -> tuple[int, int]:
        """(MACs, output side) on a res x res input."""
        c = self.linear
        (k, _), (s, _), (p, _) = c.kernel_size, c.stride, c.padding
        out = (res + 2 * p - k) // s + 1
        return out * out * c.out_channels * c.in_channels // c.groups * k * k, out


class LinearNorm(nn.Module):
    """Linear (no bias) then BatchNorm1d over channels, on tokens [B, N, C] (the paper's Linear_BN)."""

    def __init__(self, in_features: int, out_features: int, bn_weight_init: float = 1.0):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.bn = BatchNorm1d(out_features)
        nn.init.constant_(self.bn.weight, bn_weight_init)  # 0 on residual branches: blocks start as identity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)  # [B, N, C]
        return self.bn(x.flatten(0, 1)).reshape_as(x)  # statistics over batch and tokens

    def fuse(self) -> None:
        if isinstance(self.bn, nn.BatchNorm1d):
            scale, shift = _bn_scale_shift(self.bn)
            bias = shift if self.linear.bias is None else self.linear.bias * scale + shift
            _set_weight_bias(self.linear, self.linear.weight * scale[:, None], bias)
            self.bn = nn.Identity()

    def macs(self, tokens: int) -> int:
        return tokens * self.linear.in_features * self.linear.out_features


class NormLinear(nn.Module):
    """BatchNorm1d then Linear: the classification and distillation heads."""

    def __init__(self, in_features: int, out_features: int, bias_init: float = 0.0):
        super().__init__()
        self.bn = BatchNorm1d(in_features)
        self.linear = nn.Linear(in_features, out_features)
        nn.init.zeros_(self.linear.weight)  # zero-initialised classifier, as vit.py
        nn.init.constant_(self.linear.bias, bias_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.bn(x))  # [B, C] -> [B, K]

    def fuse(self) -> None:
        if isinstance(self.bn, nn.BatchNorm1d):
            scale, shift = _bn_scale_shift(self.bn)
            w = self.linear.weight  # W (x * s + t) + b = (W * s) x + (W t + b)
            _set_weight_bias(self.linear, w * scale[None, :], w @ shift + self.linear.bias)
            self.bn = nn.Identity()

    def macs(self) -> int:
        return self.linear.in_features * self.linear.out_features


# ---------------------------------------------------------------------- stem, attention, MLP


class Stem16(nn.Module):
    """Four 3x3 stride-2 ConvNorms (C/8, C/4, C/2, C) with Hardswish between them: images -> /16 map."""

    def __init__(self, in_chans: int, out_chs: int):
        super().__init__()
        self.conv1 = ConvNorm(in_chans, out_chs // 8)
        self.act1 = nn.Hardswish()
        self.conv2 = ConvNorm(out_chs // 8, out_chs // 4)
        self.act2 = nn.Hardswish()
        self.conv3 = ConvNorm(out_chs // 4, out_chs // 2)
        self.act3 = nn.Hardswish()
        self.conv4 = ConvNorm(out_chs // 2, out_chs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act1(self.conv1(x))
        x = self.act2(self.conv2(x))
        x = self.act3(self.conv3(x))
        return self.conv4(x)  # [B, C, H/16, W/16]

    def macs(self, res: int) -> tuple[int, int]:
        total = 0
        for conv in (self.conv1, self.conv2, self.conv3, self.conv4):
            m, res = conv.macs(res)
            total += m
        return total, res


def _bias_index(q_res: int, k_res: int, stride: int) -> torch.Tensor:
    """[Nq, Nk] index into a [heads, k_res * k_res] table: |dy| * k_res + |dx| between a query on the
    stride-subsampled grid (position stride * i) and a key.

    Computed on the CPU, then moved to the default device: real values even when the model is built on
    meta (where elementwise ops would also go through the slow first import of torch's reference ops).
    """
    cpu = torch.device("cpu")
    k_axis, q_axis = torch.arange(k_res, device=cpu), torch.arange(q_res, device=cpu) * stride
    k = torch.stack(torch.meshgrid(k_axis, k_axis, indexing="ij")).flatten(1)  # [2, Nk]
    q = torch.stack(torch.meshgrid(q_axis, q_axis, indexing="ij")).flatten(1)  # [2, Nq]
    rel = (q[:, :, None] - k[:, None, :]).abs()  # [2, Nq, Nk]
    return (rel[0] * k_res + rel[1]).to(torch.empty(0).device)


class Attention(nn.Module):
    """Multi-head attention with a learned bias per head and relative offset; values attn_ratio x wider."""

    def __init__(self, dim: int, key_dim: int, num_heads: int, attn_ratio: float, resolution: int):
        super().__init__()
        self.num_heads, self.key_dim, self.val_dim = num_heads, key_dim, int(attn_ratio * key_dim)
        self.val_attn_dim = self.val_dim * num_heads
        self.scale = key_dim**-0.5
        self.resolution = resolution
        # Per head [q | k | v] (timm's layout): split after viewing heads.
        self.qkv = LinearNorm(dim, num_heads * (2 * key_dim + self.val_dim))
        self.proj = nn.Sequential(
            OrderedDict(act=nn.Hardswish(), ln=LinearNorm(self.val_attn_dim, dim, bn_weight_init=0.0))
        )
        # The table and its index live here: under ZeRO-3 a parameter is gathered only for the forward
        # of the module that registers it.
        self.attention_biases = nn.Parameter(torch.zeros(num_heads, resolution * resolution))
        self.register_buffer("attention_bias_idxs", _bias_index(resolution, resolution, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        q, k, v = (
            self.qkv(x)
            .view(B, N, self.num_heads, -1)
            .split([self.key_dim, self.key_dim, self.val_dim], dim=3)
        )
        q, k, v = q.transpose(1, 2), k.permute(0, 2, 3, 1), v.transpose(1, 2)  # k: [B, h, d, N]
        bias = self.attention_biases[:, self.attention_bias_idxs]  # [h, N, N]
        attn = (q @ k * self.scale + bias).softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(B, N, self.val_attn_dim)
        return self.proj(x)

    def macs(self, res: int) -> int:
        n = res * res
        attention = n * n * self.num_heads * (self.key_dim + self.val_dim)  # QK^T and AV
        return self.qkv.macs(n) + attention + self.proj.ln.macs(n)


class Subsample(nn.Module):
    """Tokens of a res x res grid -> every stride-th row and column."""

    def __init__(self, stride: int, resolution: int):
        super().__init__()
        self.stride, self.resolution = stride, resolution

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, _, C = x.shape
        x = x.view(B, self.resolution, self.resolution, C)[:, :: self.stride, :: self.stride]
        return x.reshape(B, -1, C)


class AttentionDownsample(nn.Module):
    """Shrinking attention: keys and values on the full grid, queries on the stride-2 subgrid; no residual."""

    def __init__(
        self, in_dim: int, out_dim: int, key_dim: int, num_heads: int, attn_ratio: float, resolution: int
    ):
        super().__init__()
        stride = 2
        self.num_heads, self.key_dim, self.val_dim = num_heads, key_dim, int(attn_ratio * key_dim)
        self.val_attn_dim = self.val_dim * num_heads
        self.scale = key_dim**-0.5
        self.resolution, self.resolution_out = resolution, (resolution - 1) // stride + 1
        self.kv = LinearNorm(in_dim, num_heads * (key_dim + self.val_dim))
        self.q = nn.Sequential(
            OrderedDict(down=Subsample(stride, resolution), ln=LinearNorm(in_dim, num_heads * key_dim))
        )
        self.proj = nn.Sequential(OrderedDict(act=nn.Hardswish(), ln=LinearNorm(self.val_attn_dim, out_dim)))
        self.attention_biases = nn.Parameter(torch.zeros(num_heads, resolution * resolution))
        self.register_buffer(
            "attention_bias_idxs", _bias_index(self.resolution_out, resolution, stride), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        k, v = self.kv(x).view(B, N, self.num_heads, -1).split([self.key_dim, self.val_dim], dim=3)
        k, v = k.permute(0, 2, 3, 1), v.transpose(1, 2)  # [B, h, d, N], [B, h, N, dv]
        q = self.q(x).view(B, -1, self.num_heads, self.key_dim).transpose(1, 2)  # [B, h, N/4, d]
        bias = self.attention_biases[:, self.attention_bias_idxs]  # [h, N/4, N]
        attn = (q @ k * self.scale + bias).softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(B, -1, self.val_attn_dim)  # [B, N/4, h * dv]
        return self.proj(x)

    def macs(self, res: int) -> int:
        n, n_out = res * res, _halve(res) ** 2
        attention = n_out * n * self.num_heads * (self.key_dim + self.val_dim)
        return self.kv.macs(n) + self.q.ln.macs(n_out) + attention + self.proj.ln.macs(n_out)


class LevitMlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.ln1 = LinearNorm(dim, hidden)
        self.act = nn.Hardswish()
        self.ln2 = LinearNorm(hidden, dim, bn_weight_init=0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln2(self.act(self.ln1(x)))

    def macs(self, tokens: int) -> int:
        return self.ln1.macs(tokens) + self.ln2.macs(tokens)


class LevitBlock(nn.Module):
    """Residual attention then residual MLP (no pre-norm: the BatchNorms sit inside the branches)."""

    def __init__(self, dim, key_dim, num_heads, attn_ratio, mlp_ratio, resolution, drop_path):
        super().__init__()
        self.attn = Attention(dim, key_dim, num_heads, attn_ratio, resolution)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.mlp = LevitMlp(dim, int(dim * mlp_ratio))
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.attn(x))
        return x + self.drop_path2(self.mlp(x))

    def macs(self, res: int) -> tuple[int, int]:
        return self.attn.macs(res) + self.mlp.macs(res * res), res


class LevitDownsample(nn.Module):
    """Between stages: shrinking attention (in_dim // key_dim heads, values 4 x key_dim), then a residual MLP."""

    def __init__(self, in_dim, out_dim, key_dim, resolution, drop_path):
        super().__init__()
        heads = in_dim // key_dim
        self.attn_downsample = AttentionDownsample(in_dim, out_dim, key_dim, heads, 4.0, resolution)
        self.mlp = LevitMlp(out_dim, 2 * out_dim)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn_downsample(x)  # [B, N/4, out_dim]
        return x + self.drop_path(self.mlp(x))

    def macs(self, res: int) -> tuple[int, int]:
        out = _halve(res)
        return self.attn_downsample.macs(res) + self.mlp.macs(out * out), out


class LevitStage(nn.Module):
    """Optional LevitDownsample (every stage but the first), then `depth` LevitBlocks."""

    def __init__(
        self,
        in_dim,
        out_dim,
        key_dim,
        depth,
        num_heads,
        attn_ratio,
        mlp_ratio,
        resolution,
        downsample: bool,
        drop_path: float,
    ):
        super().__init__()
        if downsample:
            self.downsample: nn.Module = LevitDownsample(in_dim, out_dim, key_dim, resolution, drop_path)
            resolution = _halve(resolution)
        else:
            if in_dim != out_dim:
                raise ValueError(f"a stage without downsampling keeps its width: {in_dim} != {out_dim}")
            self.downsample = nn.Identity()
        self.resolution_out = resolution
        self.blocks = nn.Sequential(
            *(
                LevitBlock(out_dim, key_dim, num_heads, attn_ratio, mlp_ratio, resolution, drop_path)
                for _ in range(depth)
            )
        )

    def layers(self) -> list[nn.Module]:
        """The units the model runs (and checkpoints) one after another."""
        down = [] if isinstance(self.downsample, nn.Identity) else [self.downsample]
        return down + list(self.blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))


# ---------------------------------------------------------------------- the model


class Levit(nn.Module):
    """LeViT: stem, three stages, average pooling, head (+ head_dist when distilled).

    drop_path_rate is the same for every residual branch, as in the reference implementation.
    """

    supports_mim = False  # see the module docstring

    def __init__(
        self,
        img_size: int = 224,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: tuple[int, ...] = (128, 256, 384),
        key_dim: int = 16,
        num_heads: tuple[int, ...] = (4, 6, 8),
        depth: tuple[int, ...] = (2, 3, 4),
        attn_ratio: float = 2.0,
        mlp_ratio: float = 2.0,
        distilled: bool = True,
        head_bias_init: float = 0.0,
        drop_path_rate: float = 0.0,
        grad_checkpointing: float = 0.0,
        mask_token: bool = False,
    ):
        super().__init__()
        # mask_token is accepted for the common constructor signature but creates nothing: callers such as
        # the SimMIM wrapper read `supports_mim` (False) and refuse with their own message.
        del mask_token
        embed_dim, num_heads, depth = tuple(embed_dim), tuple(num_heads), tuple(depth)
        if not len(embed_dim) == len(num_heads) == len(depth):
            raise ValueError(
                f"embed_dim {embed_dim}, num_heads {num_heads} and depth {depth} need one entry per stage"
            )
        if embed_dim[0] % 8:
            raise ValueError(f"the stem needs embed_dim[0] divisible by 8, got {embed_dim[0]}")
        if any(d < key_dim for d in embed_dim[:-1]):
            raise ValueError(f"shrinking attention uses embed_dim // key_dim heads: {embed_dim} vs {key_dim}")
        self.img_size, self.num_classes, self.distilled = img_size, num_classes, distilled
        self.embed_dim, self.num_features = embed_dim, embed_dim[-1]
        self.grad_checkpointing = grad_checkpointing
        self.distilled_training = False  # set by the distillation objective: forward returns both heads

        self.stem = Stem16(in_chans, embed_dim[0])
        resolution = img_size
        for _ in range(4):
            resolution = _halve(resolution)  # the stem's four stride-2 convolutions
        self.stages = nn.ModuleList()
        in_dim = embed_dim[0]
        for i, (dim, heads, d) in enumerate(zip(embed_dim, num_heads, depth)):
            stage = LevitStage(
                in_dim, dim, key_dim, d, heads, attn_ratio, mlp_ratio, resolution, i > 0, drop_path_rate
            )
            self.stages.append(stage)
            resolution, in_dim = stage.resolution_out, dim
        self.final_resolution = resolution

        def make_head() -> nn.Module:  # num_classes=0: a feature extractor
            dim = self.num_features
            return NormLinear(dim, num_classes, head_bias_init) if num_classes > 0 else nn.Identity()

        self.head = make_head()
        self.head_dist = make_head() if distilled else None

    # ------------------------------------------------------------------ forward

    def checkpointed_fraction(self) -> float:
        """The share of the layers `forward_features` recomputes in backward (see layers.checkpointed_fraction)."""
        n = sum(len(stage.layers()) for stage in self.stages)
        return sum(checkpoints_block(self.grad_checkpointing, i, n) for i in range(n)) / n

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2:] != (self.img_size, self.img_size):
            raise ValueError(
                f"LeViT built for {self.img_size}px images got {tuple(x.shape[-2:])}: its attention biases "
                f"are tied to the grid; create the model with img_size={x.shape[-1]}"
            )
        x = self.stem(x).flatten(2).transpose(1, 2)  # [B, N, C]
        layers = [layer for stage in self.stages for layer in stage.layers()]
        for i, layer in enumerate(layers):
            if self.training and checkpoints_block(self.grad_checkpointing, i, len(layers)):
                x = checkpoint(layer, x, use_reentrant=False)  # recompute activations in backward
            else:
                x = layer(x)
        return x  # [B, N_final, num_features]

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False):
        x = x.mean(dim=1)  # [B, num_features]
        if pre_logits:
            return x
        return classify(self, x, x)

    def forward(self, x: torch.Tensor):
        return self.forward_head(self.forward_features(x))

    # ------------------------------------------------------------------ inference

    def fuse(self) -> Levit:
        """Fold every BatchNorm into its neighbouring Conv/Linear, in place, for inference.

        Uses the running statistics, so the fused model equals the unfused one in eval mode; training
        the fused model afterwards trains a network without normalisation.
        """
        for m in self.modules():
            if isinstance(m, (ConvNorm, LinearNorm, NormLinear)):
                m.fuse()
        return self

    # ------------------------------------------------------------------ FLOPs

    def forward_macs(self, img_size: int | None = None, mask_ratio: float | None = None) -> int:
        """Forward multiply-accumulates for one image from the module shapes (works on meta).

        Counts the stem convolutions, every Linear, QK^T and AV, and the heads; BatchNorm, Hardswish,
        softmax, the bias add and pooling are left out, so fuse() does not change the count.
        """
        reject_mask_ratio(self, mask_ratio)
        macs, res = self.stem.macs(self.img_size if img_size is None else img_size)
        for stage in self.stages:
            for layer in stage.layers():
                m, res = layer.macs(res)
                macs += m
        for head in (self.head, self.head_dist):
            if isinstance(head, NormLinear):
                macs += head.macs()
        return macs


# ---------------------------------------------------------------------- registered variants (Table 1)


def _levit(embed_dim, key_dim, num_heads, depth, drop_path_rate, /, **overrides):
    # Positional-only shape, so an override may name any of them (create_model("levit_128s", depth=(1, 1, 1))).
    kw = dict(
        embed_dim=embed_dim,
        key_dim=key_dim,
        num_heads=num_heads,
        depth=depth,
        drop_path_rate=drop_path_rate,
        distilled=True,
    )
    return Levit(**{**kw, **overrides})


@register
def levit_debug(**kw):
    """Tiny LeViT for tests and smoke runs: 32px images (2x2, 1x1, 1x1 grids), widths 32/48/64."""
    return _levit((32, 48, 64), 8, (2, 3, 4), (1, 1, 1), 0.0, **{"img_size": 32, **kw})


@register
def levit_128s(**kw):
    return _levit((128, 256, 384), 16, (4, 6, 8), (2, 3, 4), 0.0, **kw)


@register
def levit_128(**kw):
    return _levit((128, 256, 384), 16, (4, 8, 12), (4, 4, 4), 0.0, **kw)


@register
def levit_192(**kw):
    return _levit((192, 288, 384), 32, (3, 5, 6), (4, 4, 4), 0.0, **kw)


@register
def levit_256(**kw):
    return _levit((256, 384, 512), 32, (4, 6, 8), (4, 4, 4), 0.0, **kw)


@register
def levit_384(**kw):
    """The paper trains LeViT-384 with stochastic depth 0.1; the smaller ones without."""
    return _levit((384, 512, 768), 32, (6, 9, 12), (4, 4, 4), 0.1, **kw)
