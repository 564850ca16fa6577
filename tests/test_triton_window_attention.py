"""Triton mask-unit attention vs FAIR's ops (``window_attention_reference``).

CPU: runs the kernels in Triton's interpreter (TRITON_INTERPRET=1, set here before the kernel
module is imported when no GPU is present), tiny shapes, fp32 and fp16. bf16 is GPU-only: the
interpreter's bf16 ``tl.dot`` returns garbage (triton 3.8, checked on a 16x16 product).
GPU: the real Hiera-B shapes, bf16 and fp32, skipped without CUDA.

Every comparison gives reference and kernel the same input and the same upstream gradient, and
checks the output and dqkv with per-dtype tolerances (normwise relative error vs a float64
reference, plus an elementwise allclose that reports where it fails).
"""

from __future__ import annotations

import pytest
import torch
from conftest import REPO, import_script, run_python, triton_marks

from hiera_autopatch.ops.triton import window_attention as wa

_INTERPRETED, cpu_only, gpu_only = triton_marks(wa, wa._window_attention_fwd_kernel)


def test_cpu_kernels_are_interpreted_without_a_gpu():
    """Without a GPU the CPU tests below must run, not skip (conftest.py sets the interpreter)."""
    if torch.cuda.is_available() or not wa.HAS_TRITON:
        pytest.skip("a GPU is present, or triton is not installed")
    assert _INTERPRETED


# dtype -> (max normwise relative error, atol, rtol) for the elementwise check
TOLERANCES = {
    torch.float32: (2e-5, 2e-5, 2e-5),
    torch.float16: (2e-3, 5e-3, 1e-2),
    torch.bfloat16: (1e-2, 3e-2, 5e-2),
}


def assert_close_verbose(name, actual, expected, dtype):
    """Normwise relative error under the dtype's bound, then elementwise allclose; on failure say
    how many elements mismatch and where the first ones are."""
    max_rel, atol, rtol = TOLERANCES[dtype]
    actual = actual.detach().double()
    expected = expected.detach().double()
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    assert torch.isfinite(actual).all(), f"{name}: non-finite values (unwritten or NaN)"
    rel = ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()
    bad = ~torch.isclose(actual, expected, atol=atol, rtol=rtol)
    if rel > max_rel or bad.any():
        idx = bad.nonzero()[:5].tolist()
        pairs = [(i, actual[tuple(i)].item(), expected[tuple(i)].item()) for i in idx]
        raise AssertionError(
            f"{name} ({dtype}): rel err {rel:.3e} (max {max_rel:.0e}); {int(bad.sum())} of "
            f"{bad.numel()} elements outside atol={atol}, rtol={rtol}; first (index, got, want): "
            f"{pairs}"
        )


def make_qkv(B, nw, T, H, D, dtype, device, ties=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T * nw, 3 * H * D, generator=g)
    if ties:
        x = (x * 2).round() / 2  # values on a 0.5 grid: many exact ties inside each pool window
    return x.to(dtype=dtype, device=device)


def run_both(qkv, nw, H, S, pool, config=None, seed=1):
    """Kernel (in qkv's dtype) and float64 reference on the same input and upstream grad."""
    x = qkv.detach().clone().requires_grad_(True)
    out = wa.window_attention(x, nw, H, S, pool, config)
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=g).to(out.dtype).to(out.device)
    (dqkv,) = torch.autograd.grad(out, x, dout)

    xr = qkv.detach().double().requires_grad_(True)
    ref = wa.window_attention_reference(xr, nw, H, S, pool)
    (dref,) = torch.autograd.grad(ref, xr, dout.double())
    return out, dqkv, ref, dref


