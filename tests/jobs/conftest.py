"""Job tests: the Ray cluster the ``cluster``-marked ones share."""

from __future__ import annotations

import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from jobs_support import RayCluster


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
