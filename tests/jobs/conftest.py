"""Job tests: skipping ``cluster``-marked tests unless asked for, and the Ray cluster they share."""

from __future__ import annotations

import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from jobs_support import RayCluster


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A cluster costs minutes and many processes on a 2-core machine: it runs when asked for
    # (`-m cluster`), not in every `make test`.
    if "cluster" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="starts a Ray cluster; run with `make test-cluster`")
    for item in items:
        if item.get_closest_marker("cluster") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    """A head with 4 CPUs and a second node with 2, token authentication on (RAY_AUTH_MODE=token,
    the token in a file named by RAY_AUTH_TOKEN_PATH, as the nodes and clients read it)."""
    token_dir = Path(tempfile.mkdtemp(prefix="vljtok", dir="/tmp"))
    token = secrets.token_hex(32)
    token_path = token_dir / "auth_token"
    token_path.write_text(token)
    token_path.chmod(0o600)
    cluster = RayCluster(token=token, token_path=token_path)
    cluster.temp_dirs.append(token_dir)
    try:
        cluster.start_head(num_cpus=4)
        cluster.add_node(num_cpus=2)
        yield cluster
    finally:
        cluster.stop()
