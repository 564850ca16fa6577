"""One-pass LayerNorm backward (``ops/triton/layer_norm.py``) and ``ops/layer_norm.fork``.

CPU: the kernels in Triton's interpreter (set before the kernel module is imported when no GPU is
present). GPU: Hiera-B widths and row counts, bf16 and fp32, skipped without CUDA.

Each check gives ATen's ``native_layer_norm_backward`` (plus the residual gradient, added in fp64)
and the kernel the same saved tensors and the same upstream gradients, and compares dx, dw and db
with per-dtype tolerances: normwise relative error against an fp64 reference, then elementwise.
"""

from __future__ import annotations

import pytest
import torch
from conftest import triton_marks

from hiera_autopatch.ops.triton import layer_norm as tln

_INTERPRETED, cpu_only, gpu_only = triton_marks(tln, tln._layer_norm_bwd_kernel)

# dtype -> (max normwise relative error, atol, rtol); bf16/fp16 outputs round once (ours) or twice
TOLERANCES = {
    torch.float32: (1e-5, 1e-5, 1e-4),
    torch.float16: (2e-3, 5e-3, 1e-2),
    torch.bfloat16: (1e-2, 3e-2, 5e-2),
}


def assert_close(name, actual, expected, dtype, aten=None):
    """Normwise relative error under the dtype's bound, then elementwise allclose. ``aten``: ATen's
    own result in this dtype; sums over many rows (dw, db) then may be off by up to 4x ATen's own
    error (normwise, and elementwise in absolute terms) beside the dtype's bound."""
    max_rel, atol, rtol = TOLERANCES[dtype]
    actual, expected = actual.double().cpu(), expected.double().cpu()
    if aten is not None:
        aten = aten.double().cpu()
        max_rel = max(max_rel, 4 * float((aten - expected).norm() / expected.norm().clamp_min(1e-30)))
        atol = max(atol, 4 * float((aten - expected).abs().max()))
    rel = float((actual - expected).norm() / expected.norm().clamp_min(1e-30))
    assert rel <= max_rel, f"{name}: normwise relative error {rel:.3g} > {max_rel:g}"
    bad = ~torch.isclose(actual, expected, atol=atol, rtol=rtol)
    assert not bad.any(), f"{name}: {int(bad.sum())} of {bad.numel()} elements differ, first at " \
                          f"{bad.nonzero()[:3].tolist()}"


