"""Fixtures the fault tests share."""

import pytest

from tests.faults.fault_helpers import cfg_for
from train.loop import run


@pytest.fixture(scope="module")
def trained(target_dir, tmp_path_factory):
    """A finished two-step EAGLE-3 run on the tiny target (one per test module)."""
    out = tmp_path_factory.mktemp("trained_run")
    run(cfg_for(target_dir, out, "train.steps=2"))
    return out
