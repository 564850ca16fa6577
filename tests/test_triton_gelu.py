"""GELU backward with fc1's bias gradient (``ops/triton/gelu.py``) and ``ops/mlp.GeluMlp`` using it.

CPU: the kernels in Triton's interpreter (set before the kernel module is imported when no GPU is
present). GPU: Hiera-B's MLP widths and row counts, bf16 and fp32, skipped without CUDA.

Each check gives ATen (``gelu``, ``gelu_backward``, ``sum``) and the kernel the same fc1 output and
upstream gradient and compares GELU's output, its input gradient and the bias gradient against an
fp64 reference with per-dtype tolerances (``test_triton_layer_norm.assert_close``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import triton_marks
from test_triton_layer_norm import assert_close

from hiera_autopatch.ops.triton import gelu as tgelu

_INTERPRETED, cpu_only, gpu_only = triton_marks(tgelu, tgelu._gelu_bwd_bias_kernel)


def check(rows, width, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(rows, width, generator=g) * 2).to(device, dtype)  # fc1's output
    d_act = torch.randn(rows, width, generator=g).to(device, dtype)  # GELU's output gradient
    act, dh, db = tgelu.gelu_backward_bias(d_act, h)
    assert act.dtype == dh.dtype == db.dtype == dtype
    assert act.shape == dh.shape == h.shape and db.shape == (width,)
    h64, d_act64 = h.double(), d_act.double()
    assert_close("act", act, F.gelu(h64), dtype)
    assert_close("ATen act", F.gelu(h), F.gelu(h64), dtype)  # the bound is fair
    assert_close("dh", dh, torch.ops.aten.gelu_backward(d_act64, h64), dtype)
    assert_close("ATen dh", torch.ops.aten.gelu_backward(d_act, h), torch.ops.aten.gelu_backward(d_act64, h64), dtype)
    # the bias gradient is autograd's sum of the stored dh: against its fp64 sum
    assert_close("db", db, dh.double().sum(0), dtype, aten=dh.sum(0))
    # without GELU's output (a forward kept it): the same gradients, bit for bit, and no act
    no_act, dh_only, db_only = tgelu.gelu_backward_bias(d_act, h, store_act=False)
    assert no_act is None
    assert torch.equal(dh_only, dh) and torch.equal(db_only, db)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rows,width", [(37, 96), (130, 384), (300, 40), (1, 600), (70, 512)])
def test_cpu_kernel_matches_aten(rows, width, dtype):
    """Partial last row tiles, programs with several tiles, 128-column tiles (384), a width under a
    tile (40) and one that leaves a partial column tile (600)."""
    check(rows, width, dtype, "cpu")


@cpu_only
@pytest.mark.parametrize("rows,width", [(37, 96), (130, 384), (300, 40), (1, 600), (70, 512)])
@pytest.mark.parametrize("launch", ["4096x128x4p", "2048x64x4p"])
def test_cpu_prefetching_kernel_matches_aten(monkeypatch, rows, width, launch):
    """Each row tile's inputs loaded one tile ahead: programs of one tile, of several, and a last
    prefetch past the rows (fully masked)."""
    monkeypatch.setattr(tgelu, "LAUNCH", tgelu.Launch.parse(launch))
    monkeypatch.setattr(tgelu, "LAUNCH_BY_WIDTH", {})  # its launches would override LAUNCH at 384
    check(rows, width, torch.float32, "cpu")


@gpu_only
@pytest.mark.parametrize("launch", ["shipped", "4096x128x4", "2048x128x4p"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rows,width", [(128 * 1216, 384), (128 * 304, 768), (128 * 76, 1536),
                                        (128 * 19, 3072), (128 * 196, 2048), (3, 56)])
def test_gpu_kernel_matches_aten(monkeypatch, rows, width, dtype, launch):
    """Hiera-B MAE's MLPs at batch 128 (stages 1-4 at mask 0.6, decoder) and a tiny one; the shipped
    launches (``LAUNCH_BY_WIDTH``'s for Hiera's widths), one launch for every width, a prefetching one."""
    if launch != "shipped":
        monkeypatch.setattr(tgelu, "LAUNCH", tgelu.Launch.parse(launch))
        monkeypatch.setattr(tgelu, "LAUNCH_BY_WIDTH", {})
    check(rows, width, dtype, "cuda")


@cpu_only
@pytest.mark.parametrize("rows,width", [(37, 96), (130, 384), (70, 512)])
def test_cpu_launch_by_width_is_used_and_matches_aten(monkeypatch, rows, width):
    """``LAUNCH_BY_WIDTH``: rows of a listed width take that launch (its tile), others ``LAUNCH``;
    both match ATen. The shipped table is ``BEST_BY_WIDTH``, which parses back to its own text."""
    assert tgelu.LAUNCH_BY_WIDTH == tgelu.BEST_BY_WIDTH
    other = tgelu.Launch.parse("1024x64x4p")
    monkeypatch.setattr(tgelu, "LAUNCH_BY_WIDTH", {width: other})
    assert tgelu.launch_for(width) is other and tgelu.launch_for(width + 1) is tgelu.LAUNCH
    assert tgelu.tile(width) == tgelu.tile(width, other) != tgelu.tile(width, tgelu.LAUNCH)
    check(rows, width, torch.float32, "cpu")
    for launch in tgelu.BEST_BY_WIDTH.values():
        assert tgelu.Launch.parse(str(launch)) == launch


def test_tiles_cover_hiera_widths():
    launch = tgelu.LAUNCH
    t = launch.tile_elements
    assert tgelu.tile(384, launch) == (t // 128, 128)  # 3 full column tiles, not 2 with one half empty
    assert tgelu.tile(2048, launch) == (t // 256, 256)
    assert tgelu.tile(40) == (t // 64, 64)
    assert tgelu.tile(2048) == (tgelu.BEST_BY_WIDTH[2048].tile_elements // 256, 256)  # the shipped table's
    assert not tgelu.supports(torch.zeros(0, 8))
    assert not tgelu.supports(torch.ones(2, 8, dtype=torch.int32))


@pytest.fixture
def gelu_calls(monkeypatch):
    """``mlp.fused_gelu_backward`` on; the list records each kernel call's fc1-output shape."""
    from hiera_autopatch.ops import mlp

    monkeypatch.setattr(mlp, "fused_gelu_backward", True)
    calls = []
    original = tgelu.gelu_backward_bias

    def counted(d_act, h, store_act=True):
        calls.append(tuple(h.shape) if store_act else ("kept act", *h.shape))
        return original(d_act, h, store_act)

    monkeypatch.setattr(tgelu, "gelu_backward_bias", counted)
    yield calls
    torch._dynamo.reset()


