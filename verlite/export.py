"""``verlite export RUN_DIR``: what a run's exported policy is, and ``--merge`` to fold a LoRA
policy's adapters into full weights.

A run ends with its policy in ``RUN_DIR/hf_actor`` (``Trainer.export_policy``): full weights
in Hugging Face format, or with ``actor.lora`` a peft adapter folder with the base it applies
to (``models.lora.save_adapter``). ``--merge`` writes the base with ``B A`` added to its
weights, a plain Hugging Face model (and the tokenizer) that needs no peft to load. Each
folder's report says when its tokenizer carries a chat template, the prompt format a run with
``data.chat_template`` trained on. Torch, transformers and peft load only for ``--merge`` (and
torch for an incomplete export's error, which says what a new run of the folder does).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from verlite.arguments import path
from verlite.errors import UserError, shown
from verlite.policy_folder import MERGED_FOLDER, POLICY_FOLDER, policy_exported
from verlite.user_files import resolved_path

ADAPTER_CONFIG = "adapter_config.json"  # what marks a peft adapter folder
MODEL_CONFIG = "config.json"  # and a folder of full weights
# Where a saved tokenizer keeps its chat template: a file of its own (transformers >= 4.47),
# or a key of its tokenizer_config.json (earlier ones).
CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
RUN_CONFIG = "config.json"  # the run's settings, as its jsonl logger wrote them


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``verlite export`` on the CLI's subparsers."""
    parser = subparsers.add_parser(
        "export",
        help="say what a run exported; --merge folds a LoRA adapter into full weights",
        description="Print what RUN_DIR/hf_actor holds: full weights, or a peft LoRA adapter "
        "folder (loadable with peft's PeftModel.from_pretrained on its base) and its base. "
        "With --merge, write the adapter folded into its base's weights as a plain Hugging "
        f"Face model with the tokenizer, to RUN_DIR/{MERGED_FOLDER} or --out.",
    )
    parser.add_argument(
        "run_dir", metavar="RUN_DIR", type=path, help="a finished run's output folder"
    )
    parser.add_argument(
        "--merge", action="store_true", help="write the merged weights of a LoRA policy"
    )
    parser.add_argument(
        "--out",
        default=None,
        type=path,
        help=f"with --merge, a new folder (default RUN_DIR/{MERGED_FOLDER})",
    )
    parser.set_defaults(handler=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    if args.out is not None and not args.merge:
        raise UserError(f"--out {shown(args.out)}: names where --merge writes; add --merge")
    # a link loop is one line that says so, not a missing folder
    resolved = resolved_path(args.run_dir, shown(args.run_dir))
    if resolved.is_file():
        raise UserError(
            f"{shown(args.run_dir)} is a file; give a run's folder (trainer.output_dir)"
        )
    if not resolved.is_dir():  # a mistyped folder: not a run still to finish
        raise UserError(f"no such folder: {shown(args.run_dir)}")
    policy = Path(args.run_dir) / POLICY_FOLDER
    if not policy.is_dir():
        raise UserError(
            f"{shown(args.run_dir)}: holds no exported policy ({POLICY_FOLDER}/ is missing; "
            f"{_why_no_policy(resolved)})"
        )
    if not policy_exported(Path(args.run_dir)):
        # Torch loads for this error alone (the checkpoints' folder contract imports it).
        from pydantic import ValidationError

        from verlite.config import TrainerConfig
        from verlite.driver.output_folder import stopped_run_hint

        settings = _run_settings(Path(args.run_dir), "trainer")  # as its config.json has them
        try:
            trainer = TrainerConfig.model_validate(settings) if settings else None
        except ValidationError:
            trainer = None  # unknown: not guessed
        raise UserError(
            f"{shown(str(policy))}: incomplete: the run stopped (or runs) before it exported its "
            f"last policy whole; {stopped_run_hint(args.run_dir, trainer)}"
        )
    adapter_config = policy / ADAPTER_CONFIG
    if not adapter_config.is_file() and not (policy / MODEL_CONFIG).is_file():
        # said to be full weights before: an emptied or hand-made folder
        raise UserError(
            f"{shown(str(policy))}: holds neither full weights ({MODEL_CONFIG}) nor a LoRA "
            f"adapter ({ADAPTER_CONFIG}); it is no policy a run exported"
        )
    if not adapter_config.is_file():
        if args.merge:
            raise UserError(
                f"{shown(str(policy))}: holds full weights, not a LoRA adapter; --merge applies to runs "
                "with actor.lora.rank > 0"
            )
        print(f"{policy}: full weights (Hugging Face format)")
        _say_chat_template(policy, Path(args.run_dir))
        return 0
    try:
        config = json.loads(adapter_config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(
            f"{shown(str(adapter_config))}: not a readable peft adapter config ({exc})"
        ) from None
    if not isinstance(config, dict):
        kinds = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
        kind = kinds.get(type(config), "a number")
        raise UserError(
            f"{shown(str(adapter_config))}: not a readable peft adapter config ({kind}, not a JSON "
            "object)"
        )
    if not args.merge:
        print(
            f"{policy}: LoRA adapter (peft, rank {config.get('r')}) over the base "
            f"{config.get('base_model_name_or_path')}; --merge writes merged weights"
        )
        _say_chat_template(policy, Path(args.run_dir))
        return 0
    out = Path(args.out) if args.out else Path(args.run_dir) / MERGED_FOLDER
    resolved_path(out, f"--out {shown(str(out))}")  # a link loop: one line that says so
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(
            f"--out {shown(str(out))}: exists and is not an empty folder; name a new folder"
        )
    from transformers import AutoTokenizer
    from transformers.utils import logging as transformers_logging

    from verlite.models.lora import merge_adapter

    transformers_logging.disable_progress_bar()  # the command says what it wrote, in one line

    merge_adapter(policy, out)
    AutoTokenizer.from_pretrained(str(policy)).save_pretrained(str(out))
    print(f"{out}: merged weights (Hugging Face format)")
    _say_chat_template(out, Path(args.run_dir))
    return 0


def _why_no_policy(run_dir: Path) -> str:
    """Why a run folder (``run_dir``, resolved) has no policy: it is the policy folder itself
    (``hf_actor``, or the merged one), not the run's; a run with ``trainer.export=false`` (its
    logged ``config.json`` says so) never writes one; any other writes it when it finishes."""
    if run_dir.name in (POLICY_FOLDER, MERGED_FOLDER):
        return (
            f"this is the exported policy itself: give its run folder, {shown(str(run_dir.parent))}"
        )
    if _run_settings(run_dir, "trainer").get("export") is False:
        return "the run has trainer.export=false, which exports none"
    return "a run exports it when it finishes"


def _run_settings(run_dir: Path, section: str) -> dict[str, Any]:
    """A section of the run's logged ``config.json``; empty where unreadable."""
    try:
        config = json.loads((run_dir / RUN_CONFIG).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        config = None
    settings = config.get(section) if isinstance(config, dict) else None
    return settings if isinstance(settings, dict) else {}


def _say_chat_template(folder: Path, run_dir: Path) -> None:
    """One line when the tokenizer saved in ``folder`` carries a chat template: the call that
    renders the prompts the run trained on, with the template variables it set
    (``data.chat_template_kwargs``, from its ``config.json``)."""
    if not (folder / CHAT_TEMPLATE_FILE).is_file():
        try:
            config = json.loads((folder / TOKENIZER_CONFIG).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return
        if not (isinstance(config, dict) and config.get("chat_template")):
            return
    variables = _run_settings(run_dir, "data").get("chat_template_kwargs")
    arguments = (
        "".join(f", {name}={value!r}" for name, value in variables.items())
        if isinstance(variables, dict)
        else ""
    )
    print(
        f"{folder}: its tokenizer has a chat template; generate from "
        f"tokenizer.apply_chat_template(messages, add_generation_prompt=True{arguments}), the "
        "prompts a run with data.chat_template=true trained on"
    )
