"""The one env parser: words, bad values, comma lists, precedence. In-process: nothing is patched."""

from __future__ import annotations

import pytest

from hiera_autopatch import _bootstrap, _config, _registry


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", " on ", "Yes"])
def test_true_words(raw):
    warnings = []
    assert _config.parse_switch("HIERA_OPTIM", raw, warnings) is True
    assert warnings == []


@pytest.mark.parametrize("raw", [None, "", "0", "false", "Off", " no "])
def test_false_words(raw):
    warnings = []
    assert _config.parse_switch("HIERA_OPTIM", raw, warnings) is False
    assert warnings == []


@pytest.mark.parametrize("raw", ["2", "enable", "y", "-1", "tru"])
def test_bad_switch_value_warns_once_naming_variable_and_value(raw):
    config, warnings = _config.from_env({"HIERA_OPTIM": raw})
    assert config.enabled is False
    assert len(warnings) == 1
    assert f"HIERA_OPTIM={raw!r}" in warnings[0]


def test_kept_embed_defaults_on_and_a_bad_value_keeps_the_default():
    assert _config.from_env({})[0].kept_embed is True
    assert _config.from_env({"HIERA_OPTIM_KEPT_EMBED": "0"})[0].kept_embed is False
    assert _config.from_env({"HIERA_OPTIM_KEPT_EMBED": "on"})[0].kept_embed is True
    config, warnings = _config.from_env({"HIERA_OPTIM_KEPT_EMBED": "maybe"})
    assert config.kept_embed is True
    assert len(warnings) == 1 and "HIERA_OPTIM_KEPT_EMBED='maybe'" in warnings[0] and "treating it as on" in warnings[0]


def test_enabled_by_env_or_runner():
    assert _config.from_env({"HIERA_OPTIM": "1"})[0].source == "env"
    assert _config.from_env({"HIERA_OPTIM": "1", "HIERA_OPTIM_RUNNER": "1"})[0].source == "runner"
    off, warnings = _config.from_env({})
    assert off.enabled is False and off.source == "" and warnings == []


def test_comma_lists_are_stripped_deduplicated_and_ordered():
    assert _config.parse_names(" a, b ,,a , c ") == ("a", "b", "c")
    assert _config.parse_names("") == ()
    assert _config.parse_names(None) == ()
    config, warnings = _config.from_env(
        {
            "HIERA_OPTIM": "1",
            "HIERA_OPTIM_MODULES": "models.backbone , vendor.hiera",
            "HIERA_OPTIM_DISABLE": "fair.attention,timm.attention",
        }
    )
    assert warnings == []
    assert config.extra_modules == ("models.backbone", "vendor.hiera")
    assert config.disabled_patches == {"fair.attention", "timm.attention"}
    targets = _registry.targets_for(config)
    assert targets["vendor.hiera"] == "fair" and targets["timm.models.hiera"] == "timm"


def test_unknown_patch_name_gets_one_warning_naming_the_known_ones():
    config, _ = _config.from_env({"HIERA_OPTIM_DISABLE": "fair.attention,bogus,other"})
    warnings = _config.check_patch_names(config, _registry.PATCH_NAMES)
    assert len(warnings) == 1
    assert "bogus" in warnings[0] and "other" in warnings[0] and "HIERA_OPTIM_DISABLE" in warnings[0]
    for name in _registry.PATCH_NAMES:
        assert name in warnings[0]
    config, _ = _config.from_env({"HIERA_OPTIM_DISABLE": ",".join(_registry.PATCH_NAMES)})
    assert _config.check_patch_names(config, _registry.PATCH_NAMES) == []


def test_other_variables():
    config, warnings = _config.from_env(
        {"HIERA_OPTIM_VERBOSE": "1", "HIERA_OPTIM_GRAPHS": "on", "HIERA_OPTIM_ATTENTION": "SDPA"}
    )
    assert warnings == [] and config.verbose and config.graphs and config.attention == "sdpa"
    config, warnings = _config.from_env({"HIERA_OPTIM_ATTENTION": "flash"})
    assert config.attention == "auto" and len(warnings) == 1 and "HIERA_OPTIM_ATTENTION='flash'" in warnings[0]


def test_explicit_arguments_override_the_environment():
    config, _ = _config.from_env({"HIERA_OPTIM": "0"})
    assert config.replace(enabled=True, source="api").enabled is True


def test_every_variable_is_a_named_constant():
    names = {value for key, value in vars(_config).items() if key.startswith("ENV_")}
    assert names == {
        "HIERA_OPTIM",
        "HIERA_OPTIM_MODULES",
        "HIERA_OPTIM_DISABLE",
        "HIERA_OPTIM_FORCE",
        "HIERA_OPTIM_VERBOSE",
        "HIERA_OPTIM_GRAPHS",
        "HIERA_OPTIM_ATTENTION",
        "HIERA_OPTIM_KEPT_EMBED",
        "HIERA_OPTIM_RUNNER",
    }
    assert set(_bootstrap._OFF_WORDS) == set(_config.FALSE_WORDS)
    assert not set(_config.TRUE_WORDS) & set(_config.FALSE_WORDS)


def test_registry_reads_every_config_field_it_needs():
    fields = {f.name for f in __import__("dataclasses").fields(_config.Config)}
    assert {"enabled", "source", "extra_modules", "disabled_patches", "forced_patches", "verbose"} <= fields
    assert {"graphs", "attention"} <= fields