# (B, nw, T, H, D, S, config): odd head dims, pooled and unpooled, global (nw=1), partial groups,
# windows spread over several key/query blocks (exercises the dq kernel and block skipping).
CPU_CASES = [
    pytest.param(2, 3, 16, 2, 24, 1, None, id="nw3-T16-H2-D24"),
    pytest.param(2, 3, 16, 2, 24, 4, None, id="nw3-T16-S4-H2-D24"),
    pytest.param(1, 5, 16, 1, 40, 1, None, id="nw5-partial-group-D40"),
    pytest.param(1, 2, 64, 1, 40, 4, None, id="nw2-T64-S4-D40"),
    pytest.param(1, 1, 40, 2, 24, 1, None, id="global-T40"),
    pytest.param(1, 1, 40, 1, 40, 1, {"BLOCK_M": 16, "BLOCK_N": 16}, id="global-T40-multiblock"),
    pytest.param(1, 1, 32, 1, 24, 4, {"BLOCK_M": 16, "BLOCK_N": 16}, id="global-T32-S4-multiblock"),
    pytest.param(1, 3, 16, 1, 24, 4, {"G": 2, "BLOCK_M": 16, "BLOCK_N": 16},
                 id="G2-groups-span-blocks"),
    pytest.param(2, 2, 32, 2, 24, 2, {"BLOCK_M": 16, "BLOCK_N": 16}, id="B2-H2-nw2-multiblock"),
    # the MAE decoder's shape with its tuned blocks (TUNED is for 2-byte dtypes: given explicitly)
    pytest.param(1, 1, 196, 2, 32, 1, wa.TUNED[(196, 1, 32)], id="decoder-T196-D32-tuned"),
    # the q-pooled stage 2/3 windows with their tuned blocks: a forward over two 32-key blocks per
    # window, a one-pass backward; stage 3's 4 windows a program, the last group partial
    pytest.param(1, 2, 64, 1, 96, 4, wa.TUNED[(64, 4, 96)], id="stage2-pool-T64-S4-D96-tuned"),
    pytest.param(1, 5, 16, 1, 96, 4, wa.TUNED[(16, 4, 96)], id="stage3-pool-T16-S4-D96-tuned"),
    # stage 3's global attention, fp32's 64-key blocks (its bf16 128x128 tile needs no masking)
    pytest.param(1, 1, 76, 1, 96, 1, None, id="stage3-global-T76-D96"),
    # forward and backward tiled differently: multi-block forward, one-pass (single key block)
    # backward, and the other way round
    pytest.param(1, 1, 40, 2, 24, 4, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_M_BWD": 16, "BLOCK_N_BWD": 64},
                 id="fwd-multiblock-bwd-onepass"),
    pytest.param(1, 3, 16, 1, 24, 1, {"BLOCK_M_BWD": 16, "BLOCK_N_BWD": 16, "num_stages_bwd": 1},
                 id="fwd-onepass-bwd-multiblock"),
]


