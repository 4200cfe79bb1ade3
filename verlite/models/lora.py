"""LoRA adapters on the policy (``actor.lora``), through ``peft`` (the ``lora`` extra).

The policy becomes a ``peft`` model: its base weights frozen, a low-rank update ``B A``
(``alpha / rank`` times) trained beside each targeted linear layer. ``B`` starts at zero, so
the initial policy is the base model, and the base model is the reference: the same module
with its adapters off (:func:`adapters_disabled`), not a second copy of the weights.

What a run changes is the adapters alone, so they are all that a checkpoint saves
(``distributed.sharded_state`` skips frozen parameters), that a weight sync sends
(``generation.weights.split_frozen``) and that the export writes (a ``peft`` adapter folder, beside the
base it applies to; ``verlite export --merge`` folds it into full weights).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.pytorch_utils import Conv1D
from transformers.utils import GENERATION_CONFIG_NAME

from verlite.base_weights import check_export_base
from verlite.config import ConfigError, LoraConfig
from verlite.errors import UserError, import_extra, shown

# Where the export puts the base model an adapter applies to, when the run built it from a
# seed (the built-in model; a model.path base is referred to by its path).
BASE_FOLDER = "base"


def _peft() -> Any:
    return import_extra("peft", feature="actor.lora (rank > 0)", extra="lora")


def check_peft_installed(cfg: LoraConfig) -> None:
    """At start-up: ``actor.lora.rank > 0`` needs ``peft``; one line naming the extra."""
    if cfg.rank > 0:
        _peft()


def apply_lora(model: nn.Module, cfg: LoraConfig, *, seed: int) -> nn.Module:
    """``model`` with adapters on ``cfg.target_modules`` (a ``peft`` model whose base
    weights are frozen). ``A`` is drawn from ``seed``: every rank of a group, and a rollout
    worker, build the same adapters."""
    peft = _peft()
    torch.manual_seed(seed)
    lora = peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        task_type="CAUSAL_LM",
    )
    with _peft_wrapping():
        wrapped: nn.Module = peft.get_peft_model(model, lora)
    return wrapped


@contextlib.contextmanager
def _peft_wrapping() -> Iterator[None]:
    """Where peft wraps a model (training's adapters, ``verlite export --merge``'s load):
    peft 0.21 asks transformers 5 a deprecated question (``is_gradient_checkpointing``), a
    FutureWarning nothing a user can act on, which would be the merge's only other output."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        # An adapter on a head tied to the embedding: peft warns that merging it would
        # change the embedding too, which ``merge_adapter`` prevents (``_untie_adapted_head``).
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings=True.*")
        # It adapts a GPT-2 Conv1D as its transposed weight asks, and says so.
        warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")
        yield


# The linear layers peft adapts: torch's, and GPT-2's Conv1D (a linear layer whose weight is
# stored transposed; peft sets its fan_in_fan_out for it).
_LINEAR = (nn.Linear, Conv1D)


def check_targets(model: nn.Module, cfg: LoraConfig) -> None:
    """Every name of ``actor.lora.target_modules`` must name a linear layer of ``model`` (a
    meta-device model will do: only names are read); peft's own error comes from a worker,
    after Ray has started."""
    linear = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, _LINEAR) and name
    }
    missing = [name for name in cfg.target_modules if name not in linear]
    if missing:
        raise ConfigError(
            f"actor.lora.target_modules: {', '.join(missing)} "
            f"{'names' if len(missing) == 1 else 'name'} no linear layer of the "
            f"model; its linear layers are: {', '.join(sorted(linear))}"
        )


