"""Shared fixtures: access to the cached real model, skipped when it is not available."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rhymerl.model.fetch import cached_builtin_dir, resolve_model_dir


def _model_required() -> bool:
    # scripts/test.sh sets this so CI fails loudly instead of silently skipping.
    return os.environ.get("RHYMERL_REQUIRE_MODEL", "") not in ("", "0")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """Directory of the converted smollm2-135m model.

    Skips unless the model is already cached, so plain `pytest` stays offline and fast;
    with RHYMERL_REQUIRE_MODEL=1 it fetches (if needed) and never skips.
    """
    if not _model_required() and cached_builtin_dir("smollm2-135m") is None:
        pytest.skip("smollm2-135m not cached (run scripts/setup.sh or set RHYMERL_REQUIRE_MODEL=1)")
    return resolve_model_dir("smollm2-135m")


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """One real local Ray cluster for the whole session (tests/ray_cluster.py), started by the first test that
    asks for it. Ray is imported only then, so a session without Ray tests never imports it."""
    from ray_cluster import local_cluster

    with local_cluster(tmp_path_factory.mktemp("ray")) as address:
        yield address  # host:port, for a child process (`ray.address`)


def pytest_collection_modifyitems(items):
    # Anything using the real model is a real_model test, so `-m "not real_model"` deselects it.
    for item in items:
        if "smollm2_dir" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real_model)
