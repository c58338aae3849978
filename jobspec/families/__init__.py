"""The model families, registered here once: one line per family in `FAMILY_PACKAGES` (its name
-> its package). The package's contract is `jobspec/families/<package>.py` (the `ModelConfig`
subclass whose `family` literal is the name: own keys and checks, HF config.json both ways),
collected here into `MODEL_CONFIGS`; its model is `runtime/model/<package>/` (its `SPECS`, which
runtime/model/registry.py finds the same way). A package may hold several families.

`AnyModelConfig` is `RunConfig.model`: pydantic's union of every family's class keyed on
`family`, so the JSON Schema documents each. A table is validated by its family's own class,
so an error names `model.<key>` (the union's tag never enters the path). The runtime's side
of a family (its modules, HF name map and counts) is `runtime/model/<family>/`.
"""

from __future__ import annotations

import importlib
from typing import Annotated, Any, Union

from pydantic import (
    Discriminator,
    Tag,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)

from jobspec.families.model_config import DEFAULT_FAMILY, MODEL_CONFIGS, ModelConfig

# fmt: off
#: Family name -> its package under jobspec/families/ and runtime/model/: one line per family.
FAMILY_PACKAGES: dict[str, str] = {
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "gemma4_text": "gemma4_text",
    "qwen3_next": "qwen3_next",
    "qwen2": "qwen2",
    "llama": "llama",
    "mistral": "llama",
    "deepseek_v3": "deepseek_v3",
    "gpt_oss": "gpt_oss",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5",
}
# fmt: on


def _config_class(name: str, package: str) -> type[ModelConfig]:
    """The ModelConfig subclass `jobspec/families/<package>.py` defines for family `name`."""
    module = importlib.import_module(f"jobspec.families.{package}")
    for value in vars(module).values():
        if (
            isinstance(value, type)
            and issubclass(value, ModelConfig)
            and value.__module__ == module.__name__
            and value.family_name() == name
        ):
            return value
    raise ImportError(f"jobspec/families/{package}.py defines no ModelConfig for family {name!r}")


MODEL_CONFIGS.update((name, _config_class(name, pkg)) for name, pkg in FAMILY_PACKAGES.items())


def _tag(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("family", DEFAULT_FAMILY)
    return getattr(value, "family", None)


def _by_family(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    # Anything but a config is validated by the family it names (a non-table by ModelConfig
    # itself, which says a table was expected).
    return handler(value) if isinstance(value, ModelConfig) else ModelConfig.model_validate(value)


AnyModelConfig = Annotated[
    Union[tuple(Annotated[cls, Tag(name)] for name, cls in MODEL_CONFIGS.items())],  # noqa: UP007
    Discriminator(_tag),
    WrapValidator(_by_family),
]