@cpu_only
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("keep_act", [False, True], ids=["recompute", "keep-act"])
def test_cpu_gelu_mlp_gradients_match_plain_autograd(monkeypatch, gelu_calls, bias, keep_act):
    """timm's Mlp shape ``fc2(gelu(fc1(x)))`` through ``GeluMlp`` under Inductor (CPU): output,
    input grad and every weight grad as plain eager autograd's; the kernel only with a bias, and
    without writing GELU's output where the forward kept it (``keep_act_widths``)."""
    from equivalence import eager_and_compiled_gelu_mlp

    from hiera_autopatch.ops import mlp

    monkeypatch.setattr(mlp, "keep_act_widths", frozenset({96} if keep_act else ()))
    eager, compiled = eager_and_compiled_gelu_mlp(bias)
    assert gelu_calls == ([("kept act", 3, 10, 96) if keep_act else (3, 10, 96)] if bias else [])
    for i, (actual, expected) in enumerate(zip(compiled, eager)):
        assert_close(f"tensor {i}", actual, expected, torch.float32)


@cpu_only
def test_cpu_mae_with_fused_gelu_backward_matches_fair(gelu_calls):
    """FAIR's MAE (tiny) compiled by Inductor: every block MLP's backward through the kernel, and
    every output and gradient matches FAIR's eager run."""
    pytest.importorskip("hiera")
    from equivalence import assert_equivalent, fair_vs_compiled_tiny_mae

    model, fair, compiled = fair_vs_compiled_tiny_mae()
    assert_equivalent(fair, compiled, 1e-5, 1e-4)
    blocks = sum(1 for m in model.modules() if type(m).__name__ == "HieraBlock")
    assert len(gelu_calls) == blocks
