"""perf/mfu/* on the driver: each trained role's update FLOPs over its GPUs' bf16 peak, from
what rank 0 reports once at start-up; no figure on CPU or for a GPU the table lacks."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from verlite.config import load_config
from verlite.driver.trainer import mfu_metrics, mfu_peaks
from verlite.models.flops import DecoderShape
from verlite.records.tracking import ConsoleLogger

SHAPE = DecoderShape(dense_params=1000, attention_width=8, num_layers=2, head_params=100)


class _Group:
    """What mfu_peaks asks of a worker group: rank 0's profile and the placement."""

    def __init__(self, device_name: str | None, gpus: list[list[str]]) -> None:
        self.device_name, self.gpus, self.calls = device_name, gpus, 0

    def call(self, method: str, **kwargs: Any) -> tuple[str | None, DecoderShape]:
        assert (method, kwargs) == (
            "compute_profile",
            {"dispatch": "broadcast", "collect": "rank0"},
        )
        self.calls += 1
        return self.device_name, SHAPE

    def placement(self) -> list[dict[str, Any]]:
        return [{"node_id": "n", "gpu_ids": ids} for ids in self.gpus]


# 4 rows a step: the actor updates on 2 global mini-batches of 2 rows, the critic on 1 of 4.
SIZES = [
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=2",
    "actor.micro_batch_size_per_worker=1",
    "critic.ppo_mini_batch_size=4",
    "critic.micro_batch_size_per_worker=1",
]
# 5 tokens, 6 + 3 causal pairs and 1 real token in the responses (the last 2 columns, where
# the LM head runs) in each half of the batch.
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]).repeat(2, 1)


def _flops(rows: torch.Tensor) -> float:
    """One forward and backward pass of SHAPE over ``rows`` of MASK, by hand."""
    tokens, pairs, responses = {2: (5, 9, 1), 4: (10, 18, 2)}[len(rows)]
    return 3 * (2.0 * 900 * tokens + 2.0 * 100 * responses + 4.0 * 8 * 2 * pairs)


def test_the_update_flops_over_the_peak_of_the_roles_gpus() -> None:
    cfg = load_config("configs/ppo_tiny.yaml", [*SIZES, "actor.ppo_epochs=2"])
    actor, critic = _Group("NVIDIA H200", [["0"], ["1"]]), _Group("NVIDIA H200", [["0"]])
    peaks = mfu_peaks(cfg, {"actor": actor, "critic": critic})
    assert peaks == {"actor": (SHAPE, 2 * 989.4e12), "critic": (SHAPE, 989.4e12)}
    assert actor.calls == critic.calls == 1
    losses = {"actor": MASK[:, -2:], "critic": MASK[:, -2:]}
    flops = _flops(MASK)
    seconds = {"update_actor": 0.5, "update_critic": 0.25}
    assert mfu_metrics(cfg, peaks, MASK, losses, seconds, response_width=2) == {
        "perf/mfu/update": 2 * flops / (0.5 * 2 * 989.4e12),
        "perf/mfu/critic_update": flops / (0.25 * 989.4e12),
    }
    # A step whose actor did not update (critic warm-up) has no actor figure.
    only_critic = mfu_metrics(cfg, peaks, MASK, losses, {"update_critic": 0.25}, response_width=2)
    assert list(only_critic) == ["perf/mfu/critic_update"]


def test_a_mini_batch_the_update_skipped_costs_no_flops() -> None:
    """The overlong filter leaves the actor's first mini-batch (rows 0-1) without a loss token:
    the engine skips it, so only the second one's passes count; the critic, which still
    learns from every row, runs all of them. With every row filtered, the actor's update
    did no pass at all."""
    cfg = load_config("configs/ppo_tiny.yaml", SIZES)
    peaks = {"actor": (SHAPE, 1e12), "critic": (SHAPE, 1e12)}
    responses = MASK[:, -2:]
    filtered = responses * torch.tensor([0, 0, 1, 0]).unsqueeze(-1)
    seconds = {"update_actor": 0.5, "update_critic": 0.25}
    losses = {"actor": filtered, "critic": responses}
    assert mfu_metrics(cfg, peaks, MASK, losses, seconds, response_width=2) == {
        "perf/mfu/update": _flops(MASK[2:]) / (0.5 * 1e12),
        "perf/mfu/critic_update": _flops(MASK) / (0.25 * 1e12),
    }
    none = {"actor": torch.zeros_like(responses), "critic": responses}
    assert mfu_metrics(cfg, peaks, MASK, none, seconds, response_width=2)["perf/mfu/update"] == 0


def test_the_peak_override_and_what_logs_no_mfu(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config("configs/grpo_tiny.yaml", ["trainer.peak_tflops=100"])
    assert mfu_peaks(cfg, {"actor": _Group("Some GPU", [["0"]])}) == {"actor": (SHAPE, 100e12)}
    plain = load_config("configs/grpo_tiny.yaml")
    assert mfu_peaks(plain, {"actor": _Group(None, [[]])}) == {}  # CPU: nothing said
    assert capsys.readouterr().out == ""
    assert mfu_peaks(plain, {"actor": _Group("Some GPU", [["0"]])}) == {}
    said = (
        "perf/mfu: no bf16 peak known for 'Some GPU' (verlite.models.flops); set "
        "trainer.peak_tflops to log MFU\n"
    )
    assert capsys.readouterr().out == said
    # A role on a GPU the table lacks loses its figure, not the others theirs; said once.
    ppo = load_config("configs/ppo_tiny.yaml")
    mixed = {"actor": _Group("Some GPU", [["0"]]), "critic": _Group("NVIDIA H200", [["1"]])}
    assert mfu_peaks(ppo, mixed) == {"critic": (SHAPE, 989.4e12)}
    assert capsys.readouterr().out == said
    both = {"actor": _Group("Some GPU", [["0"]]), "critic": _Group("Some GPU", [["1"]])}
    assert mfu_peaks(ppo, both) == {}
    assert capsys.readouterr().out == said


def test_the_progress_line_shows_the_updates_mfu_when_there_is_one() -> None:
    stream = io.StringIO()
    console = ConsoleLogger(total_steps=2, stream=stream)
    console.log(1, {"critic/score/mean": 0.5, "perf/mfu/update": 0.3125})
    console.log(2, {"critic/score/mean": 0.5})  # CPU: no MFU, no field
    first, second = stream.getvalue().splitlines()
    assert "| score 0.5 | mfu 0.312 |" in first
    assert "mfu" not in second