@cpu_only
@pytest.mark.parametrize("B,nw,T,H,D,S,config", CPU_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_cpu_matches_reference(B, nw, T, H, D, S, config, dtype):
    if dtype == torch.float16 and config is not None:
        pytest.skip("block-layout variants are covered in fp32")
    qkv = make_qkv(B, nw, T, H, D, dtype, "cpu")
    out, dqkv, ref, dref = run_both(qkv, nw, H, S, "max", config)
    assert out.dtype == dtype and dqkv.dtype == dtype
    assert_close_verbose("out", out, ref, dtype)
    assert_close_verbose("dqkv", dqkv, dref, dtype)


@cpu_only
@pytest.mark.parametrize("pool", ["max", "amax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_cpu_pool_ties(pool, dtype):
    """Quantised q: ties in every pool window. "max" sends dq to the first maximal slot (torch's
    max(dim).values backward), "amax" splits it; each must match its own mode and differ from
    the other's (so the check can fail)."""
    B, nw, T, H, D, S = 1, 3, 16, 2, 24, 4
    qkv = make_qkv(B, nw, T, H, D, dtype, "cpu", ties=True)
    out, dqkv, ref, dref = run_both(qkv, nw, H, S, pool)
    assert_close_verbose("out", out, ref, dtype)
    assert_close_verbose("dqkv", dqkv, dref, dtype)

    other = "amax" if pool == "max" else "max"
    xr = qkv.detach().double().requires_grad_(True)
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(out.shape, generator=g).to(dtype).double()
    (d_other,) = torch.autograd.grad(wa.window_attention_reference(xr, nw, H, S, other), xr, dout)
    rel = ((dqkv.double() - d_other).norm() / d_other.norm()).item()
    assert rel > 1e-2, f"test has no ties: {pool} and {other} gradients agree (rel {rel:.1e})"


@cpu_only
def test_cpu_every_element_written():
    """Poisoned (NaN) output buffers: the launchers must overwrite every element."""
    B, nw, T, H, D, S = 1, 3, 16, 2, 24, 4
    qkv = make_qkv(B, nw, T, H, D, torch.float32, "cpu")
    out = torch.full((B, T // S * nw, H * D), float("nan"))
    out, lse = wa.window_attention_forward(qkv, nw, H, S, out=out)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    dout = torch.randn_like(out)
    dqkv = torch.full_like(qkv, float("nan"))
    for config in (None, {"BLOCK_M": 16, "BLOCK_N": 16, "G": 2}):
        dqkv.fill_(float("nan"))
        wa.window_attention_backward(dout, qkv, out, lse, nw, H, S, "max", config, dqkv=dqkv)
        assert torch.isfinite(dqkv).all(), config
    # q slots that lose the max get exactly zero gradient: 3 of the 4 pool slots per (tq, d)
    q_grad = dqkv.view(B, T, nw, 3, H, D)[:, :, :, 0]
    assert (q_grad == 0).float().mean().item() >= 0.74


BIAS_CASES = [case for case in CPU_CASES if case.id in (
    "nw3-T16-S4-H2-D24", "nw5-partial-group-D40", "global-T40-multiblock", "global-T32-S4-multiblock",
    "G2-groups-span-blocks", "decoder-T196-D32-tuned", "stage3-pool-T16-S4-D96-tuned",
    "fwd-onepass-bwd-multiblock")]


@cpu_only
@pytest.mark.parametrize("B,nw,T,H,D,S,config", BIAS_CASES)
@pytest.mark.parametrize("pool", ["max", "amax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_cpu_bias_gradient_from_the_kernels(B, nw, T, H, D, S, config, pool, dtype):
    """``window_attention(qkv + bias.detach(), bias=bias)``: the bias's gradient is dqkv summed
    over rows, from the kernels' partial sums (one-pass and dk/dv + dq grids, pooled ties too)."""
    qkv = make_qkv(B, nw, T, H, D, dtype, "cpu", ties=S > 1).requires_grad_(True)
    bias = torch.randn(3 * H * D, generator=torch.Generator().manual_seed(2)).to(dtype).requires_grad_(True)
    out = wa.window_attention(qkv, nw, H, S, pool, config, bias=bias)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    dqkv, dbias = torch.autograd.grad(out, (qkv, bias), dout)
    assert dbias.dtype == dtype and dbias.shape == bias.shape
    # the kernels' own dqkv, summed over rows in float64: only the order of the fp32 sums differs
    torch.testing.assert_close(dbias.double(), dqkv.double().sum((0, 1)).to(dtype).double(),
                               rtol=1e-5 if dtype == torch.float32 else 2e-3, atol=1e-5)
    # and FAIR's math: the reference's qkv gradient summed over rows
    xr = qkv.detach().double().requires_grad_(True)
    (dref,) = torch.autograd.grad(wa.window_attention_reference(xr, nw, H, S, pool), xr, dout.double())
    assert_close_verbose("dbias", dbias, dref.sum((0, 1)), dtype)
    # without a bias, no partial sums and the same dqkv
    (dqkv_plain,) = torch.autograd.grad(wa.window_attention(qkv, nw, H, S, pool, config), qkv, dout)
    assert torch.equal(dqkv_plain, dqkv)


@cpu_only
def test_cpu_bias_gradient_in_the_bias_dtype_as_under_autocast():
    """fp32 bias, half qkv (autocast): addmm's backward sums dqkv in half, then casts to fp32."""
    B, nw, T, H, D, S = 2, 3, 16, 2, 24, 4
    qkv = make_qkv(B, nw, T, H, D, torch.float16, "cpu").requires_grad_(True)
    bias = torch.randn(3 * H * D, requires_grad=True)
    out = wa.window_attention(qkv, nw, H, S, "max", bias=bias)
    dqkv, dbias = torch.autograd.grad(out, (qkv, bias), torch.ones_like(out))
    assert dbias.dtype == torch.float32
    assert torch.equal(dbias, dbias.half().float())  # rounded to half on the way, as FAIR's
    torch.testing.assert_close(dbias, dqkv.float().sum((0, 1)).half().float(), rtol=2e-3, atol=1e-4)


def test_config_backward_keys_follow_the_forward_unless_set(monkeypatch):
    monkeypatch.setattr(wa, "TUNED", {(196, 1, 32): {"BLOCK_M": 128, "BLOCK_M_BWD": 16}})
    untuned = wa.full_config(None, 64, 1, 96, 19)
    assert (untuned["BLOCK_M_BWD"], untuned["BLOCK_N_BWD"]) == (untuned["BLOCK_M"], untuned["BLOCK_N"])
    assert untuned["num_stages_bwd"] == untuned["num_stages"]
    tuned = wa.full_config(None, 196, 1, 32, 1)  # a tuned backward key stays; the others follow
    assert (tuned["BLOCK_M"], tuned["BLOCK_M_BWD"], tuned["BLOCK_N_BWD"]) == (128, 16, tuned["BLOCK_N"])
    forward_only = wa.full_config({"BLOCK_M": 16, "BLOCK_N": 32}, 196, 1, 32, 1)
    assert (forward_only["BLOCK_M_BWD"], forward_only["BLOCK_N_BWD"]) == (16, 32)
    both = wa.full_config({"BLOCK_N": 32, "BLOCK_N_BWD": 256, "num_stages_bwd": 1}, 196, 1, 32, 1)
    assert (both["BLOCK_N"], both["BLOCK_N_BWD"], both["num_stages_bwd"]) == (32, 256, 1)
    assert list(untuned) == list(wa._CONFIG_KEYS)
    with pytest.raises(AssertionError):
        wa.full_config({"BLOCK_N_BWD": 48}, 64, 1, 96, 19)  # not a power of two


def test_fp32_takes_the_rule_with_at_most_32kb_key_blocks():
    """TUNED (bf16) leaves fp32 alone, and fp32 key blocks hold at most 32 KB of k: compiled for
    sm_90, stage 3's tuned 128x128 forward took 256 KB of shared memory in fp32 (227 KB fit), and
    the rule's 128-key pooled backward of stage 4 240 KB; with 64-key blocks the largest is 168 KB."""
    bf16 = wa.full_config(None, 76, 1, 96, 1, itemsize=2)
    assert (bf16["BLOCK_M"], bf16["BLOCK_N"], bf16["BLOCK_N_BWD"]) == (128, 128, 128)  # TUNED
    for T, S in ((76, 1), (76, 4), (196, 1)):
        fp32 = wa.full_config(None, T, S, 96, 1, itemsize=4)
        assert fp32["BLOCK_N"] == fp32["BLOCK_N_BWD"] == 64, (T, S, fp32)
        assert fp32["BLOCK_M"] <= 64 and fp32["num_warps_bwd"] == 4, (T, S, fp32)
    assert wa.full_config(None, 196, 1, 32, 1, itemsize=4)["BLOCK_N"] == 128  # head_dim 32: 16 KB
    assert wa.full_config(None, 196, 1, 32, 1, itemsize=2) == wa.full_config(wa.TUNED[(196, 1, 32)], 196, 1, 32, 1)


def test_launch_configs_fit_hopper_shared_memory(tmp_path):
    """scripts/check_shared_memory.py compiles the kernels for sm_90 with Triton's compiler and
    ptxas, no GPU needed: the configs the launchers pick for the three largest-tile shapes (TUNED
    in bf16, the rule in fp32) fit an H200 block's 227 KB, and one that does not is reported."""
    pytest.importorskip("triton")
    import json

    script = str(REPO / "scripts" / "check_shared_memory.py")
    env = {"TRITON_INTERPRET": None, "PYTHONPATH": str(REPO)}
    out = tmp_path / "smem.json"
    run = run_python([script, "--shapes", "stage3-global-mae,stage4-pool-global,decoder",
                      "--dtypes", "bf16,fp32", "--registers", "--json", str(out)], env=env, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert len(report["results"]) == 6 and report["limit_bytes"] == 227 * 1024
    for entry in report["results"]:
        assert entry["fits"] and 0 < max(entry["shared_bytes"].values()) <= report["limit_bytes"], entry
        # both backward variants (with and without the qkv bias sums), each read back from ptxas
        assert {"bwd_dkdv", "bwd_dkdv+bias"} <= set(entry["ptxas"]) == set(entry["shared_bytes"]), entry
        assert all(0 < use["registers"] <= 255 and use["spill_store_bytes"] >= 0
                   for use in entry["ptxas"].values()), entry
    # the tiles kernels (off as shipped, tuned per shape) at the two shapes they were built for
    tiles_out = tmp_path / "smem_key_tiles.json"
    tiles = run_python([script, "--shapes", "stage3-global-mae,decoder", "--dtypes", "bf16", "--registers",
                        "--config", '{"KEY_TILES": 1, "KEY_TILES_BWD": 1, "BLOCK_M": 64}', "--json", str(tiles_out)],
                       env=env, timeout=600)
    assert tiles.returncode == 0, tiles.stdout + tiles.stderr
    for entry in json.loads(tiles_out.read_text())["results"]:
        assert entry["fits"] and {"fwd_tiles", "bwd_key_tiles"} <= set(entry["ptxas"]), entry
    too_big = run_python([script, "--shapes", "stage3-global-mae", "--dtypes", "bf16",
                          "--config", '{"BLOCK_M": 128, "BLOCK_N": 256, "num_stages": 3}'], env=env, timeout=600)
    assert too_big.returncode == 1 and "does not fit" in too_big.stdout, too_big.stdout + too_big.stderr


def test_tiles_split_a_window_into_power_of_two_tiles():
    assert wa.key_tiles(196) == (128, 64, 16)  # the MAE decoder: 208 rows held, not 256
    assert wa.key_tiles(76) == (64, 16, 0)  # stages 3 and 4, global: 80, not 128
    assert wa.key_tiles(19) == (32, 0, 0) and wa.key_tiles(64) == (64, 0, 0)
    assert wa.key_tiles(240) == (128, 64, 64)  # past three tiles the last takes the rest
    for T in range(1, 257):
        tiles = wa.key_tiles(T)
        assert sum(tiles) >= T and all(t == 0 or (t >= 16 and t & (t - 1) == 0) for t in tiles), (T, tiles)
        assert list(tiles) == sorted(tiles, reverse=True), (T, tiles)
    cfg = wa.full_config({"KEY_TILES_BWD": 1}, 196, 1, 32, 1)
    assert wa.uses_key_tiles(cfg, 196, 32, 2)
    assert not wa.uses_key_tiles(cfg, 196, 32, 2, bias_grad=True)  # the bias sums stay with the one-tile kernel
    assert not wa.uses_key_tiles(wa.full_config(None, 196, 1, 32, 1), 196, 32, 2)  # off unless asked for
    assert not wa.uses_key_tiles(wa.full_config({"KEY_TILES_BWD": 1}, 16, 4, 96, 19), 16, 96, 2)  # 4 windows a program
    assert not wa.uses_key_tiles(wa.full_config({"KEY_TILES_BWD": 1}, 392, 1, 32, 1), 392, 32, 2)  # past 256 rows
    assert not wa.uses_key_tiles(cfg, 196, 32, 2, forward=True)  # each pass asked for apart
    assert wa.uses_key_tiles(wa.full_config({"KEY_TILES": 1}, 196, 1, 32, 1), 196, 32, 2, forward=True)
    both = wa.full_config({"KEY_TILES": 1, "KEY_TILES_BWD": 1}, 196, 1, 96, 1)
    assert wa.uses_key_tiles(both, 196, 96, 2)  # 208 x 128 bf16 k: 52 KB
    assert not wa.uses_key_tiles(both, 196, 96, 4) and not wa.uses_key_tiles(both, 196, 96, 4, forward=True)  # fp32: 104 KB
    assert wa.query_tiles(196, 64) == (4, 16) and wa.query_tiles(76, 64) == (2, 16)  # 208 and 80 rows
    assert wa.query_tiles(64, 64) == (1, 0) and wa.query_tiles(100, 64) == (2, 0)  # rest 36 needs 64 rows
    assert wa.query_tiles(196, 16) == (13, 0)


# windows whose keys the tiles kernels hold in two or three tiles: the decoder's 196 keys (three),
# stage 3's global 76 (two), a pooled global window and windows over several programs; the forward's
# queries in full tiles and a smaller last one (196 at 64 -> 3 x 64 + 16)
KEY_TILE_CASES = [
    pytest.param(1, 1, 196, 2, 32, 1, dict(wa.TUNED[(196, 1, 32)], BLOCK_M=64), id="decoder-T196-D32"),
    pytest.param(1, 1, 76, 1, 96, 1, {"BLOCK_M": 64}, id="global-T76-D96"),
    pytest.param(1, 1, 76, 2, 40, 4, {"BLOCK_M": 16, "BLOCK_M_BWD": 16}, id="global-T76-S4-D40"),
    pytest.param(2, 3, 40, 1, 24, 1, {"BLOCK_M": 32, "BLOCK_M_BWD": 16}, id="nw3-T40-D24"),
    pytest.param(1, 2, 48, 1, 24, 2, {"BLOCK_M": 16}, id="nw2-T48-S2-D24"),
]
TILES = {"KEY_TILES": 1, "KEY_TILES_BWD": 1}


@cpu_only
@pytest.mark.parametrize("B,nw,T,H,D,S,config", KEY_TILE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_cpu_tiles_kernels_match_reference_and_the_one_tile_kernels(B, nw, T, H, D, S, config, dtype):
    """``KEY_TILES`` / ``KEY_TILES_BWD``: out and dqkv against FAIR's math in float64 at the dtype's
    tolerance, and against the one-tile kernels (the same products; softmax and delta's row sums
    split over tiles) within fp32 rounding, each tiles kernel alone and both together."""
    qkv = make_qkv(B, nw, T, H, D, dtype, "cpu", ties=S > 1)
    tight = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-3, atol=1e-3)
    cfg = wa.full_config(dict(config, **TILES), T, S, D, nw, qkv.dtype.itemsize)
    assert wa.uses_key_tiles(cfg, T, D, qkv.dtype.itemsize)
    assert wa.uses_key_tiles(cfg, T, D, qkv.dtype.itemsize, forward=True)
    out, dqkv, ref, dref = run_both(qkv, nw, H, S, "max", dict(config, **TILES))
    assert_close_verbose("out", out, ref, dtype)
    assert_close_verbose("dqkv", dqkv, dref, dtype)
    out_one, dqkv_one, _, _ = run_both(qkv, nw, H, S, "max", config)
    torch.testing.assert_close(out, out_one, **tight)
    torch.testing.assert_close(dqkv, dqkv_one, **tight)
    for only in ({"KEY_TILES": 1}, {"KEY_TILES_BWD": 1}):  # each with the other pass's one-tile kernel
        out_mixed, dqkv_mixed, _, _ = run_both(qkv, nw, H, S, "max", dict(config, **only))
        torch.testing.assert_close(out_mixed, out_one, **tight)
        torch.testing.assert_close(dqkv_mixed, dqkv_one, **tight)


@cpu_only
@pytest.mark.parametrize("pool", ["max", "amax"])
def test_cpu_tiles_kernels_pool_ties(pool):
    """Pooled q with ties through the tiles kernels: each pool mode's own gradient."""
    qkv = make_qkv(1, 1, 76, 2, 24, torch.float32, "cpu", ties=True)
    out, dqkv, ref, dref = run_both(qkv, 1, 2, 4, pool, dict(TILES, BLOCK_M=16, BLOCK_M_BWD=16))
    assert_close_verbose("out", out, ref, torch.float32)
    assert_close_verbose("dqkv", dqkv, dref, torch.float32)


@cpu_only
def test_cpu_supports():
    qkv = torch.randn(2, 48, 3 * 2 * 24)
    assert wa.supports(qkv, 3, 2, 4)
    assert not wa.supports(qkv, 5, 2, 1)  # N not a multiple of nw
    assert not wa.supports(qkv, 3, 2, 3)  # T=16 not a multiple of S=3
    assert not wa.supports(qkv, 3, 5, 1)  # channels not 3*H*D
    assert not wa.supports(qkv.to(torch.int32), 3, 2, 1)
    assert not wa.supports(torch.randn(1, 16, 3 * 160), 1, 1, 1)  # D=160 > 128
    assert not wa.supports(qkv[0], 3, 2, 1)  # not 3-D


def test_bad_pool_mode_raises():
    with pytest.raises(ValueError, match="pool"):
        wa.window_attention(torch.randn(1, 16, 3 * 16), 1, 1, 4, pool="mean")


def test_supports_false_without_triton_or_device(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not wa.supports(torch.randn(2, 48, 144), 3, 2, 4)  # CPU tensor, no interpreter
    monkeypatch.setattr(wa, "HAS_TRITON", False)
    assert not wa.supports(torch.randn(2, 48, 144), 3, 2, 4)


def test_reference_is_fairs_attention():
    """``window_attention_reference`` followed by FAIR's proj equals FAIR's MaskUnitAttention."""
    hiera = pytest.importorskip("hiera.hiera")
    torch.manual_seed(0)
    for dim, dim_out, heads, q_stride, window_size, mu in [
        (16, 32, 2, 4, 4, True),  # pooled mask-unit attention: T=16, S=4
        (32, 32, 2, 1, 16, True),
        (32, 32, 4, 1, 0, False),  # global
    ]:
        m = hiera.MaskUnitAttention(dim, dim_out, heads, q_stride, window_size, mu).double()
        x = torch.randn(2, 3 * 16, dim, dtype=torch.float64)
        nw = (x.shape[1] // (q_stride * window_size)) if mu else 1
        want = m(x)
        got = m.proj(wa.window_attention_reference(m.qkv(x), nw, heads, q_stride, "max"))
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


# ------------------------------------------------------------------------------------------------
# GPU: the real Hiera shapes (B=128, 224px)
# ------------------------------------------------------------------------------------------------

GPU_SHAPES = wa.HIERA_B_SHAPES  # (name, nw, T, H, D, S)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name,nw,T,H,D,S", GPU_SHAPES, ids=[s[0] for s in GPU_SHAPES])
def test_gpu_matches_reference(name, nw, T, H, D, S, dtype):
    B = 128 if dtype == torch.bfloat16 else 16
    qkv = make_qkv(B, nw, T, H, D, dtype, "cuda", seed=sum(map(ord, name)))
    assert wa.supports(qkv, nw, H, S)
    out, dqkv, ref, dref = run_both(qkv, nw, H, S, "max")
    torch.cuda.synchronize()
    assert_close_verbose("out", out, ref, dtype)
    assert_close_verbose("dqkv", dqkv, dref, dtype)


KEY_TILE_SHAPES = [s for s in GPU_SHAPES if s[0] in ("decoder", "stage3-global-mae", "stage4-mae",
                                                      "stage4-pool-global", "stage3-global-cls")]


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name,nw,T,H,D,S", KEY_TILE_SHAPES, ids=[s[0] for s in KEY_TILE_SHAPES])
@pytest.mark.parametrize("block_m", [16, 32])
def test_gpu_tiles_kernels_match_reference(name, nw, T, H, D, S, dtype, block_m):
    B = 128 if dtype == torch.bfloat16 else 16
    qkv = make_qkv(B, nw, T, H, D, dtype, "cuda", seed=sum(map(ord, name)))
    config = dict(TILES, BLOCK_M=4 * block_m, BLOCK_M_BWD=block_m)
    cfg = wa.full_config(config, T, S, D, nw, qkv.dtype.itemsize)
    if dtype == torch.float32 and name == "stage3-global-cls":  # 208 x 128 fp32 keys: one-tile kernels
        assert not wa.uses_key_tiles(cfg, T, D, 4) and not wa.uses_key_tiles(cfg, T, D, 4, forward=True)
    else:
        assert wa.uses_key_tiles(cfg, T, D, qkv.dtype.itemsize)
        assert wa.uses_key_tiles(cfg, T, D, qkv.dtype.itemsize, forward=True)
    out, dqkv, ref, dref = run_both(qkv, nw, H, S, "max", config)
    torch.cuda.synchronize()
    assert_close_verbose("out", out, ref, dtype)
    assert_close_verbose("dqkv", dqkv, dref, dtype)


@gpu_only
@pytest.mark.parametrize("pool", ["max", "amax"])
def test_gpu_pool_ties_bf16(pool):
    nw, T, H, D, S = 19, 64, 2, 96, 4
    qkv = make_qkv(8, nw, T, H, D, torch.bfloat16, "cuda", ties=True)
    out, dqkv, ref, dref = run_both(qkv, nw, H, S, pool)
    assert_close_verbose("out", out, ref, torch.bfloat16)
    assert_close_verbose("dqkv", dqkv, dref, torch.bfloat16)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name,nw,T,H,D,S", GPU_SHAPES, ids=[s[0] for s in GPU_SHAPES])
def test_gpu_bias_gradient_from_the_kernels(name, nw, T, H, D, S, dtype):
    """The qkv bias's gradient from the backward kernels' partial sums: dqkv summed over rows."""
    B = 32
    qkv = make_qkv(B, nw, T, H, D, dtype, "cuda", seed=sum(map(ord, name))).requires_grad_(True)
    bias = torch.randn(3 * H * D, device="cuda", dtype=dtype, requires_grad=True)
    out = wa.window_attention(qkv, nw, H, S, "max", bias=bias)
    dqkv, dbias = torch.autograd.grad(out, (qkv, bias), torch.randn_like(out))
    torch.cuda.synchronize()
    expected = dqkv.double().sum((0, 1)).to(dtype).double()
    torch.testing.assert_close(dbias.double(), expected, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-4)


@gpu_only
@pytest.mark.parametrize("name,nw,T,H,D,S", GPU_SHAPES, ids=[s[0] for s in GPU_SHAPES])
def test_gpu_every_element_written(name, nw, T, H, D, S):
    B = 8
    qkv = make_qkv(B, nw, T, H, D, torch.bfloat16, "cuda")
    out = torch.full((B, T // S * nw, H * D), float("nan"), device="cuda", dtype=torch.bfloat16)
    out, lse = wa.window_attention_forward(qkv, nw, H, S, out=out)
    dqkv = torch.full_like(qkv, float("nan"))
    wa.window_attention_backward(torch.randn_like(out), qkv, out, lse, nw, H, S, dqkv=dqkv)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.isfinite(dqkv).all()


@cpu_only
def test_cpu_mae_through_the_kernel_matches_fair():
    """A whole (tiny) FAIR MAE step with HIERA_OPTIM_ATTENTION=triton, eager and under
    torch.compile(fullgraph=True): the custom ops trace, and outputs and every gradient match FAIR."""
    pytest.importorskip("hiera")
    import hiera_autopatch
    from equivalence import assert_equivalent, fair_model, input_for, run_pair, run_step

    hiera_autopatch.enable(attention="triton")
    try:
        torch.manual_seed(0)
        model = fair_model("mae", "tiny", stages=(1, 1, 1, 1))
        x = input_for(model)
        unpatched, patched = run_pair(model, x, lambda m, x: m(x))
        assert_equivalent(unpatched, patched, 1e-5, 1e-4)
        torch._dynamo.reset()
        compiled_call = torch.compile(lambda m, x: m(x), fullgraph=True, backend="aot_eager")
        assert_equivalent(unpatched, run_step(model, x, compiled_call), 1e-5, 1e-4)
    finally:
        hiera_autopatch.disable()
        torch._dynamo.reset()


@pytest.fixture
def kernel_bias_grads(monkeypatch):
    """HIERA_OPTIM_ATTENTION=triton and the qkv bias gradients from the kernels for the test; the
    list counts the attention calls that took them (``bias_part_buffer``)."""
    pytest.importorskip("hiera")
    import hiera_autopatch
    from equivalence import count_calls
    from hiera_autopatch.ops import attention

    monkeypatch.setattr(attention, "fused_bias_grad", True)  # off by default (lost an A/B); tested on
    calls = count_calls(monkeypatch, wa, "bias_part_buffer")
    hiera_autopatch.enable(attention="triton")
    yield calls
    hiera_autopatch.disable()
    torch._dynamo.reset()


@cpu_only
def test_cpu_mae_through_the_kernel_under_inductor_matches_fair(kernel_bias_grads):
    """As above, compiled by Inductor itself (CPU code around the interpreted kernel), which
    partitions the joint graph its own way: the custom ops with the qkv bias's gradient (counted)
    give FAIR's outputs and gradients. ``fallback_random``: the mask from eager's RNG, as FAIR's."""
    import torch._inductor.config as inductor_config

    import hiera_autopatch
    from equivalence import assert_equivalent, fair_model, input_for, run_step

    torch.manual_seed(0)
    model = fair_model("mae", "tiny", stages=(1, 1, 1, 1))
    x = input_for(model)
    with hiera_autopatch.disabled():
        fair = run_step(model, x, lambda m, x: m(x))
    torch._dynamo.reset()
    # config.patch, not monkeypatch: monkeypatch's undo deletes a config entry it did not see as an
    # attribute, and every later compile in the process then fails on the missing option
    with inductor_config.patch(fallback_random=True):
        compiled = run_step(model, x, torch.compile(lambda m, x: m(x), fullgraph=True))
    assert_equivalent(fair, compiled, 1e-5, 1e-4)
    assert len(kernel_bias_grads) == 5  # one per attention layer: 4 encoder stages, 1 decoder block


@cpu_only
@pytest.mark.parametrize("fused", [True, False], ids=["kernel-bias-grad", "autograd-bias-grad"])
@pytest.mark.parametrize("kind", ["mae", "cls"])
def test_cpu_qkv_bias_gradient_through_the_kernel_matches_fair(monkeypatch, kernel_bias_grads, fused, kind):
    """attention.fused_bias_grad: the qkv Linears' bias gradients from the kernels' partial sums
    (on) or autograd's reduction (off); every output and gradient matches FAIR's either way."""
    from equivalence import assert_equivalent, fair_model, input_for, run_pair
    from hiera_autopatch.ops import attention

    monkeypatch.setattr(attention, "fused_bias_grad", fused)
    torch.manual_seed(0)
    model = fair_model(kind, "tiny", stages=(1, 1, 1, 1))
    unpatched, patched = run_pair(model, input_for(model), lambda m, x: m(x))
    assert_equivalent(unpatched, patched, 1e-5, 1e-4)
    attention_layers = sum(1 for m in model.modules() if type(m).__name__ == "MaskUnitAttention")
    assert len(kernel_bias_grads) == (attention_layers if fused else 0)


@cpu_only
def test_cpu_tune_script_times_each_phase_and_checks_it(tmp_path):
    """scripts/tune_attention.py in the interpreter: forward and backward tuned apart, each trial
    checked against the reference, the default config among the trials."""
    import json

    tune = import_script("tune_attention")
    out = tmp_path / "tune.json"
    assert tune.main(["--device", "cpu", "--batch", "1", "--shapes", "stage4-global-mae",
                      "--budget-s", "0", "--json", str(out)]) == 0
    entry = json.loads(out.read_text())["shapes"]["stage4-global-mae"]
    assert entry["cut_short"] and entry["default"] == wa.full_config(None, 19, 1, 96, 1)
    for phase in ("fwd", "bwd"):
        assert entry[f"{phase}_best"]["config"] == {}  # only the default ran
        assert entry[f"{phase}_best"]["rel_err"] < 1e-5  # fp32 in the interpreter
    bwd_keys = {key for t in entry["trials"] if t["phase"] == "bwd" for key in t["config"]}
    assert bwd_keys <= set(wa.BWD_KEYS) | {"num_warps_bwd"}
    assert set(tune.candidates(wa, 196, 1, 32, 1, "bwd")[0]) == {"BLOCK_M_BWD", "BLOCK_N_BWD", "num_warps_bwd"}
