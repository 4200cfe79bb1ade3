"""Job tests: the Ray cluster the ``cluster``-marked ones share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from jobs_support import RayCluster, started_cluster


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    """A head with 4 CPUs and a second node with 2."""
    yield from started_cluster(4, [2])
