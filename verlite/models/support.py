"""Start-up checks of what a model can do, before Ray (``driver.preflight``, ``verlite
check-invariance``): its vocabulary holds the tokenizer, its class runs SDPA attention,
activation checkpointing, packed attention (no sliding window a sequence could pass), its
context and rotary scaling hold the run's longest sequence, its fp64 norms, LoRA's targets.
Each is checked on the model's config or a model built on the meta device (no memory) and
refused in one line naming the setting, where a worker would otherwise fail once Ray started."""

from __future__ import annotations

import copy
import re
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PretrainedConfig,
    PreTrainedModel,
)

from verlite.config import Config, ConfigError, LoraConfig, ModelConfig
from verlite.config.checks import longest_sequence_fields
from verlite.models import AutoClass, meta_causal_lm, model_config, probe_config
from verlite.models.flops import sliding_window_layers
from verlite.models.hf import input_embeddings
from verlite.models.lora import check_peft_installed, check_targets
from verlite.models.precision import cast_weights, float32_norms
from verlite.models.varlen import PackingUnsupported, enable_packing


def check_tokenizer_fits(path: str | None, tokenizer_size: int, *, field: str) -> None:
    """A tokenizer whose ids reach past its model's vocabulary would index past the embedding
    (a bare ``IndexError`` deep in the first rollout or scoring): refused at start-up, in one
    line naming ``field``, the config field of the model folder ``path`` (the policy's, the
    reward model's). None: the built-in model, built for its tokenizer's size."""
    if path is None:
        return
    vocab = getattr(model_config(path, field=field), "vocab_size", None)
    if isinstance(vocab, int) and tokenizer_size > vocab:
        raise ConfigError(
            f"{field}={path!r}: its tokenizer has {tokenizer_size} tokens but the model's "
            f"vocabulary holds {vocab} (config.json vocab_size); use the tokenizer the model was "
            "trained with"
        )


def check_attention_supported(cfg: ModelConfig) -> None:
    """``model.path`` at start-up: its class runs scaled-dot-product attention, which every
    model is loaded with (``load_pretrained``; eager attention yields NaN on fully padded query
    rows); refused in one line otherwise (checked on a model built on the meta device: no
    memory), where each worker's load would raise once Ray started. The built-in decoders
    (Llama, Qwen2) do."""
    if cfg.path is None:
        return
    check_sdpa(meta_causal_lm(probe_config(cfg)), field="model.path", path=cfg.path)


def check_sdpa(model: PreTrainedModel, *, field: str, path: str) -> None:
    """``model`` (the one in ``path``, the config's ``field``; built on the meta device)
    runs scaled-dot-product attention, which ``load_pretrained`` loads every model with; one
    line otherwise."""
    if not model._supports_sdpa:
        raise ConfigError(
            f"{field}={path!r}: {type(model).__name__} does not support scaled-dot-product "
            "attention (SDPA), which verlite loads every model with; use a model whose class "
            "does (Llama, Qwen2, Mistral, ...)"
        )


def checkpointing_unsupported(cfg: ModelConfig, *, role: str) -> str | None:
    """The class name of ``role``'s model of ``cfg`` (the actor's causal LM, the critic's
    trunk) when it does not support activation checkpointing; None when it does. Checked on
    a model built on the meta device: no memory."""
    auto_class: AutoClass = AutoModelForCausalLM if role == "actor" else AutoModel
    with torch.device("meta"):
        model = auto_class.from_config(probe_config(cfg))
    return None if model.supports_gradient_checkpointing else type(model).__name__


def check_gradient_checkpointing_supported(cfg: ModelConfig, *, role: str) -> None:
    """``<role>.gradient_checkpointing=true`` at start-up: the model class of ``cfg`` must
    support it; refused in one line otherwise."""
    unsupported = checkpointing_unsupported(cfg, role=role)
    if unsupported is not None:
        raise ConfigError(
            f"{role}.gradient_checkpointing=true: {unsupported} does not support "
            f"activation checkpointing; set {role}.gradient_checkpointing=false"
        )


def check_training_features(cfg: Config) -> None:
    """``<role>.packing`` and ``<role>.gradient_checkpointing`` where set, the actor's and
    the critic's: the model of ``cfg`` supports them (:func:`check_packing_supported` on the
    run's longest sequence, :func:`check_gradient_checkpointing_supported`); refused at
    start-up in one line naming the setting, where each worker's first build or packed pass
    would stop it."""
    for role in ("actor", "critic"):
        section = getattr(cfg, role)
        if section.packing:
            check_packing_supported(
                cfg.model,
                role=role,
                max_sequence_length=cfg.max_sequence_length,
                fields=longest_sequence_fields(cfg),
            )
        if section.gradient_checkpointing:
            check_gradient_checkpointing_supported(cfg.model, role=role)


