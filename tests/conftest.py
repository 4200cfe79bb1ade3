"""Shared test settings: ``cluster``-marked tests only when asked for, the repository root
as working directory, deterministic single-threaded torch (several ranks share 2 cores),
one embedded Ray that the tests needing a plain local Ray share, and the ``verlite`` command
run in this process; ``tests/user_code`` on the PYTHONPATH."""

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

# Tests name the repository's files as a user in its root does (configs/ppo_tiny.yaml), and
# some read them at import: the suite runs the same from any folder.
os.chdir(Path(__file__).resolve().parents[1])
torch.set_num_threads(1)

# User code that workers import by name (the environments of multi-turn runs): on the
# PYTHONPATH of this process and of the Ray it starts, as a user's would be.
USER_CODE = str(Path(__file__).resolve().parent / "user_code")
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [USER_CODE, os.environ.get("PYTHONPATH")]))
sys.path.insert(0, USER_CODE)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Tests that release the shared Ray for a Ray of their own run after every other test of
    # the process: amid the others, the next test on the shared Ray starts it again (6.5 s
    # measured). Stable: each group keeps its order. `make test`'s two processes take whole
    # files largest first instead (pytest-xdist's order, 40 s sooner in all than this one's),
    # so there the restart is paid once.
    items.sort(key=lambda item: item.get_closest_marker("releases_shared_ray") is not None)
    # A Ray of a test's own (a cluster, or an embedded one it breaks) costs many processes and
    # seconds to minutes on a 2-core machine: it runs when asked for (`-m cluster`, `make
    # test-cluster`, which CI runs), not in every `make test`.
    if "cluster" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="starts a Ray of its own; run with `make test-cluster`")
    for item in items:
        if item.get_closest_marker("cluster") is not None:
            item.add_marker(skip)


# The test being set up, run or torn down: SharedRay.release() checks its marker.
_running: pytest.Item | None = None


def pytest_runtest_setup(item: pytest.Item) -> None:
    global _running
    _running = item


# The shared Ray's size: tests/controller expects 4 CPUs in its resource messages.
SHARED_RAY_CPUS = 4


class SharedRay:
    """An embedded Ray started on first use and kept for the session: a start costs seconds,
    and a run or worker group cleans up its own actors and placement groups. A module that
    needs a cluster of its own calls :meth:`release` first, and is marked
    ``releases_shared_ray`` so that it runs after the tests that share this one."""

    def ensure(self) -> None:
        import ray

        from verlite.controller import start_ray

        if not ray.is_initialized():
            start_ray(None, num_cpus=SHARED_RAY_CPUS)

    def release(self) -> None:
        """Stop the shared Ray for a Ray of the running test's own; its module must be marked
        ``releases_shared_ray`` (amid the others, the next test would start this one again)."""
        if _running is not None and _running.get_closest_marker("releases_shared_ray") is None:
            raise RuntimeError(
                f"{_running.nodeid} releases the shared Ray: mark its module "
                "`pytestmark = pytest.mark.releases_shared_ray`"
            )
        self.stop()

    def stop(self) -> None:
        import sys

        ray = sys.modules.get("ray")  # never started when ray was never imported
        if ray is not None and ray.is_initialized():
            from verlite.controller import stop_ray

            stop_ray()


@pytest.fixture(scope="session")
def shared_ray() -> Iterator[SharedRay]:
    holder = SharedRay()
    yield holder
    holder.stop()


@pytest.fixture
def local_ray(shared_ray: SharedRay) -> SharedRay:
    """The shared embedded Ray, started if it is not running."""
    shared_ray.ensure()
    return shared_ray


@pytest.fixture
def verlite_main(
    capsys: pytest.CaptureFixture[str],
) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``verlite ARGS`` through ``verlite.cli.main`` in this process: its exit code, stdout and
    stderr. The same code path as the command, without a fresh interpreter's seconds of
    imports; tests of the command as a user runs it spawn it instead."""
    from verlite.cli import main

    def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
        argv = [str(a) for a in args]
        previous = signal.getsignal(signal.SIGTERM)  # main installs its own handler
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's errors
            code = exc.code if isinstance(exc.code, int) else 2
        finally:
            signal.signal(signal.SIGTERM, previous)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(argv, code, out, err)

    return run
