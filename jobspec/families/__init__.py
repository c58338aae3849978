"""The model families' contracts: one module per family (its `ModelConfig` subclass: `family`,
own keys and checks, HF config.json both ways), registered here in `FAMILIES`.

`AnyModelConfig` is `RunConfig.model`: pydantic's union of every family's class keyed on
`family`, so the JSON Schema documents each. A table is validated by its family's own class,
so an error names `model.<key>` (the union's tag never enters the path). The runtime's side
of a family (its modules, HF name map and counts) is `runtime/model/<family>/`.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import (
    Discriminator,
    Tag,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)

from jobspec.families.gemma4_text import Gemma4TextModelConfig
from jobspec.families.model_config import DEFAULT_FAMILY, FAMILIES, ModelConfig
from jobspec.families.qwen2 import Qwen2ModelConfig
from jobspec.families.qwen3 import Qwen3ModelConfig
from jobspec.families.qwen3_moe import Qwen3MoeModelConfig
from jobspec.families.qwen3_next import Qwen3NextModelConfig

FAMILIES.update(
    (cls.family_name(), cls)
    for cls in (
        Qwen3ModelConfig,
        Qwen3MoeModelConfig,
        Gemma4TextModelConfig,
        Qwen3NextModelConfig,
        Qwen2ModelConfig,
    )
)


def _tag(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("family", DEFAULT_FAMILY)
    return getattr(value, "family", None)


def _by_family(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    # Anything but a config is validated by the family it names (a non-table by ModelConfig
    # itself, which says a table was expected).
    return handler(value) if isinstance(value, ModelConfig) else ModelConfig.model_validate(value)


AnyModelConfig = Annotated[
    Union[tuple(Annotated[cls, Tag(name)] for name, cls in FAMILIES.items())],  # noqa: UP007
    Discriminator(_tag),
    WrapValidator(_by_family),
]
