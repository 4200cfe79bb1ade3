"""DAPO's overlong filter (``algorithm.overlong.filter``) in whole runs: the rows it leaves out
carry no loss and are not counted. Every response of a run that ignores EOS reaches the limit,
so every actor update has no token to count and is skipped, while the critic still learns from
them; a multi-turn trajectory cut short by ``max_turns`` is left out as well."""

from pathlib import Path

from verlite.config import load_config
from verlite.driver.preflight import RunInputs
from verlite.driver.run import run

FILTER = ("algorithm.overlong.filter=true", "trainer.total_steps=2", "trainer.val_freq=0")


def test_rows_at_the_limit_leave_the_policy_loss_and_its_counts(
    tmp_path: Path, train, metrics
) -> None:
    cfg = train(tmp_path, *FILTER, "rollout.ignore_eos=true")
    updates = cfg.role_sizes("actor").num_mini_batches
    for record in metrics(tmp_path):
        assert record["response_length/clip_ratio"] == 1.0
        assert record["response_length/overlong_filtered"] == 1.0
        assert record["actor/skipped_updates"] == updates  # no token left to count
        assert record.get("critic/skipped_updates", 0.0) == 0.0  # the critic still learns
        assert "critic/vf_loss" in record


def test_multi_turn_trajectories_cut_short_leave_the_policy_loss(
    tmp_path: Path, local_ray, metrics
) -> None:
    # one turn only: a trajectory whose turn calls the tool is cut short, out of turns
    records = _tool_run(tmp_path, metrics, "rollout.multi_turn.max_turns=1")
    assert any(r["multiturn/truncated"] > 0 for r in records)
    for record in records:  # no turn reaches the response area's width here
        assert record["response_length/clip_ratio"] == 0.0
        assert record["response_length/overlong_filtered"] == record["multiturn/truncated"]


def test_multi_turn_trajectories_that_fill_their_room_reach_the_limit(
    tmp_path: Path, local_ray, metrics
) -> None:
    """A response area of 6 tokens: a call of up to 4 and its observation fill it, and the
    filter leaves such a trajectory out as a response at the limit, whose share is
    ``response_length/clip_ratio``. Its policy tokens alone (what ``response_length/mean``
    counts) never reach the area's width: measured by them, the share was 0 while the filter
    left rows out for their length. (Such a trajectory is cut short too: the turn after the
    observation draws the token past its room of 0, and it is no end. That token used to be
    drawn only when a row beside it had room left, so whether the trajectory counted as cut
    short depended on its neighbours.)"""
    records = _tool_run(tmp_path, metrics, "rollout.multi_turn.max_total_length=14")
    assert any(r["response_length/clip_ratio"] > 0 for r in records)
    for record in records:
        at_limit, truncated = record["response_length/clip_ratio"], record["multiturn/truncated"]
        assert at_limit <= record["response_length/overlong_filtered"] <= at_limit + truncated


def _tool_run(tmp_path: Path, metrics, *overrides: str) -> list[dict]:
    """The metrics of a multi-turn run of the tool task with the overlong filter on."""
    cfg = load_config(
        "configs/tool_tiny.yaml",
        [
            f"trainer.output_dir={tmp_path}",
            *FILTER,
            *overrides,
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=32",
        ],
    )
    run(cfg, RunInputs.load(cfg))
    return metrics(tmp_path)
