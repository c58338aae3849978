"""The model-family registry at run time: `spec_for(cfg)` finds the family's `ModelSpec` in its
package (`runtime/model/<package>/`'s `SPECS`), the package that jobspec/families/__init__.py's
one line for the family names; nothing here lists the families."""

from __future__ import annotations

import importlib

from flax import nnx

from jobspec.families import FAMILY_PACKAGES
from jobspec.families.model_config import ModelConfig
from runtime.model.spec import FamilyModel, ModelSpec


def spec_for(cfg: ModelConfig) -> ModelSpec:
    """The spec of a ModelConfig's family; ValueError naming model.family."""
    package = FAMILY_PACKAGES.get(cfg.family)
    if package is None:
        raise ValueError(
            f"model.family {cfg.family!r} is not a registered model family "
            f"(known: {', '.join(FAMILY_PACKAGES)}; see jobspec/families/__init__.py)"
        )
    return importlib.import_module(f"runtime.model.{package}").SPECS[cfg.family]


def build_model_module(
    cfg: ModelConfig, *, rngs: nnx.Rngs, eager_sharding: bool = False
) -> FamilyModel:
    """Build cfg's family's model; a config changed without validation (`model_copy`) is
    checked against its family first."""
    problem = cfg.family_problem()
    if problem:
        raise ValueError(problem)
    return spec_for(cfg).build(cfg, rngs=rngs, eager_sharding=eager_sharding)
