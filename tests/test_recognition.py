"""Recognition and the registry: only FAIR's own code is patched; edited forks keep their edits."""

import importlib
import pathlib
import shutil
import sys

import pytest
import torch

import hiera_autopatch
from hiera_autopatch import _config, _registry
from hiera_autopatch.patches import _base, fair, timm as timm_patches
from equivalence import assert_equivalent, input_for, run_pair

hiera = pytest.importorskip("hiera")

FORK_LOSS = '''
    def forward_loss(self, x, pred, mask):
        # an edited fork: L1 loss instead of MSE
        label = self.get_pixel_label_2d(x, mask)
        pred = pred[mask]
        return (pred - label).abs().mean(), pred, label
'''


@pytest.fixture
def in_tree_copy(tmp_path, monkeypatch):
    """FAIR's files copied into an in-tree `models` package, as research repos vendor them."""
    package = tmp_path / "models"
    shutil.copytree(pathlib.Path(hiera.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield package
    hiera_autopatch.disable()
    for name in [n for n in sys.modules if n == "models" or n.startswith("models.")]:
        del sys.modules[name]


def edit(path: pathlib.Path, anchor: str, new_method: str) -> None:
    """Replace the method starting at `anchor` (up to the next method) with `new_method`."""
    source = path.read_text()
    start = source.index(anchor)
    end = source.index("\n    def ", start + len(anchor))
    path.write_text(source[:start] + new_method.strip("\n").lstrip() + "\n" + source[end:])


def tiny_mae(module):
    return module.MaskedAutoencoderHiera(
        input_size=(128, 128), embed_dim=8, num_heads=1, stages=(1, 2, 2, 1), q_pool=2,
        decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2,
    )


def test_unedited_in_tree_copy_is_fully_patched(in_tree_copy):
    hiera_autopatch.enable()
    mae = importlib.import_module("models.hiera_mae")
    targets = hiera_autopatch.status()["targets"]
    assert targets["models.hiera"]["version"] == "in-tree copy"
    assert sorted(targets["models.hiera"]["applied"]) == ["fair.attention", "fair.block", "fair.encoder"]
    assert len(targets["models.hiera_mae"]["applied"]) == 4
    torch.manual_seed(0)
    model = tiny_mae(mae)
    unpatched, patched = run_pair(model, input_for(model), lambda m, x: m(x))
    assert_equivalent(unpatched, patched, 1e-5, 1e-4)


def test_edited_fork_keeps_its_edits_and_unchanged_classes_are_patched(in_tree_copy):
    edit(in_tree_copy / "hiera_mae.py", "def forward_loss(", FORK_LOSS)
    hiera_autopatch.enable()
    mae = importlib.import_module("models.hiera_mae")
    report = hiera_autopatch.status()["targets"]["models.hiera_mae"]
    assert "differs from the version" in report["skipped"]["fair.mae_loss"]
    assert "forward_loss differs" in report["skipped"]["fair.mae_forward"]
    assert sorted(report["applied"]) == ["fair.mae_decoder", "fair.mae_encoder"]
    assert hasattr(mae.MaskedAutoencoderHiera.forward_decoder, _base.MARKER)
    assert not hasattr(mae.MaskedAutoencoderHiera.forward_loss, _base.MARKER)
    assert hasattr(sys.modules["models.hiera"].MaskUnitAttention.forward, _base.MARKER)
    torch.manual_seed(0)
    model = tiny_mae(mae)
    unpatched, patched = run_pair(model, input_for(model), lambda m, x: m(x))
    assert_equivalent(unpatched, patched, 1e-5, 1e-4)  # the fork's L1 loss, on both sides


def test_force_applies_an_unrecognised_method(in_tree_copy):
    edit(in_tree_copy / "hiera.py", "def forward(self, x: torch.Tensor) -> torch.Tensor:", '''
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape  # a cosmetic edit the user knows to be compatible
        num_windows = (N // (self.q_stride * self.window_size)) if self.use_mask_unit_attn else 1
        qkv = self.qkv(x).reshape(B, -1, num_windows, 3, self.heads, self.head_dim).permute(3, 0, 4, 2, 1, 5)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if self.q_stride > 1:
            q = q.view(B, self.heads, num_windows, self.q_stride, -1, self.head_dim).max(dim=3).values
        x = F.scaled_dot_product_attention(q, k, v)
        x = x.transpose(1, 3).reshape(B, -1, self.dim_out)
        return self.proj(x)
''')
    hiera_autopatch.enable()
    module = importlib.import_module("models.hiera")
    assert "fair.attention" in hiera_autopatch.status()["targets"]["models.hiera"]["skipped"]
    hiera_autopatch.disable()
    hiera_autopatch.enable(forced_patches=frozenset({"fair.attention"}))
    assert "fair.attention (forced)" in hiera_autopatch.status()["targets"]["models.hiera"]["applied"]
    assert hasattr(module.MaskUnitAttention.forward, _base.MARKER)


def test_disable_names_leave_single_patches_off():
    hiera_autopatch.enable(disabled_patches=frozenset({"fair.mae_loss"}))
    try:
        report = hiera_autopatch.status()["targets"]["hiera.hiera_mae"]
        assert report["skipped"]["fair.mae_loss"].startswith("disabled by")
        assert not hasattr(hiera.MaskedAutoencoderHiera.forward_loss, _base.MARKER)
        torch.manual_seed(0)
        model = tiny_mae(hiera)
        unpatched, patched = run_pair(model, input_for(model), lambda m, x: m(x))
        assert_equivalent(unpatched, patched, 1e-5, 1e-4)
    finally:
        hiera_autopatch.disable()


def test_registry_names_are_complete():
    names = [p.name for p in fair.PATCHES + timm_patches.PATCHES]
    assert tuple(names) == _registry.PATCH_NAMES
    assert len(set(names)) == len(names)
    for patch in fair.PATCHES + timm_patches.PATCHES:
        assert patch.fingerprints and patch.summary and callable(patch.make)


def test_known_fingerprints_match_installed_fair_code():
    assert _base.fingerprint(hiera.hiera.MaskUnitAttention.forward) in fair.MASK_UNIT_ATTENTION_FORWARD
    assert _base.fingerprint(hiera.hiera_mae.MaskedAutoencoderHiera.forward_loss) in fair.MAE_FORWARD_LOSS


def test_patch_twice_and_revert_restore_exact_originals():
    originals = {
        (cls, attr): cls.__dict__[attr]
        for cls, attr in [
            (hiera.hiera.MaskUnitAttention, "forward"),
            (hiera.hiera.Hiera, "forward"),
            (hiera.hiera_mae.MaskedAutoencoderHiera, "forward_loss"),
        ]
    }
    hiera_autopatch.enable()
    first = {key: key[0].__dict__[key[1]] for key in originals}
    log_size = len(_registry.STATE.log)
    hiera_autopatch.enable()
    assert {key: key[0].__dict__[key[1]] for key in originals} == first  # not wrapped twice
    assert len(_registry.STATE.log) == log_size
    hiera_autopatch.disable()
    hiera_autopatch.disable()
    for (cls, attr), original in originals.items():
        assert cls.__dict__[attr] is original


def test_a_failing_patch_leaves_the_module_unpatched(monkeypatch):
    def broken(original, cls):
        raise RuntimeError("boom")

    bad = fair.PATCHES[1].__class__(**{**fair.PATCHES[1].__dict__, "make": broken})
    monkeypatch.setattr(fair, "PATCHES", (fair.PATCHES[0], bad))
    original = hiera.hiera.MaskUnitAttention.__dict__["forward"]
    hiera_autopatch.enable()
    try:
        report = hiera_autopatch.status()["targets"]["hiera.hiera"]
        assert "boom" in report["error"] and report["applied"] == []
        assert hiera.hiera.MaskUnitAttention.__dict__["forward"] is original  # rolled back
    finally:
        hiera_autopatch.disable()


def test_config_parsing_of_patch_lists():
    config, warnings = _config.from_env(
        {"HIERA_OPTIM": "1", "HIERA_OPTIM_DISABLE": " fair.mae_loss, ,timm.attention", "HIERA_OPTIM_FORCE": "fair.encoder"}
    )
    assert config.enabled and config.disabled_patches == {"fair.mae_loss", "timm.attention"}
    assert config.forced_patches == {"fair.encoder"} and not warnings