def float32_norms_line(cfg: Config) -> str | None:
    """``model.precision=fp64`` at start-up: the line that names the normalization layers that
    keep float32 in the run's fp64 models (``precision.float32_norms``: of a form
    :func:`fp64_throughout` does not recompute in fp64, whose own forward rounds to float32),
    the policy's (its critic's trunk holds the same) and the reward model's; None when there
    are none, or under another precision."""
    if cfg.model.precision != "fp64":
        return None
    found = [("policy and critic", _float32_norms(AutoModelForCausalLM, probe_config(cfg.model)))]
    if cfg.reward.model.path is not None:
        config = model_config(cfg.reward.model.path, field="reward.model.path")
        found.append(("reward model", _float32_norms(AutoModelForSequenceClassification, config)))
    parts = [f"{', '.join(names)} ({models})" for models, names in found if names]
    if not parts:
        return None
    return (
        f"model.precision=fp64: {'; '.join(parts)} normalize in a form verlite does not "
        "recompute in fp64 and keep their own forward, which rounds their activations and "
        "gradients to float32: results there are float32-exact, not fp64-exact (layouts agree "
        "to about 1e-7, not 1e-9; docs/precision-and-memory.md)"
    )


def _float32_norms(auto_class: AutoClass, config: PretrainedConfig) -> list[str]:
    """:func:`precision.float32_norms` of the fp64 model of ``config``, checked on the model
    built on the meta device, each of its norms made real alone (no memory)."""
    with torch.device("meta"):
        model = auto_class.from_config(config)
    return float32_norms(
        nn.ModuleList(
            cast_weights(copy.deepcopy(module).to_empty(device="cpu"), torch.float64)
            for module in model.modules()
            if type(module).__name__.endswith("Norm")
        )
    )


def window_passed(config: PretrainedConfig, *, max_sequence_length: int, fields: str) -> str | None:
    """Why packed attention, which applies no window, cannot run a model of ``config`` on
    sequences of up to ``fields`` = ``max_sequence_length`` tokens: a sliding window of its
    (``flops.sliding_window_layers``) such a sequence could pass; None when none can
    (Hugging Face's window lets query i attend key j iff 0 <= i - j < window: full causal
    attention on a sequence no longer than the window)."""
    sliding, window = sliding_window_layers(config)
    if window is None or max_sequence_length <= window:
        return None
    return (
        f"{sliding} of the model's {config.num_hidden_layers} layers attend through a sliding "
        f"window of {window} tokens (sliding_window), and a sequence can be {fields} = "
        f"{max_sequence_length} tokens; packed attention applies no window, which is the "
        f"model's attention only for sequences of at most {window} tokens"
    )


def check_packing_supported(
    cfg: ModelConfig, *, role: str, max_sequence_length: int, fields: str
) -> None:
    """``<role>.packing=true`` at start-up: :func:`packing_unsupported` finds nothing;
    refused in one line otherwise, before any worker trains with attention across
    sequences or past a window."""
    why = packing_unsupported(cfg, max_sequence_length=max_sequence_length, fields=fields)
    if why is not None:
        raise ConfigError(f"{role}.packing=true: {why}; set {role}.packing=false")


def packing_unsupported(cfg: ModelConfig, *, max_sequence_length: int, fields: str) -> str | None:
    """Why packed attention cannot run the model of ``cfg`` on sequences of up to ``fields``
    = ``max_sequence_length`` tokens; None when it can. A sliding window of the model must
    not bind on such a sequence (:func:`window_passed`), and a one-layer-per-kind model of
    ``cfg``'s architecture, narrowed to a few heads, must keep packed sequences apart
    (``varlen.enable_packing``)."""
    config = copy.deepcopy(probe_config(cfg))
    passed = window_passed(config, max_sequence_length=max_sequence_length, fields=fields)
    if passed is not None:
        return passed
    narrow = {
        "vocab_size": 64,
        "num_hidden_layers": 1,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    }
    for key, value in narrow.items():
        if hasattr(config, key):
            setattr(config, key, value)
    kinds = getattr(config, "layer_types", None)
    if kinds:  # one layer of each kind (Qwen2's first layers attend in full, later ones slide)
        config.layer_types = sorted(set(kinds))
        config.num_hidden_layers = len(config.layer_types)
    try:
        enable_packing(AutoModelForCausalLM.from_config(config))
    except PackingUnsupported as exc:
        return str(exc)
    except Exception as exc:  # the probe itself could not be built or run
        return (
            f"could not check that {config.model_type} models keep packed sequences apart "
            f"({type(exc).__name__}: {exc})"
        )
    return None


