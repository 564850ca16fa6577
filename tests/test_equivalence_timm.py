"""timm's timm.models.hiera: patched vs unpatched on the same inputs and RNG state."""

import pytest
import torch

import hiera_autopatch
from equivalence import assert_equivalent, low_precision_check, run_pair, tied_tokens

timm = pytest.importorskip("timm")
timm_hiera = pytest.importorskip("timm.models.hiera")

FP32_OUT, FP32_GRAD = 1e-5, 1e-4


@pytest.fixture(autouse=True)
def patched():
    hiera_autopatch.enable()
    yield
    hiera_autopatch.disable()


def timm_model(name: str, width: int = 8, img_size=(128, 128), **kwargs):
    """A timm Hiera with the real stage structure and widths shrunk to `width * heads`."""
    heads = {"hiera_base_plus_224": 2, "hiera_large_224": 2, "hiera_huge_224": 4}.get(name, 1)
    kwargs.setdefault("embed_dim", width * heads)
    if "abswin" in name:
        kwargs.setdefault("global_pos_size", (8, 8))
    return timm.create_model(name, pretrained=False, img_size=img_size, num_classes=10, **kwargs)


def batch(model, n=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 128, 128, generator=generator)


def test_all_timm_patches_applied():
    report = hiera_autopatch.status()["targets"]["timm.models.hiera"]
    assert sorted(report["applied"]) == ["timm.attention", "timm.forward_features", "timm.forward_intermediates"]


@pytest.mark.parametrize(
    "name",
    ["hiera_tiny_224", "hiera_small_224", "hiera_base_plus_224", "hiera_huge_224", "hiera_small_abswin_256"],
)
@pytest.mark.parametrize("train", [True, False])
def test_forward_fp32(name, train):
    torch.manual_seed(0)
    model = timm_model(name).train(train)
    unpatched, patched = run_pair(model, batch(model), lambda m, x: m(x))
    assert_equivalent(unpatched, patched, FP32_OUT, FP32_GRAD)


@pytest.mark.parametrize("q_pool", [1, 2, 3])
def test_forward_features_with_mask_and_intermediates(q_pool):
    torch.manual_seed(0)
    model = timm_model("hiera_small_224", q_pool=q_pool)
    x = batch(model, 3)
    mask = model.get_random_mask(x, mask_ratio=0.6)

    def call(m, x):
        return m.forward_features(x, mask=mask, return_intermediates=True)

    unpatched, patched = run_pair(model, x, call)
    assert_equivalent(unpatched, patched, FP32_OUT, FP32_GRAD)


@pytest.mark.parametrize("masked", [False, True])
def test_forward_intermediates(masked):
    torch.manual_seed(0)
    model = timm_model("hiera_tiny_224")
    x = batch(model, 2)
    mask = model.get_random_mask(x, mask_ratio=0.5) if masked else None
    fmt = "NHWC" if masked else "NCHW"  # a masked reroll keeps mask-unit layout; NCHW is for maps

    def call(m, x):
        return m.forward_intermediates(x, mask=mask, output_fmt=fmt)

    unpatched, patched = run_pair(model, x, call)
    assert_equivalent(unpatched, patched, FP32_OUT, FP32_GRAD)


@pytest.mark.parametrize("rate", [0.25, 0.5])
def test_patch_drop_rate_training(rate):
    torch.manual_seed(0)
    model = timm_model("hiera_small_224", patch_drop_rate=rate).train()
    unpatched, patched = run_pair(model, batch(model, 3), lambda m, x: m(x))
    assert_equivalent(unpatched, patched, FP32_OUT, FP32_GRAD)


def test_fused_attn_off_keeps_timm_math_path():
    model = timm_model("hiera_tiny_224")
    attn = model.blocks[0].attn
    attn.fused_attn = False
    x = torch.randn(2, attn.window_size * 16, attn.dim)
    with hiera_autopatch.disabled():
        expected = attn(x)
    assert torch.equal(attn(x), expected)  # bit-identical: the same code ran


def test_q_pool_amax_ties_split_gradient_like_timm():
    """timm pools with amax: on tied values the gradient is split, and we keep that. The input
    gradient shows it (max would send each tie's whole gradient to its first slot)."""
    torch.manual_seed(0)
    model = timm_model("hiera_tiny_224")
    attn = next(b.attn for b in model.blocks if b.attn.q_stride > 1 and b.attn.use_mask_unit_attn)
    unpatched, patched = run_pair(model, tied_tokens(attn), lambda m, x: attn(x))
    assert_equivalent(unpatched, patched, FP32_OUT, FP32_GRAD)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_bounded(dtype):
    torch.manual_seed(0)
    model = timm_model("hiera_base_plus_224").train()
    eps = {torch.bfloat16: 0.05, torch.float16: 0.01}[dtype]
    low_precision_check(model, batch(model), lambda m, x: m(x), dtype=dtype, eps=eps)
