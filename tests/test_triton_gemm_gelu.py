"""The experimental GEMM + erf-GELU epilogue kernels (ops/triton/gemm_gelu.py) vs the unfused ops.

CPU: Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py without a GPU), small odd shapes
(every block edge masked), fp32 and fp16. GPU: the Hiera-B MAE decoder's MLP shape in bf16.
Both outputs of each kernel are compared with the reference on the same inputs.
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import import_script

gg = importlib.import_module("hiera_autopatch.ops.triton.gemm_gelu")

_INTERPRETED = gg.HAS_TRITON and type(gg._gemm_gelu_kernel).__name__ == "InterpretedFunction"
cpu_only = pytest.mark.skipif(not _INTERPRETED, reason="needs the Triton interpreter (TRITON_INTERPRET=1)")
gpu_only = pytest.mark.skipif(not (torch.cuda.is_available() and gg.HAS_TRITON and not _INTERPRETED),
                              reason="needs CUDA and compiled Triton")

SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}
# fp16's bound is a few units in the last place of the largest |value| (~8 here)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _inputs(M, C, Hid, dtype, device, bias=True):
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(M, C, generator=gen, device=device).to(dtype)
    w1 = (torch.randn(Hid, C, generator=gen, device=device) * C ** -0.5).to(dtype)
    b1 = (torch.randn(Hid, generator=gen, device=device) * 0.5).to(dtype) if bias else None
    w2 = (torch.randn(C, Hid, generator=gen, device=device) * Hid ** -0.5).to(dtype)
    d_out = torch.randn(M, C, generator=gen, device=device).to(dtype)
    return x, w1, b1, w2, d_out


def _assert_close(name, got, ref, dtype):
    assert got.dtype == ref.dtype and got.shape == ref.shape, (name, got.dtype, got.shape)
    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err <= TOL[dtype], f"{name}: relative error {err:.2e} > {TOL[dtype]:.0e}"


def _check(M, C, Hid, dtype, device, config, bias=True):
    x, w1, b1, w2, d_out = _inputs(M, C, Hid, dtype, device, bias)
    hidden, act = gg.linear_gelu(x, w1, b1, config)
    ref_hidden, ref_act = gg.linear_gelu_reference(x, w1, b1)
    _assert_close("hidden", hidden, ref_hidden, dtype)
    _assert_close("act", act, ref_act, dtype)
    # backward from the reference's hidden: both sides read the same saved tensor
    d_hidden, act2 = gg.matmul_gelu_backward(d_out, w2, ref_hidden, config)
    ref_d_hidden, ref_act2 = gg.matmul_gelu_backward_reference(d_out, w2, ref_hidden)
    _assert_close("d_hidden", d_hidden, ref_d_hidden, dtype)
    _assert_close("act (backward)", act2, ref_act2, dtype)
    # with fc1's bias gradient: the same two tensors, and the column sums of d_hidden as stored
    d_hidden3, act3, d_bias = gg.matmul_gelu_backward(d_out, w2, ref_hidden, config, bias_grad=True)
    assert torch.equal(d_hidden3, d_hidden) and torch.equal(act3, act2)
    _assert_close("d_bias", d_bias, d_hidden.float().sum(0).to(dtype), dtype)


FETCH = {"pointers": {"TMA": 0}, "descriptors": {"TMA": 1},
         "persistent": {"TMA": 1, "PERSISTENT": 1}}  # persistent: 4 programs (interpreter) walk the tiles


@cpu_only
@pytest.mark.parametrize("fetch", list(FETCH))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("M,C,Hid,bias", [(37, 24, 40, True), (16, 16, 16, True), (50, 40, 24, False)],
                         ids=["odd", "one-tile", "no-bias"])
def test_cpu_matches_the_unfused_ops(M, C, Hid, bias, dtype, fetch):
    _check(M, C, Hid, dtype, "cpu", {**SMALL, **FETCH[fetch]}, bias)


@cpu_only
def test_cpu_gelu_is_the_exact_erf_one():
    """tanh-GELU differs from erf-GELU by up to ~5e-4 around |h| ~ 2: the fp32 bound catches it."""
    x = torch.linspace(-4, 4, 32).reshape(32, 1)
    w1 = torch.ones(16, 1)
    _, act = gg.linear_gelu(x, w1, None, SMALL)
    exact = torch.nn.functional.gelu(x.expand(32, 16))
    tanh = torch.nn.functional.gelu(x.expand(32, 16), approximate="tanh")
    assert (act - exact).abs().max() < 1e-6 < (act - tanh).abs().max()


@cpu_only
def test_cpu_bench_script_dry_run(tmp_path):
    bench = import_script("bench_gemm_gelu")
    out = tmp_path / "gemm_gelu.json"
    assert bench.main(["--device", "cpu", "--shapes", "decoder", "--json", str(out)]) == 0
    entry = json.loads(out.read_text())["shapes"]["decoder"]
    for phase in ("fwd", "bwd"):
        assert entry[phase]["best"]["rel_err"] < 1e-5  # fp32 in the interpreter
        assert "saving_ms_per_step" in entry[phase]


@gpu_only
@pytest.mark.parametrize("fetch", list(FETCH))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_decoder_shape(dtype, fetch):
    _check(128 * 196 + 3, 512, 2048, dtype, "cuda", FETCH[fetch])


@cpu_only
def test_cpu_gelu_mlp_with_gelu_in_the_epilogues_matches_plain_autograd(monkeypatch):
    """``CONFIG_BY_WIDTH`` lists the width: ``ops/mlp.GeluMlp`` under Inductor (CPU) runs fc1 with GELU
    in its epilogue and fc2's data gradient with GELU's gradient, GELU and fc1's bias sums in its
    epilogue; output, input grad and every weight grad as plain eager autograd's."""
    from equivalence import count_calls, eager_and_compiled_gelu_mlp

    forward_calls = count_calls(monkeypatch, gg, "linear_gelu")
    backward_calls = count_calls(monkeypatch, gg, "matmul_gelu_backward")
    monkeypatch.setattr(gg, "CONFIG_BY_WIDTH", {96: {"fwd": SMALL, "bwd": SMALL}})
    eager, compiled = eager_and_compiled_gelu_mlp()
    assert (len(forward_calls), len(backward_calls)) == (1, 1)
    for i, (actual, expected) in enumerate(zip(compiled, eager)):
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5, msg=f"tensor {i}")


