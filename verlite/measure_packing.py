"""``verlite measure-packing``: measure what a packed row costs on this machine and print the
``model.attention_crossover`` that balances the DP shares of packing roles by it
(``models.packing_cost``)."""

from __future__ import annotations

import argparse
import json
import sys

from verlite.arguments import int_from_to
from verlite.table import format_table

# The most tokens of a measured packed row (2^20): far beyond a worker's micro-batch, and each
# trial builds its row one sequence at a time, so a budget without a bound ran (and allocated)
# without one.
MAX_BUDGET = 2**20
# The most packed rows a measurement times: each is a timed forward and backward pass, one
# after another, so a count without a bound ran on for ever (--trials=1000000000). 1000 trials
# give the fit a standard error about a fifth of the default 40's.
MAX_TRIALS = 1000
# The fewest: a fit of 3 coefficients needs a fourth row to leave a residual.
MIN_TRIALS = 4


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``verlite measure-packing`` on the CLI's subparsers."""
    measure = subparsers.add_parser(
        "measure-packing",
        help="measure a packed row's cost on this machine: the model.attention_crossover to set",
        description="Time forward and backward passes of the configured policy over packed rows "
        "(sequences of 8 up to data.max_prompt_length + rollout.max_response_length tokens, up to "
        "the token budget a row) on the device the workers would use, in model.precision as "
        "training computes them, fit seconds ~ a x tokens + b x sum of squared lengths + c, "
        "and print a / b: the model.attention_crossover that "
        "balances the DP shares of packing roles by this measurement instead of the FLOP count.",
    )
    measure.add_argument("--config", required=True, help="run config YAML")
    measure.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted config overrides"
    )
    measure.add_argument(
        "--budget",
        type=int_from_to(1, MAX_BUDGET),
        default=None,
        help="most tokens of a packed row, at most 1048576 (default: actor.max_token_len_per_worker, "
        "or actor.micro_batch_size_per_worker x the longest sequence)",
    )
    measure.add_argument(
        "--trials",
        type=int_from_to(MIN_TRIALS, MAX_TRIALS),
        default=40,
        help=f"packed rows to time, {MIN_TRIALS} to {MAX_TRIALS} (default 40)",
    )
    measure.add_argument("--json", action="store_true", help="print one JSON object instead")
    measure.set_defaults(handler=cmd_measure_packing)


def cmd_measure_packing(args: argparse.Namespace) -> int:
    from verlite.config import ConfigError, check_inputs, load_config
    from verlite.config.checks import longest_sequence_fields

    cfg = load_config(args.config, args.overrides)
    check_inputs(cfg)  # one line for a model folder that is none, not the loader's traceback
    longest, fields = cfg.max_sequence_length, longest_sequence_fields(cfg)
    actor = cfg.actor
    budget = args.budget
    if longest > MAX_BUDGET:
        raise ConfigError(
            f"the longest sequence, {longest} tokens ({fields}), is over the {MAX_BUDGET} "
            "tokens a measured row may hold; measure-packing measures sequences of at most "
            "that length"
        )
    if budget is None:
        if actor.use_dynamic_bsz and actor.max_token_len_per_worker:
            budget = actor.max_token_len_per_worker
            source = f"actor.max_token_len_per_worker={budget}"
        else:
            budget = actor.micro_batch_size_per_worker * longest
            source = (
                f"actor.micro_batch_size_per_worker={actor.micro_batch_size_per_worker} x "
                f"{longest} tokens = {budget}"
            )
        if budget > MAX_BUDGET:
            raise ConfigError(
                f"--budget not given: its default, {source}, is over the {MAX_BUDGET} tokens a "
                f"measured row may hold; give --budget from {longest} to {MAX_BUDGET}"
            )
    if budget < longest:
        raise ConfigError(
            f"--budget={budget}: below the longest sequence, {longest} tokens ({fields}); "
            f"give {longest} to {MAX_BUDGET}"
        )
    from verlite.core import seeds
    from verlite.data.tokenizer import load_tokenizer
    from verlite.models import build_policy, hf_config, resolve_device
    from verlite.models.packing_cost import flop_crossover, measure_packed_cost
    from verlite.models.precision import check_precision_supported
    from verlite.models.support import window_passed
    from verlite.models.varlen import PackingUnsupported, enable_packing

    vocab_size = len(load_tokenizer(cfg.model.path, task=cfg.data.task))
    passed = window_passed(
        hf_config(cfg.model, vocab_size, longest),
        max_sequence_length=longest,
        fields=fields,
    )
    if passed is not None:  # before the weights load
        raise ConfigError(f"model: {passed}")
    device = resolve_device(cfg.model)
    check_precision_supported(cfg, on_gpu=device.type == "cuda")
    policy = build_policy(
        cfg.model,
        vocab_size=vocab_size,
        max_positions=longest,
        seed=seeds.policy_init(cfg.trainer.seed),
    ).to(device)
    try:
        enable_packing(policy)
    except PackingUnsupported as exc:
        raise ConfigError(f"model: {exc}") from None
    print(
        f"timing {args.trials} packed rows of up to {budget} tokens (sequences up to {longest}) "
        f"on {device}",
        file=sys.stderr,
    )

    def progress(done: int) -> None:
        print(f"\r  {done}/{args.trials}", end="\n" if done == args.trials else "", file=sys.stderr)

    cost = measure_packed_cost(
        policy,
        precision=cfg.precision,
        vocab_size=vocab_size,
        longest=longest,
        budget=budget,
        trials=args.trials,
        seed=cfg.trainer.seed,
        progress=progress,
    )
    counted = flop_crossover(cfg.model)
    if args.json:
        print(json.dumps({**vars(cost), "crossover": cost.crossover, "flop_crossover": counted}))
        return 0
    rows = [
        ("measure", "value"),
        ("per token", f"{cost.per_token * 1e6:.3g} us"),
        (
            "per squared length",
            f"{cost.per_squared_token * 1e9:.3g} ns (+- {cost.per_squared_token_error * 1e9:.2g})",
        ),
        ("fit R^2", f"{cost.r_squared:.3f} (tokens alone {cost.r_squared_tokens_only:.3f})"),
        ("crossover, measured", str(cost.crossover or "none: not told apart from noise")),
        ("crossover, FLOP count", str(counted)),
    ]
    print(format_table(rows))
    if cost.crossover is None:
        print("leave model.attention_crossover unset: the FLOP count serves")
    else:
        print(f"set model.attention_crossover={cost.crossover} to balance DP shares by this")
    return 0
