"""A real local Ray cluster for a test module: `from ray_cluster import cluster` and ask for `cluster`."""

from __future__ import annotations

import shutil

import pytest
import ray


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One real local cluster for the module (2 CPUs, a bounded object store), everything it writes under the
    test's temp folder: its session folder (`_temp_dir`; a short path, its socket paths must fit 108 bytes),
    and no token file (Ray 2.60 otherwise writes ~/.ray/auth_token when it starts a cluster:
    ray/_private/authentication/authentication_token_setup.py, enable_token_auth_by_default). A pool's own
    `connect` then keeps this connection."""
    temp = tmp_path_factory.mktemp("ray")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=100 * 1024**2,
                 _temp_dir=str(temp), log_to_driver=False)
        yield
        ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)
