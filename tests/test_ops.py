"""ops/: 4-D attention against FAIR's 5-D formula (ties included), the batch split, masking helpers."""

import pytest
import torch
import torch.nn.functional as F

from hiera_autopatch.ops import attention, masking


def fair_attention(qkv, num_windows, heads, q_stride, pool):
    """FAIR's MaskUnitAttention.forward between the two Linears (timm's with pool="amax")."""
    batch, tokens, channels = qkv.shape
    head_dim = channels // (3 * heads)
    qkv = qkv.reshape(batch, -1, num_windows, 3, heads, head_dim).permute(3, 0, 4, 2, 1, 5)
    q, k, v = qkv[0], qkv[1], qkv[2]
    if q_stride > 1:
        q = q.view(batch, heads, num_windows, q_stride, -1, head_dim)
        q = q.amax(dim=3) if pool == "amax" else q.max(dim=3).values
    x = F.scaled_dot_product_attention(q, k, v)
    return x.transpose(1, 3).reshape(batch, -1, heads * head_dim)


def grads_of(fn, qkv, upstream):
    qkv = qkv.detach().clone().requires_grad_(True)
    out = fn(qkv)
    out.backward(upstream)
    return out.detach(), qkv.grad


@pytest.mark.parametrize("pool", ["max", "amax"])
@pytest.mark.parametrize(
    "batch, tokens_per_window, num_windows, heads, head_dim, q_stride",
    [(2, 16, 4, 1, 8, 1), (2, 16, 3, 2, 12, 4), (3, 64, 1, 2, 8, 4), (1, 20, 1, 4, 6, 1), (2, 4, 5, 3, 5, 4)],
)
def test_mask_unit_attention_matches_fair(pool, batch, tokens_per_window, num_windows, heads, head_dim, q_stride):
    torch.manual_seed(0)
    qkv = torch.randn(batch, tokens_per_window * num_windows, 3 * heads * head_dim, dtype=torch.float64)
    # quantised values make ties in the q max-pool common: max and amax route gradients differently there
    qkv = (qkv * 2).round() / 2
    upstream = torch.randn(batch, tokens_per_window * num_windows // q_stride, heads * head_dim, dtype=torch.float64)
    expected = grads_of(lambda t: fair_attention(t, num_windows, heads, q_stride, pool), qkv, upstream)
    got = grads_of(lambda t: attention.mask_unit_attention(t, num_windows, heads, q_stride, pool), qkv, upstream)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-10, atol=1e-12)


def test_tie_semantics_differ_so_the_test_above_can_fail():
    """With ties, max sends the gradient to one index and amax splits it: the two must differ."""
    torch.manual_seed(0)
    qkv = (torch.randn(2, 64, 3 * 8, dtype=torch.float64) * 2).round() / 2
    upstream = torch.randn(2, 16, 8, dtype=torch.float64)
    _, grad_max = grads_of(lambda t: attention.mask_unit_attention(t, 4, 1, 4, "max"), qkv, upstream)
    _, grad_amax = grads_of(lambda t: attention.mask_unit_attention(t, 4, 1, 4, "amax"), qkv, upstream)
    assert not torch.allclose(grad_max, grad_amax)


