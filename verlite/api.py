"""The Python API: run a job and read its metrics from a notebook or a sweep script, without
the command line.

    import verlite

    cfg = verlite.load_config("configs/ppo_tiny.yaml", {"trainer.total_steps": 5})
    out = verlite.train(cfg, ["trainer.output_dir=outputs/trial-1"])
    steps = verlite.read_metrics(out)

Bad input raises :class:`~verlite.errors.UserError` (a :class:`~verlite.config.ConfigError`
for the config) and a run that stopped raises :class:`~verlite.errors.RunFailure`, each with
the one-line message the command line prints. Ray and the models load on the first
:func:`train`, not on ``import verlite``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from verlite.config import Config, check_paths
from verlite.config.loading import ConfigSource, Overrides
from verlite.config.loading import load_config as _load_config
from verlite.memory import retain_freed_memory
from verlite.records import metrics_log
from verlite.redaction import redacted_output

if TYPE_CHECKING:
    import pandas


def load_config(config: ConfigSource = None, overrides: Overrides = ()) -> Config:
    """A checked run config from a YAML file's path, a mapping of sections, or a config loaded
    before, with ``overrides``: dotted keys to values (``{"trainer.total_steps": 5}``) or
    ``key=value`` strings as on the command line (``["trainer.total_steps=5"]``)."""
    return _load_config(config, overrides)


def train(config: ConfigSource, overrides: Overrides = ()) -> Path:
    """Run a training job in this process, as ``verlite train`` does; the output folder.

    It runs in this process's Ray session when one is open (``ray.init`` called before),
    else in a session of its own: an embedded local Ray, or ``trainer.ray_address``."""
    cfg = load_config(config, overrides)
    check_paths(cfg)  # before Ray starts: a typo should cost a second, not a cluster start
    from verlite.driver.run import run_training  # Ray and the models load once it is good

    retain_freed_memory()  # the driver gathers and scatters every step batch
    with redacted_output():  # what the run prints, as `verlite train` prints it
        return run_training(cfg)


@overload
def read_metrics(run: str | Path, *, as_frame: Literal[False] = False) -> list[dict[str, Any]]: ...


@overload
def read_metrics(run: str | Path, *, as_frame: Literal[True]) -> pandas.DataFrame: ...


def read_metrics(run: str | Path, *, as_frame: bool = False) -> Any:
    """The steps a run logged (its folder, or its ``metrics.jsonl``), one dict per step in
    step order with the key ``step``; with ``as_frame=True`` a pandas DataFrame indexed by
    step (needs the ``pandas`` extra)."""
    records = metrics_log.read(run)
    if not as_frame:
        return records
    from verlite.errors import import_extra

    pd = import_extra("pandas", feature="read_metrics(as_frame=True)", extra="pandas")
    return pd.DataFrame.from_records(records).set_index("step")
