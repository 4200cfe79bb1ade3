"""Loading ``model.path``: a folder whose weights do not fill the model its config.json
describes is refused, naming a parameter, instead of trained from random values (Hugging
Face only warns)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from verlite.config import ConfigError, load_config
from verlite.models import ModelWeightsError, build_policy, build_value_model, tiny_hf_config
from verlite.models.support import check_rope_supported

Builder = Callable[..., Any]
BUILDERS: list[Builder] = [build_policy, build_value_model]


def _saved_model(folder: Path) -> Path:
    from transformers import AutoModelForCausalLM

    cfg = load_config(None, ["data.task=copy"]).model
    AutoModelForCausalLM.from_config(
        tiny_hf_config(cfg, vocab_size=17, max_positions=16)
    ).save_pretrained(folder)
    return folder


def _edit_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _build(builder: Builder, folder: Path) -> Any:
    cfg = load_config(None, ["data.task=copy", f"model.path={folder}"]).model
    return builder(cfg, vocab_size=17, max_positions=16, seed=0)


@pytest.mark.parametrize("builder", BUILDERS)
def test_a_matching_folder_loads(tmp_path: Path, builder: Builder) -> None:
    _build(builder, _saved_model(tmp_path))


@pytest.mark.parametrize("builder", BUILDERS)
def test_weights_of_another_architecture_are_refused(tmp_path: Path, builder: Builder) -> None:
    # A config.json that says bert over llama weights: every bert parameter would be random.
    folder = _saved_model(tmp_path)
    _edit_config(folder, model_type="bert", architectures=["BertModel"])
    with pytest.raises(ModelWeightsError, match=r"its weights do not fit .* parameters missing"):
        _build(builder, folder)


@pytest.mark.parametrize("builder", BUILDERS)
def test_weights_with_tensors_the_config_leaves_out_are_refused(
    tmp_path: Path, builder: Builder
) -> None:
    """Qwen2's weights under a config.json that says llama (no qkv biases): Hugging Face
    dropped the biases with a warning and the run trained another function (exit 0)."""
    from transformers import AutoModelForCausalLM

    cfg = load_config(None, ["data.task=copy", "model.arch=qwen2"]).model
    folder = tmp_path / "model"
    AutoModelForCausalLM.from_config(
        tiny_hf_config(cfg, vocab_size=17, max_positions=16)
    ).save_pretrained(folder)
    _edit_config(folder, model_type="llama", architectures=["LlamaForCausalLM"])
    with pytest.raises(ModelWeightsError) as caught:
        _build(builder, folder)
    assert str(caught.value) == (
        f"model.path={str(folder)!r}: its weights do not fit its config.json: 6 stored that its "
        "modules do not take (e.g. 'model.layers.0.self_attn.k_proj.bias'), which loading "
        "would drop: weights of another architecture"
    )


@pytest.mark.parametrize("builder", BUILDERS)
def test_weights_of_another_shape_are_refused(tmp_path: Path, builder: Builder) -> None:
    folder = _saved_model(tmp_path)
    _edit_config(folder, hidden_size=32, head_dim=8)
    with pytest.raises(ModelWeightsError, match=r"of another shape \(e\.g\. .*: \(17, 64\) stored"):
        _build(builder, folder)


@pytest.mark.parametrize("builder", BUILDERS)
def test_a_checkpoints_dropout_is_off_in_training(tmp_path: Path, builder: Builder) -> None:
    # With the config's attention_dropout, two training forwards of the same rows differed by
    # 0.13 in log-prob, and from the eval-mode pass the old log-probs come from.
    folder = _saved_model(tmp_path)
    _edit_config(folder, attention_dropout=0.5)
    model = _build(builder, folder)
    ids = torch.randint(1, 17, (2, 12), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "position_ids": torch.arange(12).expand(2, 12)}
    model.eval()
    with torch.no_grad():
        evaluated = _outputs(model(**inputs))
        model.train()
        trained = [_outputs(model(**inputs)) for _ in range(2)]
    assert all(torch.equal(out, evaluated) for out in trained)
    config = model.trunk.config if builder is build_value_model else model.config
    assert config.attention_dropout == 0.5  # an export writes the checkpoint's config


def _outputs(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_a_length_dependent_rope_past_the_original_context_is_refused(
    tmp_path: Path, kind: str
) -> None:
    # Dynamic NTK rope: a row's logits moved by 3e-5 (fp64) when a longer row shared its
    # forward pass, so its log-probs depended on its micro-batch.
    folder = _saved_model(tmp_path)
    rope = {"rope_type": kind, "factor": 2.0, "rope_theta": 10000.0}
    if kind == "longrope":
        rope |= {
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 16,
        }
    _edit_config(folder, rope_parameters=rope, rope_scaling=rope)
    cfg = load_config(None, ["data.task=copy", f"model.path={folder}"]).model
    check_rope_supported(cfg, max_sequence_length=16)  # within the original context
    with pytest.raises(ConfigError) as caught:
        check_rope_supported(cfg, max_sequence_length=17)
    message = str(caught.value)
    assert "\n" not in message
    assert f"model.path={folder}: its rope scaling {kind!r}" in message
    assert "sequences here reach 17" in message


def test_dropout_kept_as_numbers_is_off_and_dropout_read_from_the_config_is_refused(
    tmp_path: Path,
) -> None:
    """OPT keeps its rates as module attributes (``self.dropout = config.dropout``): they are
    turned off. Falcon reads ``config.hidden_dropout`` at every forward: a training forward
    would differ from the evaluation forward, so such a checkpoint is refused in one line."""
    from transformers import AutoModelForCausalLM, FalconConfig, OPTConfig

    from verlite.models import load_pretrained

    shape = {"vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 1}
    opt = OPTConfig(**shape, ffn_dim=32, num_attention_heads=2, word_embed_proj_dim=16)
    opt.dropout, opt.activation_dropout = 0.3, 0.3
    falcon = FalconConfig(**shape, num_attention_heads=2, hidden_dropout=0.3)
    for name, config in (("opt", opt), ("falcon", falcon)):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / name)
    model = load_pretrained(AutoModelForCausalLM, str(tmp_path / "opt"), torch.float32)
    ids = torch.arange(1, 9).unsqueeze(0)
    with torch.no_grad():
        evaluated = model.eval()(input_ids=ids).logits
        assert torch.equal(model.train()(input_ids=ids).logits, evaluated)
    with pytest.raises(ModelWeightsError) as caught:
        load_pretrained(AutoModelForCausalLM, str(tmp_path / "falcon"), torch.float32)
    message = str(caught.value)
    assert "\n" not in message and "hidden_dropout=0.3" in message
    assert message.endswith("set these to 0.0 in its config.json")


def _saved_opt(folder: Path, positions: int) -> Path:
    """A tiny OPT (learned positions: a table of ``positions`` rows) with the copy task's
    tokenizer."""
    from transformers import AutoModelForCausalLM, OPTConfig

    from verlite.data import load_tokenizer

    tokenizer = load_tokenizer(None, task="copy")
    config = OPTConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        word_embed_proj_dim=16,
        num_hidden_layers=1,
        ffn_dim=32,
        num_attention_heads=2,
        max_position_embeddings=positions,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_sequences_past_the_models_context_are_refused_before_ray(tmp_path: Path) -> None:
    """OPT's position table has max_position_embeddings rows: a longer sequence indexed past
    it (an IndexError inside a worker, at the first rollout) once the run had started."""
    from transformers import AutoModelForCausalLM

    from verlite.driver.preflight import RunInputs

    folder = _saved_opt(tmp_path / "opt", positions=16)
    with pytest.raises(IndexError):  # what a worker met
        AutoModelForCausalLM.from_pretrained(folder)(torch.zeros(1, 17, dtype=torch.long))
    overrides = [f"model.path={folder}", f"trainer.output_dir={tmp_path / 'run'}"]
    within = load_config("configs/ppo_tiny.yaml", [*overrides, "rollout.max_response_length=8"])
    RunInputs.load(within).folder.release()  # 8 + 8 = 16 positions: the whole table
    past = load_config("configs/ppo_tiny.yaml", [*overrides, "rollout.max_response_length=9"])
    with pytest.raises(ConfigError) as caught:
        RunInputs.load(past)
    assert str(caught.value) == (
        f"model.path={folder}: sequences here reach 17 tokens (data.max_prompt_length + "
        "rollout.max_response_length), past the model's context of 16 positions (config.json "
        "max_position_embeddings), the rows of its position table; shorten the prompts or "
        "responses"
    )


def test_a_run_of_a_rotary_model_past_its_context_starts_with_the_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from verlite.data import load_tokenizer
    from verlite.driver.preflight import RunInputs

    folder = _saved_model(tmp_path / "model")  # rotary, max_position_embeddings 16
    load_tokenizer(None, task="copy").save_pretrained(folder)
    overrides = [f"model.path={folder}", f"trainer.output_dir={tmp_path / 'run'}"]
    past = load_config("configs/ppo_tiny.yaml", [*overrides, "rollout.max_response_length=9"])
    RunInputs.load(past).folder.release()
    assert "warning: model.path=" in capsys.readouterr().out


_TINY = {"vocab_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
# Real Hugging Face configs of 16 positions: GPT-2 and OPT learn a table of them (GPT-2's wpe,
# OPT's embed_positions with 2 rows more); Gemma 3n is rotary, with per-layer token embeddings
# (embed_tokens_per_layer, an nn.Embedding besides the token embeddings).
_CONTEXT_MODELS = {
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 64, "n_positions": 16},
    "opt": {**_TINY, "hidden_size": 32, "ffn_dim": 64, "max_position_embeddings": 16},
    "gemma3n_text": {
        **_TINY,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": 16,
        "vocab_size_per_layer_input": 64,
        "hidden_size_per_layer_input": 8,
        "num_kv_shared_layers": 0,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 8,
        "activation_sparsity_pattern": [0.0, 0.0],
    },
}


@pytest.mark.parametrize(
    ("kind", "table"), [("gpt2", True), ("opt", True), ("gemma3n_text", False)]
)
def test_only_a_position_table_refuses_a_sequence_past_the_context(
    tmp_path: Path, kind: str, table: bool
) -> None:
    """Any nn.Embedding besides the token embeddings was taken for a position table: Gemma
    3n's per-layer embeddings made its 17-token sequences refused, where a rotary model's are
    warned of."""
    from transformers import AutoConfig

    from verlite.models.support import check_context_fits

    AutoConfig.for_model(kind, **_CONTEXT_MODELS[kind]).save_pretrained(tmp_path)
    cfg = load_config(None, ["data.task=copy", f"model.path={tmp_path}"]).model
    assert check_context_fits(cfg, max_sequence_length=16, fields="the fields") is None
    if table:
        with pytest.raises(ConfigError, match=r"16 positions .*, the rows of its position table"):
            check_context_fits(cfg, max_sequence_length=17, fields="the fields")
    else:
        warning = check_context_fits(cfg, max_sequence_length=17, fields="the fields")
        assert warning is not None and "its rotary positions past 16" in warning


def test_a_rotary_model_past_its_context_is_warned_of_and_a_scaling_extends_it(
    tmp_path: Path,
) -> None:
    """A rotary model has no table to index past: a longer sequence runs on positions it was
    not trained at, which a long-response run of a short-context checkpoint may mean. It was
    refused, with no way out; now it is one warning line. A static rope scaling (linear,
    yarn) runs past max_position_embeddings on purpose: nothing to say."""
    from verlite.models.support import check_context_fits

    folder = _saved_model(tmp_path)  # max_position_embeddings 16
    cfg = load_config(None, ["data.task=copy", f"model.path={folder}"]).model
    assert check_context_fits(cfg, max_sequence_length=16, fields="the fields") is None
    warning = check_context_fits(cfg, max_sequence_length=17, fields="the fields")
    assert warning == (
        f"warning: model.path={folder}: sequences here reach 17 tokens (the fields), past the "
        "model's context of 16 positions (config.json max_position_embeddings): its rotary "
        "positions past 16 are ones it was not trained at; shorten the prompts or responses, "
        "or give config.json a rope scaling, unless that is meant"
    )
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    _edit_config(folder, rope_parameters=rope, rope_scaling=rope)
    assert check_context_fits(cfg, max_sequence_length=32, fields="the fields") is None