def _peft_model(model: nn.Module) -> Any:
    peft = _peft()
    found = next((m for m in model.modules() if isinstance(m, peft.PeftModel)), None)
    if found is None:
        raise TypeError(f"{type(model).__name__} holds no peft model (actor.lora.rank is 0?)")
    return found


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` (plain, DDP- or FSDP-wrapped) as its base: the reference policy."""
    with _peft_model(model).disable_adapter():
        yield


def save_adapter(model: nn.Module, path: Path, *, base_path: str | None) -> None:
    """Write the peft model ``model`` (whole, on the CPU) as a peft adapter folder in
    ``path``, loadable with ``PeftModel.from_pretrained(base, path)``. Its base goes to
    ``path/base`` unless ``base_path`` names where it already is (``model.path``); ``model``
    is its base afterwards (the adapter layers taken out)."""
    peft_model = _peft_model(model)
    written_base = base_path is None
    # Absolute: the adapter is loaded from wherever its user stands.
    base_path = str((path / BASE_FOLDER if base_path is None else Path(base_path)).resolve())
    peft_model.peft_config["default"].base_model_name_or_path = base_path
    if written_base:  # peft reads the base's config while it saves the adapter
        peft_model.get_base_model().config.save_pretrained(base_path)
    # The adapters only: peft would add the whole embedding when an adapter wraps a head
    # tied to it, which no run trains (the base holds it).
    peft_model.save_pretrained(str(path), save_embedding_layers=False)
    # How the policy generates (its end tokens), which merge_adapter gives the merged model.
    peft_model.get_base_model().generation_config.save_pretrained(str(path))
    if written_base:
        peft_model.unload().save_pretrained(base_path)


def merge_dtype(adapter: Path) -> torch.dtype:
    """The dtype ``merge_adapter`` loads the base in, computes ``W + B A`` in and writes: the
    adapter folder's weights' (the run's precision; fp32 under bf16-mixed), at least fp32.
    Hugging Face loads a folder in its stored dtype, bf16 for published checkpoints, where
    the adapters' update, small against the weights, would round away (a third of what small
    adapters change in the logits: tests/models/test_lora.py)."""
    weights = _peft().utils.load_peft_weights(str(adapter), device="cpu")
    stored = {tensor.dtype for tensor in weights.values()}
    return functools.reduce(torch.promote_types, stored, torch.float32)


def _untie_adapted_head(model: Any) -> None:
    """Give the peft model ``model`` an LM head of its own when an adapter wraps it and it
    is its input embedding (``tie_word_embeddings``): the adapter changes the head's output
    only, and merged into the shared weight ``B A`` would change the embedding too."""
    head = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    if not isinstance(head, _peft().tuners.tuners_utils.BaseTunerLayer):
        return
    base_head = head.get_base_layer()
    if base_head.weight is not embedding.weight:
        return
    base_head.weight = nn.Parameter(base_head.weight.detach().clone(), requires_grad=False)
    model.get_base_model().config.tie_word_embeddings = False


def merge_adapter(adapter: Path, out: Path) -> None:
    """The adapter folder ``adapter`` folded into its base's weights, written to ``out`` in
    Hugging Face format. The base is ``adapter/base`` when the export wrote one there, else
    the path its adapter_config.json names, and must still hold the weights the adapter was
    trained over (``base_weights.json``, written with the export). The merged model generates
    as the adapter folder's ``generation_config.json`` says (its end tokens); an adapted LM
    head that the base ties to its input embedding is written untied
    (:func:`_untie_adapted_head`)."""
    peft = _peft()
    base_path = adapter / BASE_FOLDER
    if not base_path.is_dir():
        try:
            config = peft.PeftConfig.from_pretrained(str(adapter))
        except (TypeError, ValueError) as exc:
            raise UserError(f"{shown(str(adapter))}: not a peft adapter folder ({exc})") from None
        base_path = Path(config.base_model_name_or_path)
    if not base_path.is_dir():
        raise UserError(
            f"{shown(str(adapter))}: its base model {shown(str(base_path))} is not a folder here; a LoRA run "
            "over model.path merges onto that folder, which must still exist"
        )
    if not check_export_base(adapter, base_path):
        print(
            f"{adapter} records no identity of its base (exported by an earlier verlite): "
            f"merging onto {str(base_path)!r} as it is now",
            file=sys.stderr,
        )
    base = AutoModelForCausalLM.from_pretrained(
        str(base_path), local_files_only=True, dtype=merge_dtype(adapter)
    )
    with _peft_wrapping():
        adapted = peft.PeftModel.from_pretrained(base, str(adapter))
        _untie_adapted_head(adapted)
        merged = adapted.merge_and_unload()
    if (adapter / GENERATION_CONFIG_NAME).is_file():  # an earlier verlite's export has none
        merged.generation_config = GenerationConfig.from_pretrained(str(adapter))
    merged.save_pretrained(str(out))
