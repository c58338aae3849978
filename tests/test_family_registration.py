"""One registration per family: `FAMILY_PACKAGES` names each family's package once, and both
halves (the jax-free config class, the runtime's spec) are found from that line alone."""

from __future__ import annotations

import pytest

from jobspec.families import FAMILY_PACKAGES, MODEL_CONFIGS, _config_class
from jobspec.families.model_config import _EXPERT_FAMILIES, ModelConfig
from runtime.model.registry import spec_for


@pytest.mark.parametrize("name", list(FAMILY_PACKAGES))
def test_each_line_finds_the_config_class_and_the_runtime_spec(name):
    cls = MODEL_CONFIGS[name]
    assert cls.family_name() == name
    assert cls.__module__ == f"jobspec.families.{FAMILY_PACKAGES[name]}"
    cfg = cls.model_construct(family=name)
    spec = spec_for(cfg)
    assert callable(spec.build) and callable(spec.hf_names)


def test_the_union_and_the_registration_list_the_same_families():
    assert list(MODEL_CONFIGS) == list(FAMILY_PACKAGES)


def test_a_package_without_the_named_family_fails_at_import():
    with pytest.raises(ImportError, match="defines no ModelConfig for family 'qwen9'"):
        _config_class("qwen9", "qwen3")


def test_an_unregistered_family_is_one_sentence():
    cfg = ModelConfig.model_construct(family="llama9")
    with pytest.raises(ValueError, match="'llama9' is not a registered model family"):
        spec_for(cfg)


def test_the_routed_expert_keys_name_the_families_that_read_them():
    """The shared expert keys' descriptions (the config reference) list exactly the families
    that take them."""
    takers = {name for name, cls in MODEL_CONFIGS.items() if cls.takes_expert_keys}
    assert set(_EXPERT_FAMILIES.split(", ")) == takers
    assert _EXPERT_FAMILIES in ModelConfig.model_fields["num_experts"].description