def test_batch_split_past_fused_limit(monkeypatch):
    """Calls past the fused kernels' batch limit are split; the result is unchanged."""
    torch.manual_seed(0)
    qkv = torch.randn(3, 16 * 7, 3 * 2 * 8)
    upstream = torch.randn(3, 16 * 7 // 4, 16)
    whole = grads_of(lambda t: attention.mask_unit_attention(t, 7, 2, 4, "max"), qkv, upstream)
    calls = []
    real_sdpa = F.scaled_dot_product_attention

    def counting_sdpa(q, k, v):
        calls.append(q.shape[0])
        return real_sdpa(q, k, v)

    monkeypatch.setattr(attention, "MAX_FUSED_BATCH", 5)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", counting_sdpa)
    split = grads_of(lambda t: attention.mask_unit_attention(t, 7, 2, 4, "max"), qkv, upstream)
    assert calls == [5, 5, 5, 5, 1]  # 21 folded windows in chunks of at most 5
    torch.testing.assert_close(split[0], whole[0])
    torch.testing.assert_close(split[1], whole[1])


def test_cpu_fp16_runs_fairs_math_backend_with_tiny_gradients(monkeypatch):
    """fp16 on CPU pins SDPA's math backend, FAIR's: with upstream gradients below fp16's normal
    range the CPU flash kernel's q/k grads are ~3x further from fp64 (see ``_pinned_backend``);
    ours must match FAIR's 5-D call exactly and the flash kernel must be the worse one."""
    from torch.nn.attention import SDPBackend

    torch.manual_seed(0)
    qkv64 = torch.randn(2, 64 * 4, 3 * 8, dtype=torch.float64)
    upstream64 = torch.randn(2, 64 * 4 // 4, 8, dtype=torch.float64) * 1e-5
    qkv, upstream = qkv64.half(), upstream64.half()
    expected = grads_of(lambda t: fair_attention(t, 4, 1, 4, "max"), qkv, upstream)
    got = grads_of(lambda t: attention.mask_unit_attention(t, 4, 1, 4, "max"), qkv, upstream)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    monkeypatch.setattr(attention, "_pinned_backend", lambda q: SDPBackend.FLASH_ATTENTION)
    flash = grads_of(lambda t: attention.mask_unit_attention(t, 4, 1, 4, "max"), qkv, upstream)
    exact = grads_of(lambda t: fair_attention(t, 4, 1, 4, "max"), qkv64, upstream64)

    def grad_error(result):
        return ((result[1].double() - exact[1]).norm() / exact[1].norm()).item()
    assert grad_error(flash) > 1.5 * grad_error(got), (grad_error(flash), grad_error(got))


def test_true_indices_and_gathers_match_boolean_indexing():
    torch.manual_seed(0)
    mask = torch.zeros(4, 10, dtype=torch.bool)
    for row in range(4):
        mask[row, torch.randperm(10)[:6]] = True
    idx = masking.true_indices(mask, 6)
    assert torch.equal(idx, torch.stack([row.nonzero().flatten() for row in mask]))
    x = torch.randn(4, 10, 5)
    assert torch.equal(masking.take_rows(x, idx), x[mask])
    tokens = torch.randn(4, 3 * 10, 5)  # (B, mu * #units, C), unit index fastest
    expected = tokens[mask[..., None].tile(1, 3, 5)].view(4, -1, 5)
    assert torch.equal(masking.keep_mask_units(tokens, idx, 10), expected)


def test_place_mask_units_matches_fair_assignment():
    torch.manual_seed(0)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, [1, 4]] = True
    mask[1, [0, 5]] = True
    visible = torch.randn(2, 2, 2, 2, 3)  # (B, n_keep, MUy, MUx, C)
    token = torch.randn(3)
    dense = torch.zeros(2, 6, 2, 2, 3)
    expand = mask.view(2, 6, 1, 1, 1).expand(2, 6, 2, 2, 3)
    dense[expand] = visible.flatten()
    expected = ~expand * token + expand * dense
    got = masking.place_mask_units(visible, masking.true_indices(mask, 2), 6, token)
    assert torch.equal(got, expected)


def test_keep_count():
    mask = torch.tensor([[True, False, True], [False, True, True]])
    assert masking.keep_count(mask) == 2
    mask[0, 1] = True
    with pytest.raises(ValueError, match="between 2 and 3"):
        masking.keep_count(mask)
    assert masking.keep_count(mask, strict=False) is None
    assert masking.static_keep_count(49, 0.6) == 19


def test_status_reports_which_kernel_each_attention_shape_ran():
    import hiera_autopatch

    attention.choices.clear()
    qkv = torch.randn(2, 16 * 3, 3 * 2 * 8)
    attention.mask_unit_attention(qkv, 3, 2, 4)
    calls = hiera_autopatch.status()["attention_calls"]
    assert calls == {"nw=3 T=16 S=4 H=2 D=8 eager": "sdpa"}  # CPU tensors: never the GPU kernel
    # under torch.compile, dynamic batch included, recording never breaks the graph
    compiled = torch.compile(lambda t: attention.mask_unit_attention(t, 3, 2, 4), fullgraph=True,
                             dynamic=True, backend="eager")
    compiled(qkv)
    compiled(torch.randn(5, 16 * 3, 3 * 2 * 8))
    assert hiera_autopatch.status()["attention_calls"]["nw=3 T=16 S=4 H=2 D=8 compiled"] == "sdpa"


# --- MAE fusion heads as a matmul (ops/fusion_head.py) ------------------------------------------


def fusion_head_grads(apply, head, features):
    """Output, features' grad and every weight grad of ``apply(head, features)`` under one upstream."""
    features = features.detach().clone().requires_grad_(True)
    head.zero_grad(set_to_none=True)
    out = apply(head, features)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    out.backward(upstream)
    return [out.detach(), features.grad, head.weight.grad, head.bias.grad]


@pytest.mark.parametrize(
    "unit, kernel, channels",
    [((8, 8), (4, 4), 12), ((4, 4), (2, 2), 24), ((8, 8), (8, 8), 5), ((1, 8, 8), (1, 4, 4), 6), ((16,), (4,), 7)],
)
def test_patchify_head_matches_fairs_fusion_head(unit, kernel, channels):
    from hiera.hiera_mae import apply_fusion_head

    from hiera_autopatch.ops import fusion_head

    torch.manual_seed(0)
    conv = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)[len(unit) - 1]
    head = conv(channels, 10, kernel_size=kernel, stride=kernel).double()
    features = torch.randn(3, 5, *unit, channels, dtype=torch.float64)  # (B, units, *unit, C)
    assert fusion_head.usable(head, features)
    ours = fusion_head_grads(fusion_head.patchify_head, head, features)
    fair = fusion_head_grads(apply_fusion_head, head, features)
    for a, b in zip(ours, fair):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_patchify_head_is_only_taken_for_plain_patchify_convolutions():
    from hiera_autopatch.ops import fusion_head

    features = torch.randn(2, 3, 8, 8, 4)
    plain = torch.nn.Conv2d(4, 6, kernel_size=4, stride=4)
    assert fusion_head.usable(plain, features)
    assert not fusion_head.usable(torch.nn.Identity(), features)
    assert not fusion_head.usable(torch.nn.Conv2d(4, 6, kernel_size=4, stride=2), features)
    assert not fusion_head.usable(torch.nn.Conv2d(4, 6, kernel_size=4, stride=4, padding=1), features)
    assert not fusion_head.usable(torch.nn.Conv2d(4, 6, kernel_size=3, stride=3), features)  # 8 % 3
    assert not fusion_head.usable(torch.nn.Conv2d(4, 6, kernel_size=2, stride=2, dilation=2), features)
    assert not fusion_head.usable(torch.nn.Conv2d(4, 6, kernel_size=4, stride=4, groups=2), features)
    hooked = torch.nn.Conv2d(4, 6, kernel_size=4, stride=4)
    hooked.register_forward_hook(lambda *args: None)
    assert not fusion_head.usable(hooked, features)