def saved_forward(rows, width, dtype, device, seed=0):
    """x, weight, bias and what native_layer_norm saves (mean, rstd), and upstream gradients."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, width, generator=g) * 2 + 0.5).to(device, dtype)
    weight = (1 + 0.3 * torch.randn(width, generator=g)).to(device, dtype)
    bias = (0.1 * torch.randn(width, generator=g)).to(device, dtype)
    dy = torch.randn(rows, width, generator=g).to(device, dtype)
    d_res = torch.randn(rows, width, generator=g).to(device, dtype)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, (width,), weight, bias, 1e-6)
    return x, weight, bias, dy, d_res, mean, rstd


def reference(x, weight, bias, dy, d_res, mean, rstd):
    """fp64 ATen backward of the same forward (mean/rstd recomputed in fp64), residual added."""
    x64, w64, b64, dy64 = (t.double() for t in (x, weight, bias, dy))
    _, mean64, rstd64 = torch.ops.aten.native_layer_norm(x64, (x.shape[-1],), w64, b64, 1e-6)
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(
        dy64, x64, (x.shape[-1],), mean64, rstd64, w64, b64, [True, True, True])
    if d_res is not None:
        dx = dx + d_res.double()
    return dx, dw, db


def check(rows, width, dtype, device, residual=True):
    x, weight, bias, dy, d_res, mean, rstd = saved_forward(rows, width, dtype, device)
    d_res = d_res if residual else None
    dx, dw, db = tln.layer_norm_backward(dy, x, mean, rstd, weight, d_res)
    assert dx.dtype == dtype and dx.shape == x.shape and dw.dtype == db.dtype == weight.dtype
    ref = reference(x, weight, bias, dy, d_res, mean, rstd)
    aten = torch.ops.aten.native_layer_norm_backward(dy, x, (width,), mean, rstd, weight, bias,
                                                      [True, True, True])
    assert_close("dx", dx, ref[0], dtype)
    assert_close("dw", dw, ref[1], dtype, aten=aten[1])
    assert_close("db", db, ref[2], dtype, aten=aten[2])
    # and ATen's own input gradient in this dtype meets the same bound (the bound is fair)
    assert_close("ATen dx", aten[0] if d_res is None else aten[0] + d_res, ref[0], dtype)
    # dx_sum: the same dx, dw, db, and the column sums of dx as stored (the bias gradient that
    # autograd would take as dx.sum(0) in dx's dtype)
    dx2, dw2, db2, ds = tln.layer_norm_backward(dy, x, mean, rstd, weight, d_res, dx_sum=True)
    assert torch.equal(dx2, dx) and torch.equal(dw2, dw) and torch.equal(db2, db)
    assert ds.dtype == dtype and ds.shape == (width,)
    assert_close("ds", ds, dx.double().sum(0), dtype, aten=dx.sum(0))


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rows,width", [(37, 96), (130, 72), (8, 256), (1, 40)])
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "no-residual"])
@pytest.mark.parametrize("acc_2d", [True, False], ids=["row-slot-sums", "step-sums"])
def test_cpu_backward_matches_aten(monkeypatch, rows, width, dtype, residual, acc_2d):
    """Odd row counts (a partial last step, programs with fewer rows) and non-power-of-2 widths,
    with either way of keeping the weight-gradient sums."""
    monkeypatch.setattr(tln, "LAUNCH", tln.Launch(acc_2d=acc_2d))
    check(rows, width, dtype, "cpu", residual)


@cpu_only
@pytest.mark.parametrize("rows,width", [(37, 96), (130, 72), (8, 256), (1, 40)])
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "no-residual"])
@pytest.mark.parametrize("launch", ["2x4096x2p", "2x4096x1p"])
def test_cpu_prefetching_backward_matches_aten(monkeypatch, rows, width, residual, launch):
    """Each step's tiles loaded one step ahead: programs of one step, of several, and a last step
    past the end of the rows (its prefetch fully masked)."""
    monkeypatch.setattr(tln, "LAUNCH", tln.Launch.parse(launch))
    check(rows, width, torch.float32, "cpu", residual)


@cpu_only
@pytest.mark.parametrize("rows,width", [(37, 96), (130, 72)])
def test_cpu_launch_by_width_is_used_and_matches_aten(monkeypatch, rows, width):
    """``LAUNCH_BY_WIDTH``: rows of a listed width take that launch (the kernel's tile and prefetch
    follow it), others ``LAUNCH``; both match ATen. ``BEST_BY_WIDTH`` as shipped (session 32); it
    parses back to its own text."""
    assert tln.LAUNCH_BY_WIDTH == tln.BEST_BY_WIDTH and tln.LAUNCH_BY_WIDTH is not tln.BEST_BY_WIDTH
    other = tln.Launch.parse("4x1024x2x8p")
    monkeypatch.setattr(tln, "LAUNCH_BY_WIDTH", {width: other})
    assert tln.launch_for(width) is other and tln.launch_for(width + 1) is tln.LAUNCH
    check(rows, width, torch.float32, "cpu", True)
    for launch in tln.BEST_BY_WIDTH.values():
        assert tln.Launch.parse(str(launch)) == launch


@gpu_only
@pytest.mark.parametrize("launch", ["2x4096x2", "4x2048x2p", "4x2048x2x8p", "by_width"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rows,width", [(128 * 1248, 96), (128 * 312, 192), (128 * 76, 384),
                                        (128 * 19, 768), (128 * 196, 512), (1000, 4096), (3, 56)])
def test_gpu_backward_matches_aten(monkeypatch, rows, width, dtype, launch):
    """Hiera-B MAE's LayerNorms at batch 128 (stages 1-4, decoder), the widest row, a tiny one; the
    shipped launch, two prefetching ones, and ``BEST_BY_WIDTH``'s per width."""
    if launch == "by_width":
        monkeypatch.setattr(tln, "LAUNCH_BY_WIDTH", dict(tln.BEST_BY_WIDTH))
    else:
        monkeypatch.setattr(tln, "LAUNCH", tln.Launch.parse(launch))
    check(rows, width, dtype, "cuda")


