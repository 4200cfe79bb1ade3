"""The packed cost measurement (``verlite measure-packing``, ``models.packing_cost``): its
trials and fit recover a known cost law exactly, refuse a squared term that is not there, and
the command prints the crossover to configure; the configured one is what DP shares use."""

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from torch import nn

from verlite.cli import main
from verlite.config import load_config
from verlite.models.packing_cost import (
    attention_crossover,
    flop_crossover,
    measure_packed_cost,
    trial_lengths,
)
from verlite.models.varlen import KWARG, PackedAttention

CONFIG = "configs/grpo_tiny.yaml"


class CostLaw(nn.Module):
    """A stand-in model whose every pass advances a clock by a known cost of its packed row:
    per_token x tokens + per_square x sum of squared lengths + a constant, plus noise of up to
    ``jitter`` seconds."""

    def __init__(
        self, per_token: float, per_square: float, jitter: float = 0.0, seed: int = 0
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))
        self.per_token, self.per_square, self.jitter = per_token, per_square, jitter
        self.noise = random.Random(seed)
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, **kwargs: object):
        packed = kwargs[KWARG]
        assert isinstance(packed, PackedAttention)
        lengths = torch.cat([group.real[0].bincount() for group in packed.groups]).double()
        assert int(lengths.sum()) == input_ids.shape[1]
        cost = 1e-3 + self.per_token * float(lengths.sum())
        cost += self.per_square * float((lengths**2).sum())
        self.now += cost + self.jitter * self.noise.uniform(-1, 1)
        return self.weight * input_ids.double()


def measure(model: CostLaw, **kwargs: int):
    settings = {"vocab_size": 50, "longest": 512, "budget": 2048, "trials": 12} | kwargs
    return measure_packed_cost(model, precision="fp32", clock=model.clock, **settings)


