"""Swin Transformer: paper sizes, analytic FLOPs, shifted-window masking, SimMIM, the debug variant."""

import pytest
import torch
from conftest import counted_macs, meta_model

import pipeline.models.swin  # noqa: F401  (registers swin_*)
from pipeline.models import create_model
from pipeline.models.swin import MASK_VALUE, SwinBlock, SwinTransformer

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_thread")]

NAMES = ("swin_debug", "swin_t", "swin_s", "swin_b")


@pytest.fixture(scope="module")
def swin_t_64():
    """Swin-T at 64 px: stages 16 and 8 pad to 21 and 14 for window 7, stages 4 and 2 clip the window."""
    torch.manual_seed(0)
    return create_model("swin_t", img_size=64)


# ---------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    "name,paper,timm",
    [("swin_t", 28e6, 28_288_354), ("swin_s", 50e6, 49_606_258), ("swin_b", 88e6, 87_768_224)],
)
def test_parameter_counts_match_the_paper(name, paper, timm):
    n = sum(p.numel() for p in meta_model(name, num_classes=1000).parameters())
    assert abs(n - paper) / paper < 0.02
    assert n == timm  # the official layout, parameter for parameter


def test_debug_variant_is_tiny_and_runs_at_32px():
    model = create_model("swin_debug", num_classes=10)
    assert model.img_size == 32
    assert sum(p.numel() for p in model.parameters()) < 400_000
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    # Stages 1-2 (16x16 and 8x8 tokens, window 4) alternate plain and shifted windows; 3-4 are clipped.
    shifts = [[b.shift_size for b in layer.blocks] for layer in model.layers]
    assert shifts == [[0, 2], [0, 2], [0, 0], [0]]


def test_every_registered_name_builds_on_meta():
    for name in NAMES:
        model = meta_model(name)
        assert isinstance(model, SwinTransformer)
        assert model.num_features == model.embed_dim * 8


# ---------------------------------------------------------------------- FLOPs


@pytest.mark.parametrize("name,img_size", [("swin_debug", 32), ("swin_debug", 64)])
def test_forward_macs_match_flop_counter_on_a_real_forward(name, img_size):
    model = create_model(name, img_size=img_size)
    counted = counted_macs(model, img_size)
    assert abs(model.forward_macs() - counted) / counted < 0.02


def test_forward_macs_match_flop_counter_with_padded_windows(swin_t_64):
    counted = counted_macs(swin_t_64, 64)
    assert abs(swin_t_64.forward_macs() - counted) / counted < 0.02
    # The meta-device forward (used below for the large variants) counts the same operations.
    assert counted_macs(meta_model("swin_t", img_size=64), 64, device="meta") == counted


@pytest.mark.parametrize("name,img_size", [("swin_t", 224), ("swin_s", 64), ("swin_b", 64)])
def test_forward_macs_match_flop_counter_on_the_large_variants(name, img_size):
    # Traced on the meta device: the same ops and shapes without initialising 28-88M weights.
    model = meta_model(name, img_size=img_size)
    counted = counted_macs(model, img_size, device="meta")
    assert abs(model.forward_macs() - counted) / counted < 0.02


@pytest.mark.parametrize("name,paper_gmacs", [("swin_t", 4.5), ("swin_s", 8.7), ("swin_b", 15.4)])
def test_forward_macs_match_the_paper_at_224(name, paper_gmacs):
    macs = meta_model(name).forward_macs()
    assert abs(macs / 1e9 - paper_gmacs) / paper_gmacs < 0.02


# ---------------------------------------------------------------------- shifted windows


def _shifted_window_id(h: int, w: int, window: int, shift: int) -> tuple[int, int]:
    """The paper's shifted partition in the original coordinates: the regular grid displaced by (shift, shift)."""
    return (h - shift) // window, (
        w - shift
    ) // window  # floor division: rows/columns before `shift` are window -1