def test_kernels_fit_hopper_registers(tmp_path):
    """scripts/check_layer_norm_registers.py compiles both row-loop kernels for sm_90 with Triton's
    compiler and ptxas, no GPU needed: the shipped launches, with and without the dx sums, fit an
    SM's registers at least twice (two programs an SM, as launched), and the report names them;
    the prefetching 4x2048x2x8p and GELU's 2048x128x4p hold two steps' tiles without spilling."""
    pytest.importorskip("triton")
    import json

    from conftest import REPO, run_python, triton_marks

    out = tmp_path / "regs.json"
    run = run_python([str(REPO / "scripts" / "check_layer_norm_registers.py"), "--shapes", "stage3,decoder",
                      "--variants", f"{tln.LAUNCH},4x2048x2x8p", "--gelu", "4096x128x4,2048x128x4p", "--json", str(out)],
                     env={"TRITON_INTERPRET": None, "PYTHONPATH": str(REPO)}, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert report["shipped"] == "2x4096x2" and report["gelu_shipped"] == "4096x128x4"
    for name in ("stage3", "decoder"):
        for key in ("2x4096x2", "2x4096x2+dx_sum"):
            use = report["shapes"][name][key]
            assert 0 < use["registers"] <= 255 and use["programs_per_sm_by_registers"] >= 2, (name, key, use)
        for key in ("4x2048x2x8p", "4x2048x2x8p+dx_sum"):
            assert report["shapes"][name][key]["spill_store_bytes"] == 0, (name, key)
        assert 0 < report["gelu"][name]["4096x128x4"]["registers"] <= 255
        assert report["gelu"][name]["2048x128x4p"]["spill_store_bytes"] == 0


def test_supports_declines_what_it_cannot_take():
    x = torch.randn(4, 8)
    assert not tln.supports(x, None)
    assert not tln.supports(x, torch.ones(9))
    assert not tln.supports(torch.randn(4, tln.MAX_WIDTH + 1), torch.ones(tln.MAX_WIDTH + 1))
    assert not tln.supports(x.to(torch.int32), torch.ones(8))


# --- the block: fork under torch.compile -------------------------------------------------------


@pytest.fixture
def fused_ln(monkeypatch):
    """``layer_norm.fused_backward`` on for the test; the list counts the kernel's calls."""
    from hiera_autopatch.ops import layer_norm

    monkeypatch.setattr(layer_norm, "fused_backward", True)
    calls = []
    original = tln.layer_norm_backward

    def counted(*args, **kwargs):
        calls.append((args[1].shape, kwargs.get("dx_sum", False)))
        return original(*args, **kwargs)

    monkeypatch.setattr(tln, "layer_norm_backward", counted)
    yield calls
    torch._dynamo.reset()


@cpu_only
def test_cpu_fork_gradients_match_plain_autograd(fused_ln):
    """Two residual blocks ``x + lin(norm(x))`` through ``fork`` under Inductor (CPU), one norm
    whose residual output goes unused: output, input grad and every weight grad as eager's."""
    from equivalence import outputs_and_grads

    from hiera_autopatch.ops import layer_norm

    torch.manual_seed(0)
    norm, lin = torch.nn.LayerNorm(24), torch.nn.Linear(24, 24)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()

    def blocks(x, fork):
        x_res, x_norm = fork(norm, x)
        x = x_res + lin(x_norm)
        _, x_norm = fork(norm, x)  # residual output unused (as a pooling block's)
        return lin(x_norm)

    x = torch.randn(3, 10, 24)
    upstream = torch.randn(3, 10, 24)
    results = outputs_and_grads((lambda x: blocks(x, lambda n, t: (t, n(t))),
                                 torch.compile(lambda x: blocks(x, layer_norm.fork), fullgraph=True)),
                                x, (norm, lin), upstream)
    assert len(fused_ln) == 2
    names = ["out", "dx", "norm.weight", "norm.bias", "lin.weight", "lin.bias"]
    for name, actual, expected in zip(names, results[1], results[0]):
        assert_close(name, actual, expected, torch.float32)


@cpu_only
def test_cpu_mae_with_fused_layer_norm_matches_fair(fused_ln):
    """FAIR's MAE (tiny) compiled by Inductor with every block norm through ``fork``: every output
    and gradient matches FAIR's eager run. ``fallback_random``: the mask from eager's RNG."""
    pytest.importorskip("hiera")
    from equivalence import assert_equivalent, fair_vs_compiled_tiny_mae

    model, fair, compiled = fair_vs_compiled_tiny_mae()
    assert_equivalent(fair, compiled, 1e-5, 1e-4)
    blocks = sum(1 for m in model.modules() if type(m).__name__ == "HieraBlock")
    assert len(fused_ln) == 2 * blocks


@cpu_only
def test_cpu_mae_with_folded_bias_sums_matches_fair(fused_ln):
    """The graphed step's post-grad pass (``layer_norm.fold_dx_sums``) on FAIR's tiny MAE under
    Inductor: some bias gradients come from the kernel's dx sums, and every output and gradient
    still matches FAIR's eager run."""
    pytest.importorskip("hiera")
    from equivalence import assert_equivalent, fair_vs_compiled_tiny_mae
    from hiera_autopatch.ops import layer_norm

    model, fair, compiled = fair_vs_compiled_tiny_mae({"post_grad_custom_post_pass": layer_norm.dx_sums_pass()})
    assert_equivalent(fair, compiled, 1e-5, 1e-4)
    blocks = sum(1 for m in model.modules() if type(m).__name__ == "HieraBlock")
    assert len(fused_ln) == 2 * blocks
    # the kernel took at least the proj bias of each block (the sum of norm2's dx)
    assert sum(dx_sum for _, dx_sum in fused_ln) >= blocks


def test_fork_is_plain_outside_compile(fused_ln):
    """Eager (not compiling): ``(x, norm(x))`` itself, no Function."""
    from hiera_autopatch.ops import layer_norm

    norm = torch.nn.LayerNorm(8)
    x = torch.randn(2, 8, requires_grad=True)
    x_res, y = layer_norm.fork(norm, x)
    assert x_res is x and torch.equal(y, norm(x))
    assert y.grad_fn.name() != "ForkLayerNormBackward"


def test_launch_text_parses_and_names_back():
    """``Launch``'s text (scripts/bench_layer_norm.py's variants, profile_step.py's --ln-variant):
    the sums kind and warps optional (None: the launcher's warps rule)."""
    parse = tln.Launch.parse
    assert parse("2x4096") == tln.Launch(2, 4096, True, None)
    assert parse("2x4096x1") == tln.Launch(2, 4096, False, None)
    assert parse("4x2048x2x8") == tln.Launch(4, 2048, True, 8)
    assert parse("4x2048x2x8p") == tln.Launch(4, 2048, True, 8, prefetch=True)
    for text in ("4x2048x2x8", "2x4096x1", "2x4096x2p", "4x2048x2x8p"):
        assert str(parse(text)) == text
    assert str(tln.LAUNCH) == "2x4096x2" and not tln.LAUNCH.prefetch
    assert tln.LAUNCH.warps(8, 512) == 4 and tln.LAUNCH.warps(16, 512) == 8
    for bad in ("2", "2x4096x3", "2xabc", "2x4096@2", "2x4096x2x8x1", "0x4096", "p", "2x4096pp"):
        with pytest.raises(ValueError):
            parse(bad)
    from hiera_autopatch.ops.triton import gelu as tgelu

    assert str(tgelu.Launch.parse("8192x256x8")) == "8192x256x8" and str(tgelu.LAUNCH) == "4096x128x4"
    assert tgelu.Launch.parse("2048x64x4p") == tgelu.Launch(2048, 64, 4, prefetch=True) and not tgelu.LAUNCH.prefetch
    assert str(tgelu.Launch.parse("2048x64x4p")) == "2048x64x4p"
    for bad in ("4096x128", "4096x128x4x1", "4096x128x4@2", "4096x128x4pp"):
        with pytest.raises(ValueError):
            tgelu.Launch.parse(bad)