def test_best_by_width_takes_the_passes_that_won():
    bench = {"shapes": {
        "decoder": {"Hid": 2048, "fwd": {"saving_ms_per_step": 0.2, "best": {"config": {"BLOCK_M": 128}}},
                    "bwd": {"saving_ms_per_step": -0.1, "best": {"config": {"BLOCK_M": 64}}}},
        "stage3": {"Hid": 1536, "fwd": {"saving_ms_per_step": -0.01, "best": {"config": {}}},
                   "bwd": {"saving_ms_per_step": 0.05, "best": {"config": {"BLOCK_M": 64}}}},
        "stage1": {"Hid": 384, "fwd": {"baseline": {}, "trials": []}},  # no config passed its checks
    }}
    assert gg.best_by_width(bench) == {2048: {"fwd": {"BLOCK_M": 128}}, 1536: {"bwd": {"BLOCK_M": 64}}}


@cpu_only
@pytest.mark.parametrize("ws", [False, True], ids=["flattened", "warp-specialised"])
@pytest.mark.parametrize("gelu", [False, True], ids=["plain", "gelu"])
def test_cpu_probe_ws_gemm_kernel(ws, gelu):
    """scripts/probe_ws_gemm.py's persistent GEMM (tensor-descriptor loads and stores) in the
    interpreter, odd sizes over 4 programs: x @ w^T, with erf-GELU where asked."""
    probe = import_script("probe_ws_gemm")
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 24, generator=gen), torch.randn(40, 24, generator=gen)
    expected = x @ w.T
    if gelu:
        expected = F.gelu(expected)
    got = probe.persistent_gemm(x, w, "16x16x16", 1, ws, gelu, programs=4)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