def _allowed_pairs_from_mask(block: SwinBlock) -> torch.Tensor:
    """[Lp, Lp] bool over the padded grid (original coordinates): may token p attend to token q?"""
    H, W = block.resolution[0] + block.pad_h, block.resolution[1] + block.pad_w
    ws, s = block.window_size, block.shift_size
    mask = block.attn_mask.tolist()  # [nW, N, N] over the rolled map
    allowed = torch.zeros(H * W, H * W, dtype=torch.bool)
    for win in range(len(mask)):
        wr, wc = divmod(win, W // ws)
        # Token i of rolled window `win` sits at rolled (r, c), i.e. original ((r + s) % H, (c + s) % W).
        orig = []
        for i in range(ws * ws):
            r, c = wr * ws + i // ws, wc * ws + i % ws
            orig.append(((r + s) % H) * W + (c + s) % W)
        for i in range(ws * ws):
            for j in range(ws * ws):
                if mask[win][i][j] == 0:
                    allowed[orig[i], orig[j]] = True
    return allowed


@pytest.mark.parametrize("resolution,window", [((8, 8), 4), ((14, 14), 7), ((10, 10), 4), ((16, 12), 7)])
def test_shift_mask_allows_exactly_the_pairs_within_one_shifted_window(resolution, window):
    block = SwinBlock(8, resolution, 2, window, shifted=True)
    assert block.shift_size == window // 2
    mask = block.attn_mask
    assert set(mask.unique().tolist()) == {0.0, MASK_VALUE}
    H, W = resolution[0] + block.pad_h, resolution[1] + block.pad_w
    assert H % window == 0 and W % window == 0  # the mask is built on the padded grid
    ids = [_shifted_window_id(h, w, window, block.shift_size) for h in range(H) for w in range(W)]
    expected = torch.tensor([[a == b for b in ids] for a in ids])
    assert torch.equal(_allowed_pairs_from_mask(block), expected)


@pytest.mark.parametrize("resolution,window", [((8, 8), 4), ((10, 10), 4)])
@pytest.mark.parametrize("shifted", [True, False])
def test_perturbing_one_token_changes_only_its_window(resolution, window, shifted):
    torch.manual_seed(0)
    block = SwinBlock(8, resolution, 2, window, shifted=shifted).double().eval()
    with torch.no_grad():  # a random bias table, so relative positions matter too
        block.attn.relative_position_bias_table.normal_()
    H, W = resolution
    s = block.shift_size
    x = torch.randn(1, H * W, 8, dtype=torch.float64)
    base = block(x)
    for h, w in [(0, 0), (0, W - 1), (H - 1, W - 1), (1, 6), (3, 3), (H // 2, 1)]:
        x2 = x.clone()
        x2[0, h * W + w] += torch.randn(8, dtype=torch.float64)
        changed = ((block(x2) - base).abs().amax(-1)[0] > 1e-9).view(H, W)
        target = _shifted_window_id(h, w, window, s)
        expected = torch.tensor(
            [[_shifted_window_id(i, j, window, s) == target for j in range(W)] for i in range(H)]
        )
        assert torch.equal(changed, expected), (h, w)


def test_stage_windows_are_clipped_and_padded_as_the_official_code(swin_t_64):
    def layout(model):
        return [
            (b.resolution, b.window_size, b.shift_size, b.pad_h)
            for layer in model.layers
            for b in layer.blocks
        ]

    at_224 = layout(meta_model("swin_t"))
    assert at_224[0] == ((56, 56), 7, 0, 0) and at_224[1] == ((56, 56), 7, 3, 0)
    assert at_224[-1] == ((7, 7), 7, 0, 0)  # a 7x7 grid is one window: never shifted
    at_64 = layout(swin_t_64)
    assert at_64[:4] == [((16, 16), 7, 0, 5), ((16, 16), 7, 3, 5), ((8, 8), 7, 0, 6), ((8, 8), 7, 3, 6)]
    assert set(at_64[4:10]) == {((4, 4), 4, 0, 0)} and set(at_64[10:]) == {((2, 2), 2, 0, 0)}
    table = swin_t_64.layers[2].blocks[0].attn.relative_position_bias_table
    assert table.shape == (7 * 7, 12)  # (2W-1)^2 x heads for the clipped window


# ---------------------------------------------------------------------- training behaviour


def _grad_check(model, x):
    """Every parameter gets a finite, nonzero gradient (the zero-initialised head is probed separately).

    Run in eval mode: stochastic depth may drop a whole block for a batch of two, starving it of gradient.
    """
    pooled = model.eval().forward_head(model.forward_features(x), pre_logits=True)  # [B, C]
    probe = torch.randn(x.shape[0], model.num_features)
    loss = model.head(pooled).logsumexp(-1).sum() + (pooled * probe).sum()
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_padded_and_shifted_windows_train_every_parameter():
    # Window 3 on grids 16, 8, 4, 2: stages 1-3 pad (to 18, 9, 6) and shift, stage 4 is one clipped window.
    torch.manual_seed(0)
    model = create_model("swin_debug", window_size=3)
    layout = [(b.window_size, b.shift_size, b.pad_h) for layer in model.layers for b in layer.blocks]
    assert layout == [(3, 0, 2), (3, 1, 2), (3, 0, 1), (3, 1, 1), (3, 0, 2), (3, 1, 2), (2, 0, 0)]
    _grad_check(model, torch.randn(2, 3, 32, 32))


def test_debug_every_parameter_gets_a_gradient():
    torch.manual_seed(0)
    model = create_model("swin_debug", num_classes=5, head_bias_init=-2.0)
    x = torch.randn(2, 3, 32, 32)
    assert torch.allclose(model.train()(x), torch.full((2, 5), -2.0))  # zero-initialised head
    _grad_check(model, x)


def test_grad_checkpointing_gives_the_same_loss_and_gradients():
    torch.manual_seed(0)
    a = create_model("swin_debug", num_classes=3, drop_path_rate=0.0).train()
    b = create_model("swin_debug", num_classes=3, drop_path_rate=0.0, grad_checkpointing=True).train()
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 3, 32, 32)
    for m in (a, b):
        m.forward_head(m.forward_features(x), pre_logits=True).square().sum().backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        if name.startswith("head."):  # pre-logits: the classifier is not used
            continue
        assert torch.allclose(pa.grad, pb.grad, atol=1e-6), name


def test_heads_distillation_and_feature_extractor():
    x = torch.randn(2, 3, 32, 32)
    m = create_model("swin_debug", num_classes=4, distilled=True, head_bias_init=1.0).train()
    assert torch.allclose(m(x), torch.ones(2, 4))
    m.distilled_training = True
    logits, logits_dist = m(x)
    assert logits.shape == logits_dist.shape == (2, 4)
    feats = create_model("swin_debug", num_classes=0)
    assert isinstance(feats.head, torch.nn.Identity)
    assert feats(x).shape == (2, feats.num_features) == (2, 128)
    assert feats.forward_features(x).shape == (2, 4, 128)  # 32 px / 16 = 2x2 tokens
    with pytest.raises(ValueError, match="built for 32px"):
        feats(torch.randn(1, 3, 64, 64))


def test_official_parameter_names():
    keys = set(meta_model("swin_t").state_dict())
    for key in (
        "patch_embed.proj.weight",
        "patch_embed.norm.weight",
        "layers.0.blocks.1.attn.relative_position_bias_table",
        "layers.0.blocks.1.attn.qkv.weight",
        "layers.0.blocks.1.mlp.fc2.bias",
        "layers.2.downsample.reduction.weight",
        "layers.2.downsample.norm.bias",
        "norm.weight",
        "head.weight",
    ):
        assert key in keys, key
    assert not any("attn_mask" in k or "relative_position_index" in k for k in keys)  # derived buffers


# ---------------------------------------------------------------------- SimMIM


def test_forward_mim_shape_and_mask_token_gradient():
    torch.manual_seed(0)
    swin_t = meta_model("swin_t", mask_token=True)
    assert swin_t.supports_mim and (swin_t.mim_patch_size, swin_t.mim_stride) == (4, 32)
    model = create_model("swin_debug", mask_token=True).train()
    assert (model.mim_patch_size, model.mim_stride) == (2, 16)  # the debug variant's 2x2 patches
    assert model.mask_token.shape == (1, 1, model.embed_dim)
    x = torch.randn(2, 3, 32, 32)
    mask = torch.rand(2, 16, 16) < 0.6  # [B, H/2, W/2]
    out = model.forward_mim(x, mask)
    assert out.shape == (2, model.num_features, 2, 2)
    out.square().mean().backward()
    assert model.mask_token.grad is not None and model.mask_token.grad.abs().sum() > 0
    with torch.no_grad():
        model.eval()
        assert not torch.allclose(model.forward_mim(x, mask), model.forward_mim(x, torch.zeros_like(mask)))
        # Nothing masked: the plain backbone, as a 2-D map.
        tokens = model.forward_features(x)  # [B, 4, C]
        as_map = tokens.transpose(1, 2).reshape(2, model.num_features, 2, 2)
        assert torch.allclose(model.forward_mim(x, torch.zeros_like(mask)), as_map, atol=1e-6)


def test_mask_token_only_when_asked():
    assert create_model("swin_debug").mask_token is None
    with pytest.raises(ValueError, match="mask_token=True"):
        create_model("swin_debug").forward_mim(
            torch.randn(1, 3, 32, 32), torch.zeros(1, 16, 16, dtype=torch.bool)
        )
