import pytest
import torch
from conftest import counted_macs
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

import pipeline.models.levit  # noqa: F401
from pipeline.models.levit import Attention, AttentionDownsample, Levit
from pipeline.models.registry import create_model, list_models

pytestmark = pytest.mark.unit

NAMES = ["levit_debug", "levit_128s", "levit_128", "levit_192", "levit_256", "levit_384"]


def randomise_batchnorms(model: nn.Module, seed: int = 0) -> None:
    """Non-trivial running statistics and affine parameters (the zero-init gammas included), and a
    non-zero classifier, so that every layer shows in the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
                c = m.num_features
                m.running_mean.copy_(torch.randn(c, generator=g) * 0.5)
                m.running_var.copy_(torch.rand(c, generator=g) + 0.5)
                m.weight.copy_(torch.rand(c, generator=g) + 0.5)
                m.bias.copy_(torch.randn(c, generator=g) * 0.2)
        for name in ("head", "head_dist"):
            head = getattr(model, name, None)
            if head is not None and not isinstance(head, nn.Identity):
                head.linear.weight.copy_(torch.randn(head.linear.weight.shape, generator=g) * 0.05)
        for name, p in model.named_parameters():
            if name.endswith("attention_biases"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def test_registry_lists_the_family():
    assert set(NAMES) <= set(list_models())
    assert Levit.supports_mim is False


@pytest.mark.parametrize(
    "name,paper",
    [
        ("levit_128s", 7.8e6),
        ("levit_128", 9.2e6),
        ("levit_192", 11.0e6),
        ("levit_256", 18.9e6),
        ("levit_384", 39.1e6),
    ],
)
def test_parameter_counts_match_paper(name, paper):
    with torch.device("meta"):  # count without allocating weights
        model = create_model(name, num_classes=1000)
    assert model.distilled and model.head_dist is not None  # the paper's counts include the distillation head
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - paper) / paper < 0.02, n


def test_debug_variant_is_tiny():
    model = create_model("levit_debug", num_classes=10)
    assert sum(p.numel() for p in model.parameters()) < 400_000
    assert model.img_size == 32
    model.eval()
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


@pytest.mark.parametrize(
    "name,img_size",
    [(n, 32 if n == "levit_debug" else 64) for n in NAMES] + [("levit_128s", 224)],
)
def test_forward_macs_match_flop_counter(name, img_size):
    torch.manual_seed(0)
    model = create_model(name, img_size=img_size).eval()  # eval: BatchNorm on a batch of 1
    analytic = model.forward_macs()
    counted = counted_macs(model, img_size)
    assert abs(analytic - counted) / counted < 0.02, (analytic, counted)
    with torch.device("meta"):  # and from shapes alone
        assert create_model(name, img_size=img_size).forward_macs() == analytic


def test_forward_macs_match_the_paper_at_224():
    # Table 1 of the paper (its counter also includes softmax, about 0.1%).
    for name, paper in [("levit_128s", 305e6), ("levit_256", 1120e6), ("levit_384", 2353e6)]:
        with torch.device("meta"):
            macs = create_model(name).forward_macs()
        assert abs(macs - paper) / paper < 0.01, (name, macs)


def test_shrinking_attention_at_64px_goes_4_2_1():
    model = create_model("levit_128s", img_size=64)
    assert [s.resolution_out for s in model.stages] == [4, 2, 1]
    downs = [m for m in model.modules() if isinstance(m, AttentionDownsample)]
    assert [tuple(d.attention_bias_idxs.shape) for d in downs] == [(4, 16), (1, 4)]
    assert [tuple(d.attention_biases.shape) for d in downs] == [(8, 16), (16, 4)]  # in_dim // key_dim heads
    # Query (2, 2) of the subgrid sits at (2, 2) on the 4x4 key grid; key (0, 3): |dy| = 2, |dx| = 1.
    assert downs[0].attention_bias_idxs[3, 0 * 4 + 3] == 2 * 4 + 1
    assert downs[0].attention_bias_idxs[0].tolist() == [dy * 4 + dx for dy in range(4) for dx in range(4)]
    # Same-grid attention: symmetric index, 0 on the diagonal.
    idx = model.stages[0].blocks[0].attn.attention_bias_idxs
    assert torch.equal(idx, idx.T) and torch.all(idx.diagonal() == 0)
    out = model.eval()(torch.randn(1, 3, 64, 64))
    assert out.shape == (1, 1000)


def test_distilled_by_default_and_head_behaviour():
    torch.manual_seed(0)
    model = create_model("levit_debug", num_classes=5, head_bias_init=-3.0)
    assert model.distilled and isinstance(model.head_dist, nn.Module)
    x = torch.randn(2, 3, 32, 32)
    model.eval()
    assert torch.allclose(model(x), torch.full((2, 5), -3.0))  # zero-initialised heads: logits = bias
    randomise_batchnorms(model)
    feats = model.forward_head(model.forward_features(x), pre_logits=True)
    assert feats.shape == (2, model.num_features)
    both = model.head(feats), model.head_dist(feats)
    assert torch.allclose(model(x), (both[0] + both[1]) / 2)
    model.train()
    assert isinstance(model(x), torch.Tensor)  # averaged unless the distillation objective asks for both
    model.distilled_training = True
    logits, logits_dist = model(x)
    assert logits.shape == logits_dist.shape == (2, 5)
    model.eval()
    assert isinstance(model(x), torch.Tensor)

    plain = create_model("levit_debug", num_classes=5, distilled=False)
    assert plain.head_dist is None and "head_dist.linear.weight" not in plain.state_dict()
    features = create_model("levit_debug", num_classes=0).eval()
    assert isinstance(features.head, nn.Identity)
    assert features(x).shape == (2, features.num_features)


def test_forward_backward_at_64px_every_parameter_gets_a_gradient():
    torch.manual_seed(0)
    for name in ("levit_128s", "levit_debug"):
        size = 64 if name == "levit_128s" else 32
        model = create_model(name, img_size=size, num_classes=7)
        x = torch.randn(2, 3, size, size)
        # At initialisation the residual branches end in a zero BatchNorm gamma (blocks start as the
        # identity) and the heads are zero: their inner weights get exactly-zero gradients. Every
        # parameter is still used (a gradient tensor, no None), which is what ZeRO needs.
        loss = nn.functional.cross_entropy(model(x), torch.tensor([1, 2]))
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        # With non-zero gammas, every parameter is wired into the loss.
        model.zero_grad(set_to_none=True)
        randomise_batchnorms(model)
        loss = nn.functional.cross_entropy(model(x), torch.tensor([1, 2]))
        loss.backward()
        # Attention over a 1x1 grid has one key: softmax gives 1 whatever the logits, so the bias and
        # the query projection of the shrinking attention cannot matter there.
        logits_only = set()
        for mn, m in model.named_modules():
            if isinstance(m, (Attention, AttentionDownsample)) and m.resolution == 1:
                logits_only.add(f"{mn}.attention_biases")
                if isinstance(m, AttentionDownsample):
                    logits_only |= {f"{mn}.q.{n}" for n, _ in m.q.named_parameters()}
        for n, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), n
            assert (p.grad.abs().sum() > 0) != (n in logits_only), n


def test_grad_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    model = create_model("levit_debug", num_classes=3)
    randomise_batchnorms(model)
    x = torch.randn(4, 3, 32, 32)
    grads = []
    for ckpt in (False, True):
        model.zero_grad(set_to_none=True)
        model.grad_checkpointing = ckpt  # the engine sets the attribute after construction
        model(x).square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6, rtol=1e-5), n


@pytest.mark.parametrize("name,img_size", [("levit_debug", 32), ("levit_128s", 64)])
def test_fuse_folds_every_batchnorm_and_keeps_outputs(name, img_size):
    torch.manual_seed(0)
    model = create_model(name, img_size=img_size, num_classes=10)
    randomise_batchnorms(model)
    model.train()
    with torch.no_grad():  # real running statistics on top of the random ones
        for _ in range(2):
            model(torch.randn(4, 3, img_size, img_size))
    model.eval()
    x = torch.randn(2, 3, img_size, img_size)
    with torch.no_grad():
        before = model(x)
        macs = model.forward_macs()
        assert model.fuse() is model
        after = model(x)
    assert before.abs().max() > 0.1  # the check is not trivially about zeros
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert torch.allclose(before, after, atol=1e-5, rtol=1e-5), (before - after).abs().max()
    assert model.forward_macs() == macs
    assert model.fuse() is model  # a second fuse is a no-op
    with torch.no_grad():
        assert torch.equal(model(x), after)


class _ParamOwnerCheck(TorchFunctionMode):
    """Records any parameter used while the innermost running module is not the one that registers it
    (DeepSpeed ZeRO-3 gathers a module's own parameters only around that module's forward)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.owner = {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.stack: list[nn.Module] = []
        self.violations: list[str] = []
        for m in model.modules():
            m.register_forward_pre_hook(self._enter)
            m.register_forward_hook(self._leave)

    def _enter(self, module, args) -> None:
        self.stack.append(module)

    def _leave(self, module, args, out) -> None:  # None: keep the module's output
        assert self.stack.pop() is module

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for a in tree_flatten((args, kwargs))[0]:
            if isinstance(a, nn.Parameter) and (not self.stack or self.owner[id(a)] is not self.stack[-1]):
                self.violations.append(f"{self.names[id(a)]} in {func}")
        return func(*args, **kwargs)


def test_parameters_are_used_only_by_the_module_that_registers_them():
    model = create_model("levit_debug", num_classes=3)
    check = _ParamOwnerCheck(model)
    with check:
        model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert len(check.owner) == len(list(model.parameters()))
    assert not check.violations, check.violations[:5]
    # The bias index tables are buffers (not saved in state dicts: rebuilt from img_size).
    names = {n for n, _ in model.named_buffers()}
    assert "stages.0.blocks.0.attn.attention_bias_idxs" in names
    assert not any("attention_bias_idxs" in k for k in model.state_dict())


def test_meta_construction_and_shape_overrides():
    with torch.device("meta"):
        model = create_model("levit_256", depth=(1, 1, 1), embed_dim=(64, 96, 128), num_heads=(2, 3, 4))
        big = create_model("levit_384")
    assert model.num_features == 128 and sum(len(s.blocks) for s in model.stages) == 3
    assert big.stages[0].blocks[0].drop_path1.p == pytest.approx(0.1)  # the paper's stochastic depth


def test_no_masked_image_modelling_and_wrong_image_size_is_explained():
    # mask_token=True (what a SimMIM wrapper passes) builds the plain model; supports_mim says no.
    model = create_model("levit_debug", mask_token=True)
    assert not model.supports_mim and not hasattr(model, "forward_mim")
    assert not any("mask_token" in n for n, _ in model.named_parameters())
    model = create_model("levit_debug").eval()
    with pytest.raises(ValueError, match="img_size=64"):
        model(torch.randn(1, 3, 64, 64))