# Rotary scalings whose frequencies follow the longest position of each forward pass (and,
# for dynamic, the passes before it) once that passes the model's original context.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _rope_sets(config: PretrainedConfig) -> list[dict[str, Any]]:
    """A checkpoint's rotary parameters: one set, or one per layer type; none without."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict):
        return []
    if "rope_type" in rope or "type" in rope:
        return [rope]
    return [value for value in rope.values() if isinstance(value, dict)]


def _rope_kind(params: dict[str, Any]) -> Any:
    return params.get("rope_type", params.get("type"))


def check_context_fits(cfg: ModelConfig, *, max_sequence_length: int, fields: str) -> str | None:
    """``model.path`` at start-up: the run's longest sequence (``fields`` name what sets it)
    against the model's ``max_position_embeddings``. Past it, a model with learned positions
    (OPT, GPT-2: a position table, :func:`position_tables`, found on a model built on the
    meta device) indexes past its table (an ``IndexError`` inside a
    worker, at the first rollout): refused in one line. A rotary model runs on positions it
    was not trained at, which a user may mean (a long-response run of a short-context
    checkpoint): the warning line returned says so. A rotary scaling other than the default
    extends the context on purpose and is left to :func:`check_rope_supported`."""
    if cfg.path is None:
        return None
    config = model_config(cfg.path)
    positions = getattr(config, "max_position_embeddings", None)
    scaled = any(_rope_kind(params) not in (None, "default") for params in _rope_sets(config))
    if not isinstance(positions, int) or max_sequence_length <= positions or scaled:
        return None
    past = (
        f"model.path={cfg.path}: sequences here reach {max_sequence_length} tokens ({fields}), "
        f"past the model's context of {positions} positions (config.json "
        "max_position_embeddings)"
    )
    model = meta_causal_lm(config)
    if position_tables(model, positions):
        raise ConfigError(
            f"{past}, the rows of its position table; shorten the prompts or responses"
        )
    return (
        f"warning: {past}: its rotary positions past {positions} are ones it was not trained "
        "at; shorten the prompts or responses, or give config.json a rope scaling, unless "
        "that is meant"
    )


# The rows a learned position table holds beyond max_position_embeddings (OPT's and BioGPT's
# offset of 2, from their padding index).
_POSITION_OFFSET_ROWS = 2
_NAMES_POSITIONS = re.compile(r"position", re.IGNORECASE)


def position_tables(model: nn.Module, positions: int) -> list[str]:
    """The names of ``model``'s learned position tables: embeddings besides its token
    embeddings that its class or name says hold positions (OPT's
    ``OPTLearnedPositionalEmbedding``, ``embed_positions``, ``position_embeddings``), or, where
    neither says (GPT-2's ``wpe``), that have a row per position of ``positions``
    (``max_position_embeddings``, up to :data:`_POSITION_OFFSET_ROWS` more). Other embeddings
    are not (Gemma 3n's per-layer token embeddings, ``embed_tokens_per_layer``)."""
    tokens = input_embeddings(model)
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Embedding)
        and module is not tokens
        and (
            bool(_NAMES_POSITIONS.search(f"{name} {type(module).__name__}"))
            or 0 <= module.num_embeddings - positions <= _POSITION_OFFSET_ROWS
        )
    ]


def check_rope_supported(cfg: ModelConfig, *, max_sequence_length: int) -> None:
    """``model.path`` at start-up: a rotary scaling of ``LENGTH_DEPENDENT_ROPE`` with
    sequences longer than the model's original context is refused in one line. Its
    frequencies are set by the longest row of each forward pass, so a row's log-probs would
    depend on the rows that share its micro-batch (3e-5 in fp64 for a row beside a longer
    one), and a sampler's cache on its own length: not the same policy in every layout."""
    if cfg.path is None:
        return
    config = model_config(cfg.path)
    for params in _rope_sets(config):
        kind = _rope_kind(params)
        original = params.get("original_max_position_embeddings") or config.max_position_embeddings
        if kind in LENGTH_DEPENDENT_ROPE and max_sequence_length > original:
            raise ConfigError(
                f"model.path={cfg.path}: its rope scaling {kind!r} changes the rotary "
                f"frequencies with the longest sequence of each forward pass beyond {original} "
                f"positions, and sequences here reach {max_sequence_length}: a row's "
                "log-probs would depend on the rows it shares a micro-batch with; keep "
                f"sequences within {original} tokens or use a checkpoint with static rope scaling"
            )


def check_lora_supported(cfg: ModelConfig, lora: LoraConfig) -> str | None:
    """``actor.lora.rank > 0`` at start-up: peft installed, and every target module a linear
    layer of the model (checked on a model built on the meta device: no memory). Returns the
    line a run prints where the targets leave out the built-in model's LM head (random, as
    all its weights: frozen, it holds sampling near uniform whatever the adapters learn,
    docs/lora.md); None otherwise (a ``model.path`` model's head is trained already)."""
    if lora.rank == 0:
        return None
    check_peft_installed(lora)
    model = meta_causal_lm(probe_config(cfg))
    check_targets(model, lora)
    head = model.get_output_embeddings()
    name = next(n for n, m in model.named_modules() if m is head).rsplit(".", 1)[-1]
    if cfg.path is not None or name in lora.target_modules:
        return None
    return (
        f"actor.lora.target_modules=[{', '.join(lora.target_modules)}] leaves out {name}: the "
        "built-in model's LM head is random and stays frozen, which keeps sampling near "
        "uniform whatever the adapters learn (docs/lora.md, 'What the quick-start learns'); "
        f"add {name} to actor.lora.target_modules"
    )
