"""A real local Ray cluster for the test session: tests/conftest.py's `cluster` fixture starts it (once, at the
first test that asks for `cluster`) and stops it when the session ends."""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
import ray


@contextmanager
def local_cluster(temp: Path):
    """Its address (host:port, for a child process's `ray.address`): a real local cluster (2 CPUs, a bounded object store), everything it writes under `temp`, a test's temp
    folder: its session folder (`_temp_dir`; a short path, its socket paths must fit 108 bytes), and no token
    file (Ray 2.60 otherwise writes ~/.ray/auth_token when it starts a cluster:
    ray/_private/authentication/authentication_token_setup.py, enable_token_auth_by_default). A pool's own
    `connect` then keeps this connection, and a pool's `close` ends its actors, never the cluster: each test
    module ends the pools it started (module-scoped fixtures), so the next module finds the 2 CPUs free.
    Started once per session rather than once per module: a start and a stop cost seconds each on 2 cores."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_AUTH_MODE", "disabled")
        context = ray.init(address="local", num_cpus=2, include_dashboard=False,
                           object_store_memory=100 * 1024**2, _temp_dir=str(temp), log_to_driver=False)
        try:
            yield context.address_info["gcs_address"]
        finally:
            ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)
