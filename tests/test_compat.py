"""The resume compatibility check: what it names, and keys added by a newer jaxjob."""

from __future__ import annotations

import pytest

from jobspec.errors import CheckpointError
from runtime.run.compat import check_compatible

SAVED = {"model.hidden_size": 64, "model.gemma4": None, "topology.process_count": 1}


def test_an_unset_setting_added_since_the_checkpoint_is_compatible() -> None:
    # A checkpoint from before `model.new_section` existed resumes while it stays unset.
    check_compatible(SAVED, {**SAVED, "model.new_section": None}, step=4)


def test_a_setting_added_since_the_checkpoint_and_set_is_named() -> None:
    with pytest.raises(CheckpointError, match=r"compatibility\.model\.new_section changed"):
        check_compatible(SAVED, {**SAVED, "model.new_section": {"x": 1}}, step=4)


def test_a_changed_value_or_topology_is_named() -> None:
    with pytest.raises(CheckpointError, match=r"compatibility\.model\.hidden_size changed .*64"):
        check_compatible(SAVED, {**SAVED, "model.hidden_size": 32}, step=4)
    with pytest.raises(CheckpointError, match="--reshard"):
        check_compatible(SAVED, {**SAVED, "topology.process_count": 2}, step=4)
    check_compatible(SAVED, {**SAVED, "topology.process_count": 2}, step=4, reshard=True)


def test_introduced_keys_take_the_value_an_older_checkpoint_implies() -> None:
    check_compatible(SAVED, {**SAVED, "model.scan_layers": False}, step=4)
    with pytest.raises(CheckpointError, match=r"model\.scan_layers changed"):
        check_compatible(SAVED, {**SAVED, "model.scan_layers": True}, step=4)