# --- the kept-token patch embedding's aligned matmul (ops/patch_embed.aligned) -------------------


@pytest.mark.parametrize("in_chans, kernel, padding", [(3, (7, 7), (3, 3)), (1, (7, 7), (3, 3)), (8, (4, 4), (0, 0))])
def test_kept_embedding_pads_its_matmul_to_aligned_rows_with_the_same_result(monkeypatch, in_chans, kernel, padding):
    from hiera_autopatch.ops import patch_embed

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(in_chans, 6, kernel_size=kernel, stride=4, padding=padding).double()
    x = torch.randn(2, in_chans, 32, 32, dtype=torch.float64)
    keep = torch.rand(2, 1, 32, 32) > 0.3
    token_ids = torch.stack([torch.randperm(64)[:10] for _ in range(2)])  # (B, T) on the 8x8 grid
    widths, linear = [], F.linear
    monkeypatch.setattr(patch_embed.F, "linear", lambda a, w, b=None: widths.append(a.shape[-1]) or linear(a, w, b))

    def embed(aligned):
        monkeypatch.setattr(patch_embed, "aligned", aligned)
        conv.zero_grad(set_to_none=True)
        out = patch_embed.embed_tokens(x, keep, conv, token_ids, (8, 8))
        out.backward(torch.ones_like(out))
        return out.detach(), conv.weight.grad, conv.bias.grad

    padded, plain = embed(True), embed(False)
    columns = in_chans * kernel[0] * kernel[1]
    assert widths == [columns + (-columns % 8), columns]
    for a, b in zip(padded, plain):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # and both are the convolution at those tokens
    full = F.conv2d(x * keep, conv.weight, conv.bias, stride=4, padding=padding).flatten(2)  # (B, C_out, 64)
    torch.testing.assert_close(padded[0], torch.stack([full[b, :, token_ids[b]].T for b in range(2)]))