def test_the_fit_recovers_the_crossover_of_a_known_cost_law() -> None:
    cost = measure(CostLaw(per_token=2e-6, per_square=2e-6 / 700))
    assert cost.crossover == 700
    assert cost.r_squared == pytest.approx(1.0)
    assert cost.constant == pytest.approx(1e-3, rel=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_no_crossover_when_the_cost_does_not_grow_with_squared_lengths(seed: int) -> None:
    """Noise alone fits some squared term, of either sign: within its standard errors."""
    cost = measure(CostLaw(2e-6, 0.0, jitter=2e-4, seed=100 + seed), seed=seed)
    assert cost.crossover is None


def test_a_noisy_measurement_still_finds_the_crossover() -> None:
    cost = measure(CostLaw(per_token=2e-6, per_square=2e-6 / 700, jitter=2e-4), trials=40)
    assert cost.crossover == pytest.approx(700, rel=0.2)


def test_trials_respect_the_budget_and_the_longest_sequence_and_vary_in_shape() -> None:
    rng = random.Random(0)
    rows = [trial_lengths(rng, longest=300, budget=1000) for _ in range(40)]
    assert all(sum(row) <= 1000 and max(row) <= 300 and min(row) >= 8 for row in rows)
    # The squared lengths per token spread widely, so the fit can tell them from tokens.
    spread = [sum(n * n for n in row) / sum(row) for row in rows]
    assert max(spread) > 8 * min(spread)


def test_the_configured_crossover_is_the_one_dp_shares_use() -> None:
    counted = load_config(CONFIG).model
    assert attention_crossover(counted) == flop_crossover(counted) == 578
    measured = load_config(CONFIG, ["model.attention_crossover=321"]).model
    assert attention_crossover(measured) == 321


def test_measure_packing_prints_the_crossover_to_configure(capsys) -> None:
    args = ["measure-packing", "--config", CONFIG, "--trials", "6", "--budget", "96", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trials"] == 6 and out["flop_crossover"] == 578
    assert out["crossover"] is None or out["crossover"] > 0


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("fp32", torch.float32), ("bf16-mixed", torch.bfloat16), ("bf16", torch.bfloat16)],
)
def test_measure_packing_times_the_products_in_the_runs_precision(
    precision: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """Training runs a bf16-mixed forward under bf16 autocast, its matrix products in bf16
    (``TrainEngine.train_mini_batch``): the passes measure-packing times must too. It timed
    fp32 products under bf16-mixed, on a GPU a cost law of other kernels than the run's.
    Every linear layer of the measured policy (the real one, built as the command builds
    it) is watched in the timed passes, which run backward (the check that packed sequences
    stay apart, before them, runs without gradients)."""
    import verlite.models

    seen: set[torch.dtype] = set()
    build = verlite.models.build_policy

    def watched(*args, **kwargs) -> nn.Module:
        policy = build(*args, **kwargs)
        for module in policy.modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(
                    lambda _m, _i, out: seen.add(out.dtype) if torch.is_grad_enabled() else None
                )
        return policy

    monkeypatch.setattr(verlite.models, "build_policy", watched)
    args = ["measure-packing", "--config", CONFIG, f"model.precision={precision}"]
    assert main([*args, "--trials", "4", "--budget", "24", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["trials"] == 4
    assert seen == {dtype}


def test_measure_packing_on_a_gpu_without_bf16_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """On cuda ``model.precision=auto`` is bf16-mixed, which such a GPU only emulates (CUDA
    autocast would turn itself off there and time fp32): refused before a model is built,
    in the line ``verlite train`` gives."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "Tesla T4")
    assert main(["measure-packing", "--config", CONFIG, "model.device=cuda"]) == 2
    assert capsys.readouterr().err == (
        "verlite: error: model.precision=auto (which is bf16-mixed on cuda): the workers' GPU "
        "(Tesla T4) has no bf16 arithmetic; set model.precision=fp32\n"
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        # the fit's 4 rows at least, refused as every other count outside the range
        (["--trials", "3"], "argument --trials: expected an integer from 4 to 1000, got '3'"),
        (["--budget", "5"], "--budget=5: below the longest sequence, 12 tokens (data."),
        (["--budget", "5"], "; give 12 to 1048576\n"),
        # A multi-turn config's longest row is its whole trajectory, named by its own field.
        (
            ["--config", "configs/tool_tiny.yaml", "--budget", "5"],
            " tokens (rollout.multi_turn.max_total_length); give ",
        ),
        # A row of 2^20 tokens at most (measure_packing.MAX_BUDGET): a budget of 10^12 ran on
        # for ever, building each trial's row one sequence at a time.
        (["--budget", "1048577"], "argument --budget: expected an integer from 1 to 1048576"),
        (["--budget", "10**12"], "expected an integer from 1 to 1048576, got '10**12'"),
        (
            ["actor.use_dynamic_bsz=true", "actor.max_token_len_per_worker=1000000000"],
            "--budget not given: its default, actor.max_token_len_per_worker=1000000000, is "
            "over the 1048576 tokens a measured row may hold; give --budget from 12 to 1048576",
        ),
        # No budget could hold a row of the longest sequence (the range above would be backwards).
        (
            ["data.max_prompt_length=1048570", "rollout.max_response_length=8"],
            "the longest sequence, 1048578 tokens (data.max_prompt_length + rollout.max_response_",
        ),
        (["--trials", "zero"], "expected an integer from 4 to 1000, got 'zero'"),
        # 1000 trials at most (measure_packing.MAX_TRIALS): --trials=1000000000 timed rows
        # for ever, one after another (18 in 40 s here, and on).
        (["--trials", "1001"], "argument --trials: expected an integer from 4 to 1000"),
        (["--trials", "1000000000"], "4 to 1000, got '1000000000'"),
        (["model.path=/nonexistent/model"], "model.path='/nonexistent/model': no such file"),
        (["model.path=/"], "model.path='/' is not a Hugging Face model directory"),
        (["--config", ""], "config file: an empty path names no file"),
        (["--config", "/"], "cannot read config file '/': Is a directory"),
        (["--config", "/nonexistent/\udcff.yaml"], "'/nonexistent/\\udcff.yaml': No such file"),
    ],
)
def test_measure_packing_refuses_bad_flags_in_one_line(flags, message, capsys) -> None:
    try:
        code = main(["measure-packing", "--config", CONFIG, *flags])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_command_that_loads_model_path_shows_no_hugging_face_progress_bars(tmp_path) -> None:
    """`verlite measure-packing` (and check-invariance, whose spawned ranks inherit it) load
    model.path outside Ray's workers: transformers' "Loading weights" bar stays off the
    console, as it does for `verlite train`."""
    from verlite.data import load_tokenizer
    from verlite.models import build_policy

    tokenizer = load_tokenizer(None, task="copy")
    config = load_config(CONFIG)
    build_policy(config.model, vocab_size=len(tokenizer), max_positions=64, seed=0).save_pretrained(
        tmp_path
    )
    tokenizer.save_pretrained(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    args = ["--config", CONFIG, f"model.path={tmp_path}", "--trials", "4", "--budget", "64"]
    done = subprocess.run(
        [sys.executable, "-m", "verlite.cli", "measure-packing", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "Loading weights" not in done.stdout + done.stderr, done.stderr


def test_measure_packing_refuses_a_window_its_sequences_pass_in_one_line(tmp_path, capsys) -> None:
    """A Mistral whose window (8) is shorter than the longest sequence: packed attention
    applies no window, so the measurement is refused before it times a row (it would raise
    in the first one)."""
    from tests.model_support import tiny_sliding
    from verlite.data import load_tokenizer

    tokenizer = load_tokenizer(None, task="copy")
    tiny_sliding("mistral", 8, vocab_size=len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    longest = load_config(CONFIG).max_sequence_length
    code = main(["measure-packing", "--config", CONFIG, f"model.path={tmp_path}", "--trials", "4"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "Loading weights" not in err  # refused before the weights load
    assert err.splitlines()[-1] == (
        "verlite: error: model: 2 of the model's 2 layers attend through a sliding window of 8 "
        "tokens (sliding_window), and a sequence can be data.max_prompt_length + "
        f"rollout.max_response_length = {longest} tokens; packed attention applies no window, "
        "which is the model's attention only for sequences of at most 8 tokens"
    )
