"""What a packed row costs: the attention crossover the DP shares of a packing role use
(:func:`attention_crossover`), set, counted from FLOPs or measured on this machine
(``verlite measure-packing``).

A packed row of sequences of lengths L_i costs its weights, linear in its tokens, plus its
attention, in the sum of the squared lengths: about ``a x sum(L_i) + b x sum(L_i^2)``. The
DP shares of a packing role balance ``L + L^2 / crossover`` per row
(``step_batch.row_costs``), so ``crossover = a / b`` is all they need. Counted from FLOPs
(:func:`flop_crossover`) it misses how fast the attention kernels run against the
matrix multiplies on the hardware at hand; this module times forward and backward passes
of packed rows over the model itself and fits ``a``, ``b`` and a constant by least squares.

Trials are drawn so that tokens and squared lengths vary independently: each packs
sequences whose lengths are log-uniform below a ceiling that is itself drawn log-uniform
from the shortest to the longest sequence, up to a token total drawn below the budget.
"""

from __future__ import annotations

import copy
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from verlite.config import ModelConfig
from verlite.models import meta_causal_lm, probe_config
from verlite.models.flops import DecoderShape, attention_width
from verlite.models.precision import autocast
from verlite.models.varlen import KWARG, PackedAttention

SHORTEST = 8  # tokens of the shortest sequence a trial packs
REPEATS = 3  # timed passes of a trial (after one warm-up): the fastest counts


@dataclass(frozen=True)
class PackedCost:
    """``seconds ~ per_token x tokens + per_squared_token x sum(L^2) + constant``."""

    per_token: float
    per_squared_token: float
    per_squared_token_error: float  # its standard error
    constant: float
    r_squared: float  # of that fit
    r_squared_tokens_only: float  # of a fit without the squared term
    trials: int

    @property
    def crossover(self) -> int | None:
        """The length at which a token's attention costs what its weights do; None when the
        fit cannot tell a cost growing with the squared lengths apart from noise (less than
        two standard errors: attention too cheap to show, or lengths too alike to separate
        it from the tokens')."""
        if self.per_squared_token <= 2 * self.per_squared_token_error or self.per_token <= 0:
            return None
        return max(1, round(self.per_token / self.per_squared_token))


def trial_lengths(rng: random.Random, *, longest: int, budget: int) -> list[int]:
    """The sequence lengths of one trial's packed row (see the module's docstring)."""
    shortest = min(SHORTEST, longest)
    ceiling = _log_uniform(rng, shortest, longest)
    target = rng.randint(max(longest, budget // 4), budget)
    lengths: list[int] = []
    total = 0
    while True:
        length = _log_uniform(rng, max(shortest, ceiling // 4), ceiling)
        if total + length > target:
            return lengths or [length]
        lengths.append(length)
        total += length


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return min(high, round(math.exp(rng.uniform(math.log(low), math.log(high)))))


def measure_packed_cost(
    model: nn.Module,
    *,
    precision: str,
    vocab_size: int,
    longest: int,
    budget: int,
    trials: int,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
    progress: Callable[[int], None] | None = None,
) -> PackedCost:
    """Fit a packed row's cost on ``model`` (switched to packed attention, on its device):
    ``trials`` rows of sequences up to ``longest`` tokens, at most ``budget`` tokens a row,
    each timed through a forward and backward pass (the fastest of ``REPEATS``) computed as
    training computes them in ``precision`` (``model.precision`` resolved: under bf16-mixed
    the forward under bf16 autocast).
    ``progress`` is called with the number of trials done."""
    device = next(model.parameters()).device
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    features, seconds = [], []
    for trial in range(trials):
        lengths = trial_lengths(rng, longest=longest, budget=budget)
        tokens = torch.randint(vocab_size, (1, sum(lengths)), generator=generator).to(device)
        positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
        inputs = {
            "input_ids": tokens,
            "position_ids": positions,
            KWARG: PackedAttention.from_lengths(torch.tensor(lengths, device=device)),
        }
        _forward_backward(model, inputs, precision)  # warm-up
        best = math.inf
        for _ in range(REPEATS):
            start = clock()
            _forward_backward(model, inputs, precision)
            best = min(best, clock() - start)
        seconds.append(best)
        features.append([float(sum(lengths)), float(sum(n * n for n in lengths)), 1.0])
        if progress is not None:
            progress(trial + 1)
    x = torch.tensor(features, dtype=torch.float64)
    y = torch.tensor(seconds, dtype=torch.float64)[:, None]
    coef, fit, errors = _least_squares(x, y)
    _, tokens_only, _ = _least_squares(x[:, [0, 2]], y)
    return PackedCost(
        per_token=float(coef[0]),
        per_squared_token=float(coef[1]),
        per_squared_token_error=float(errors[1]),
        constant=float(coef[2]),
        r_squared=fit,
        r_squared_tokens_only=tokens_only,
        trials=trials,
    )


def _forward_backward(model: nn.Module, inputs: dict[str, Any], precision: str) -> None:
    device = inputs["input_ids"].device
    with autocast(precision, device):  # as TrainEngine.train_mini_batch runs a forward
        out = model(**inputs)
    getattr(out, "logits", out).float().mean().backward()
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _least_squares(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float, torch.Tensor]:
    """The coefficients of y ~ x, the fit's R^2 (1 for a y without variance) and the
    coefficients' standard errors (from the residuals' variance)."""
    coef = torch.linalg.lstsq(x, y, driver="gelsd").solution
    residual = float(((y - x @ coef) ** 2).sum())
    total = float(((y - y.mean()) ** 2).sum())
    variance = residual / max(1, x.shape[0] - x.shape[1])
    errors = (variance * torch.linalg.pinv(x.T @ x).diagonal()).clamp(min=0).sqrt()
    return coef[:, 0], 1.0 - residual / total if total > 0 else 1.0, errors


def attention_crossover(cfg: ModelConfig) -> int:
    """The sequence length at which a token's causal attention costs what its weights do in
    a packed row, so that a packed row of sequences L_i costs about sum(L_i + L_i^2 /
    crossover) token-equivalents (``step_batch.row_costs``): ``model.attention_crossover``
    when set (measured by ``verlite measure-packing``, :func:`measure_packed_cost`), else
    :func:`flop_crossover`."""
    if cfg.attention_crossover is not None:
        return cfg.attention_crossover
    return flop_crossover(cfg)


def flop_crossover(cfg: ModelConfig) -> int:
    """The attention crossover counted from FLOPs: one decoder layer's parameters over its
    attention width, heads x head dim (a token's weight FLOPs are 6 x parameters; its share
    of causal attention over a sequence of length L, 6 x heads x head dim x L per layer:
    ``flops.DecoderShape``'s count, of a Mixture-of-Experts layer the experts a token is
    sent to). Counted on models of 1 and 2 layers built on the meta device: no memory, any
    architecture."""
    config = probe_config(cfg)
    counts = []
    for layers in (1, 2):
        config = copy.deepcopy(config)
        config.num_hidden_layers = layers
        model = meta_causal_lm(config)
        counts.append(DecoderShape.of(model).dense_params)
    return max(1, round((counts[1] - counts[0]) / attention_width(config)))
