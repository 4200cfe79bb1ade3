"""Bad input at the command line: one line on stderr naming field, value and what is allowed;
exit code 2; no traceback; nothing started (all of these fail before Ray)."""

import importlib.metadata
import json
import pickle
import re
import shutil
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_support import fake_checkpoint

from tests.model_support import LARGE_GENERATION, tiny_gemma2_config
from verlite.cli import main
from verlite.config import load_config
from verlite.controller import check_device
from verlite.errors import DamagedFileError, MissingExtraError, UserError, import_extra

CONFIG = "configs/ppo_tiny.yaml"

BAD_OVERRIDES = [
    (["actor.lrr=1"], "did you mean 'actor.optim.lr'"),
    (["trainer.totl_steps=3"], "did you mean 'trainer.total_steps'"),
    (["actor.ppo_epochs=two"], "actor.ppo_epochs='two': Input should be a valid integer"),
    (["actor.optim.lr=fast"], "actor.optim.lr='fast': Input should be a valid number"),
    (["actor.use_kl_loss=maybe"], "actor.use_kl_loss='maybe': Input should be a valid boolean"),
    (["actor.loss_agg_mode=mean"], "allowed: token-mean, token-sum"),
    (["algorithm.adv_estimator=ppo"], "allowed: gae, grpo"),
    (["actor.kl_loss_type=k9"], "unknown KL kind; allowed: k1"),
    (["actor.policy_loss=trpo"], "unknown policy loss; allowed: gspo, reinforce, vanilla"),
    (["trainer.loggers=[comet]"], "trainer.loggers[0]='comet'"),
    (["data.train_batch_size=0"], "data.train_batch_size=0: Input should be greater than 0"),
    (["rollout.n=-2"], "rollout.n=-2: Input should be greater than 0"),
    (["rollout.max_response_length=0"], "rollout.max_response_length=0"),
    (["actor.optim.lr=-1"], "actor.optim.lr=-1: Input should be greater than 0"),
    (["rollout.temperature=-0.5"], "rollout.temperature=-0.5"),
    (
        ["actor.ppo_mini_batch_size=48"],
        "actor.ppo_mini_batch_size=48 must divide the sequences per step",
    ),
    (
        ["actor.micro_batch_size_per_worker=32"],
        "actor.micro_batch_size_per_worker=32 is larger than the per-worker mini-batch 16",
    ),
    (
        ["actor.micro_batch_size_per_worker=6"],
        "must be divisible by micro_batch_size_per_worker * workers = 6 * 1",
    ),
    (
        ["trainer.workers_per_node=3"],
        "actor.ppo_mini_batch_size=16 must be divisible by the actor's 3 workers",
    ),
    (
        ["actor.use_dynamic_bsz=true", "actor.max_token_len_per_worker=8"],
        "actor.max_token_len_per_worker=8 is below the longest sequence",
    ),
    (["algorithm.adv_estimator=grpo"], "rollout.n must be >= 2"),
    (["model.path=/no/such/model"], "model.path='/no/such/model': no such file or directory"),
    (  # a Hub id, as from_pretrained takes one
        ["model.path=Qwen/Qwen2.5-0.5B-Instruct"],
        "model.path='Qwen/Qwen2.5-0.5B-Instruct': no such file or directory; give a local folder "
        "written by save_pretrained (nothing is downloaded)",
    ),
    (
        ["data.task=null", "data.train_file=/no/such.jsonl"],
        "data.train_file='/no/such.jsonl': no such file or directory",
    ),
    (
        [
            "actor.strategy=none",
            "trainer.workers_per_node=2",
            "actor.micro_batch_size_per_worker=8",
            "critic.micro_batch_size_per_worker=8",
        ],
        "actor.strategy=none runs one worker",
    ),
    (
        ["rollout.placement=split", "rollout.cpus_per_worker=4096"],
        # "this machine has N", or "the open Ray session has 4" when the suite's Ray is up
        "the workers ask for 4097 CPUs (actor+critic 1x1 + rollout 1x4096: "
        "trainer.cpus_per_worker=1, rollout.cpus_per_worker=4096), ",
    ),
    (
        [
            "trainer.nnodes=2",
            "actor.micro_batch_size_per_worker=8",
            "critic.micro_batch_size_per_worker=8",
        ],
        "trainer.nnodes=2, but ",  # an embedded Ray of one node, or the suite's open one
    ),
    *(  # Ray refused these once the run connected, after the inputs were read: a traceback
        (
            [f"trainer.ray_address={address}"],
            f"trainer.ray_address={address!r}: expected host:port (the head's GCS port, 6379 "
            "unless set), ray://host:port (Ray Client) or auto; leave it unset for an embedded Ray",
        )
        for address in ("not a url", "http://head:8265", "head", "head:99999")
    ),
    # no GPU here (or in the suite's open Ray), or, with one, workers given none
    (["model.device=cuda"], "model.device=cuda, but "),
    (
        ["reward.remote.url=https://scorer/score?api_key=hunter22"],
        # the CLI masks credentials in every message: this one must survive it whole
        "name an environment variable that holds the token in reward.remote.auth_env instead",
    ),
    (
        ["actor.offload=all"],
        "actor.offload=all is FSDP2's CPU offload and needs actor.strategy=fsdp, got "
        "actor.strategy=ddp",
    ),
    (
        ["critic.offload=all", "critic.strategy=none"],
        "critic.offload=all is FSDP2's CPU offload and needs critic.strategy=fsdp, got "
        "critic.strategy=none",
    ),
    (["actor.offload=cpu"], "actor.offload='cpu': Input should be 'none', 'optimizer' or 'all'"),
    (["rollout.decode_batch_buckets=[]"], "rollout.decode_batch_buckets=[]: is empty"),
    (
        ["rollout.decode_batch_buckets=[8,4]"],
        "rollout.decode_batch_buckets=[8, 4]: [8, 4] is not strictly ascending",
    ),
    (
        ["rollout.decode_batch_buckets=[0,4]"],
        "rollout.decode_batch_buckets[0]=0: Input should be greater than 0",
    ),
    (["rollout.decode=fast"], "rollout.decode='fast': Input should be 'auto', 'eager'"),
    (
        ["rollout.decode=static", "rollout.randomness=per_rank"],
        "rollout.decode=static compacts finished rows away",
    ),
    (
        ["rollout.decode=cuda_graphs"],
        "rollout.decode=cuda_graphs captures CUDA graphs, but the workers that generate run "
        "on CPU (model.device=auto, no GPUs per worker)",
    ),
    (
        ["rollout.stop_token_ids=[3,5000]"],
        "rollout.stop_token_ids=[3, 5000]: [5000] outside the model's vocabulary of",
    ),
    (["rollout.stop_token_ids=[-1]"], "rollout.stop_token_ids[0]=-1: Input should be greater"),
    (
        ["rollout.stop_token_ids=[3,4,5,6,7,8,9]"],
        "rollout.stop_token_ids=[3, 4, 5, 6, 7, 8, 9]: 7 distinct tokens; at most 6",
    ),
    (["actor"], "malformed override 'actor'"),
    (["=1"], "malformed override '=1'"),
    (["actor.optim.lr.x=1"], "actor.optim.lr is a value, not a section"),
    (["reward.fn=os.system"], "reward.fn='os.system'"),
    (["model.path="], "model.path is empty: String should have at least 1 character (or null)"),
    (
        ["trainer.output_dir="],
        "trainer.output_dir is empty: String should have at least 1 character",
    ),
    (["trainer.total_steps="], "trainer.total_steps is empty: Input should be a valid integer"),
    (["model.path=configs"], "model.path='configs' is not a Hugging Face model directory"),
    (["actor.optim.lr=.inf"], "actor.optim.lr=inf: Input should be a finite number"),
    (["rollout.temperature=.nan"], "rollout.temperature=nan: Input should be a finite number"),
    (["actor.optim.lr=inf"], "actor.optim.lr='inf': Input should be a valid number, got a string"),
    (["actor.optim.betas=[0.9,1.0]"], "actor.optim.betas[1]=1.0: Input should be less than 1"),
    (
        ["rollout.multi_turn.env=lookup"],
        "rollout.multi_turn.env='lookup' needs rollout.multi_turn.max_total_length (the most "
        "tokens of a trajectory, >= 12)",
    ),
    (
        ["rollout.multi_turn.env=lookup", "rollout.multi_turn.max_total_length=11"],
        "rollout.multi_turn.max_total_length=11 cannot hold the prompt and one turn: "
        "data.max_prompt_length + rollout.max_response_length = 12",
    ),
    (  # the actor validates a split run through its sharded model: its ranks' turns would not line up
        [
            "rollout.multi_turn.env=lookup",
            "rollout.multi_turn.max_total_length=24",
            "actor.strategy=fsdp",
            "rollout.placement=split",
        ],
        "rollout.multi_turn with an FSDP actor that validates a split run (rollout.placement=split, "
        "trainer.val_freq=50) is not supported: its ranks would take different numbers of turns "
        "in lockstep collectives; use actor.strategy=ddp, rollout.placement=colocated or "
        "trainer.val_freq=0",
    ),
    (
        ["rollout.multi_turn.env=lokup", "rollout.multi_turn.max_total_length=24"],
        "rollout.multi_turn.env='lokup': not a registered environment (lookup, lookup_without_tool)",
    ),
    (
        [
            "rollout.multi_turn.env=lookup",
            "rollout.multi_turn.max_total_length=24",
            "rollout.multi_turn.turn_stop=++",
        ],
        "rollout.multi_turn.turn_stop='++' is 2 tokens of the model's tokenizer; a turn must end on one token",
    ),
    (  # the tokens that end a trajectory: it would never see an observation
        [
            "rollout.multi_turn.env=lookup",
            "rollout.multi_turn.max_total_length=24",
            "rollout.multi_turn.turn_stop=<eos>",
        ],
        "rollout.multi_turn.turn_stop='<eos>' is token 2, the end-of-sequence token, which ends "
        "the whole trajectory: a turn that stops on it is never followed by an observation; "
        "choose a token that only ends a turn",
    ),
    (
        [
            "rollout.multi_turn.env=lookup",
            "rollout.multi_turn.max_total_length=24",
            "rollout.stop_token_ids=[14]",
            "rollout.multi_turn.turn_stop=+",
        ],
        "rollout.multi_turn.turn_stop='+' is token 14, in rollout.stop_token_ids, which ends",
    ),
    (
        [
            "rollout.multi_turn.env=lookup",
            "rollout.multi_turn.max_total_length=24",
            "actor.use_dynamic_bsz=true",
            "actor.max_token_len_per_worker=20",
        ],
        "actor.max_token_len_per_worker=20 is below the longest sequence, rollout.multi_turn.max_total_length = 24",
    ),
    # A multi-turn run is scored by its environment: no reward setting may look used.
    (
        [
            "rollout.multi_turn.env=lookup",
            "rollout.multi_turn.max_total_length=24",
            "reward.fn=exact_match",
        ],
        "reward.fn='exact_match' with rollout.multi_turn.env='lookup': a multi-turn run is scored "
        "by its environment; unset one of them",
    ),
    (
        [
            "rollout.multi_turn.env=lookup",
            "rollout.multi_turn.max_total_length=24",
            "reward.combine={fn: 0.5}",
        ],
        "reward.combine={'fn': 0.5} with rollout.multi_turn.env='lookup': a multi-turn run is "
        "scored by its environment; unset one of them",
    ),
    (
        [
            "rollout.multi_turn.env=lookup",
            "rollout.multi_turn.max_total_length=24",
            "reward.timeout_s=60",
        ],
        "reward.timeout_s=60 with rollout.multi_turn.env='lookup': a multi-turn run is scored "
        "by its environment; unset one of them",
    ),
]


@pytest.mark.parametrize(
    ("overrides", "pools"),
    [
        ([], "actor+critic"),
        (["reward.model.path=configs", "rollout.placement=split"], "actor+critic+reward, rollout"),
    ],
)
def test_cuda_workers_without_a_gpu_are_refused_whatever_the_cluster(
    overrides: list[str], pools: str
) -> None:
    """On a cluster (its GPUs unknown before it is reached) the workers' own bundles must hold
    a GPU for model.device=cuda: every role's, the reward model's and the rollout's too."""
    cfg = load_config(CONFIG, ["model.device=cuda", *overrides])
    with pytest.raises(
        UserError,
        match=re.escape(
            f"model.device=cuda, but the {pools} workers are given no GPU (trainer.gpus_per_worker=0"
        ),
    ):
        check_device(cfg)
    check_device(load_config(CONFIG, ["model.device=cuda", "trainer.gpus_per_worker=1"]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU here holds the worker's GPU")
def test_gpu_workers_on_a_machine_without_one_name_the_setting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """trainer.gpus_per_worker=1 (the recipes' cluster setting) on a machine, or in the
    suite's open Ray, without a GPU: the line names the setting and its value."""
    err = run(capsys, "train", "--config", CONFIG, "trainer.gpus_per_worker=1")
    assert "the workers ask for 1 GPU (actor+critic 1x1: trainer.gpus_per_worker=1), " in err
    assert " has 0; " in err


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 2, err
    assert err.startswith("verlite: error: ") and err.count("\n") == 1, err
    assert out == "", out  # a refusal is its one line: no notes of a run that does not start
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("overrides", "expected"), BAD_OVERRIDES, ids=[str(o) for o, _ in BAD_OVERRIDES]
)
def test_bad_override(
    capsys: pytest.CaptureFixture[str], overrides: list[str], expected: str
) -> None:
    assert expected in run(capsys, "train", "--config", CONFIG, *overrides)


def test_a_missing_relative_input_names_the_folder_it_was_looked_for_in(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # a config beside its prompt file, run from another folder: the path is the current
    # folder's, which the message did not say ("no such file or directory" of a file that is
    # there, beside the config)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "prompts.jsonl").write_text('{"prompt": "1=", "answer": "1"}\n')
    config = tmp_path / "run" / "job.yaml"
    config.write_text(Path(CONFIG).read_text() + "\n")
    monkeypatch.chdir(tmp_path)
    overrides = ["data.task=null", "data.train_file=prompts.jsonl"]
    assert run(capsys, "train", "--config", str(config), *overrides) == (
        "verlite: error: data.train_file='prompts.jsonl': no such file or directory; a relative "
        f"path is read from the current folder, {str(tmp_path)!r}\n"
    )
    # an absolute path needs no folder named
    overrides = ["data.task=null", f"data.train_file={tmp_path / 'prompts.jsonl'}"]
    assert run(capsys, "train", "--config", str(config), *overrides).endswith(
        "prompts.jsonl': no such file or directory\n"
    )


def test_a_model_without_activation_checkpointing_is_refused_before_ray(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from transformers.models.llama.modeling_llama import LlamaPreTrainedModel

    monkeypatch.setattr(LlamaPreTrainedModel, "supports_gradient_checkpointing", False)
    overrides = [f"trainer.output_dir={tmp_path / 'run'}", "critic.gradient_checkpointing=true"]
    err = run(capsys, "train", "--config", CONFIG, *overrides)
    assert "critic.gradient_checkpointing=true: LlamaModel does not support activation" in err
    assert not (tmp_path / "run").exists()


def test_a_model_without_sdpa_attention_is_refused_before_ray(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Gemma 2 (a real model class, popular as an instruct model) has no SDPA attention,
    which every worker loads models with: each worker's load raised Hugging Face's
    ValueError after Ray started (exit 1, half a minute in), and check-invariance's ranks
    a traceback."""
    from chat_model_support import chat_tokenizer
    from transformers import AutoModelForCausalLM

    tokenizer = chat_tokenizer()
    tokenizer.save_pretrained(tmp_path / "gemma2")
    config = tiny_gemma2_config(vocab_size=len(tokenizer))
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gemma2")
    capsys.readouterr()  # the save's progress bar
    expected = (
        f"verlite: error: model.path={str(tmp_path / 'gemma2')!r}: Gemma2ForCausalLM does not "
        "support scaled-dot-product attention (SDPA), which verlite loads every model with; "
        "use a model whose class does (Llama, Qwen2, Mistral, ...)\n"
    )
    model = f"model.path={tmp_path / 'gemma2'}"
    out = f"trainer.output_dir={tmp_path / 'run'}"
    assert run(capsys, "train", "--config", CONFIG, model, out) == expected
    assert not (tmp_path / "run").exists()
    assert run(capsys, "check-invariance", "--config", CONFIG, model, "--dp", "1") == expected


def test_a_reward_model_without_sdpa_attention_is_refused_before_ray(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The reward workers load reward.model.path with SDPA attention too: a Gemma 2
    classifier passed the reward model's start-up check, and each reward worker's load
    raised Hugging Face's ValueError after Ray started (exit 1, 15 s in)."""
    from transformers import AutoModelForSequenceClassification

    from verlite.data.tokenizer import CHARACTERS, build_task_tokenizer

    folder = tmp_path / "gemma2_rm"
    tokenizer = build_task_tokenizer(CHARACTERS)
    tokenizer.save_pretrained(folder)
    config = tiny_gemma2_config(
        vocab_size=len(tokenizer),
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        max_position_embeddings=64,
    )
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    capsys.readouterr()  # the save's progress bar
    out = f"trainer.output_dir={tmp_path / 'run'}"
    err = run(capsys, "train", "--config", CONFIG, f"reward.model.path={folder}", out)
    assert err == (
        f"verlite: error: reward.model.path={str(folder)!r}: Gemma2ForSequenceClassification "
        "does not support scaled-dot-product attention (SDPA), which verlite loads every model "
        "with; use a model whose class does (Llama, Qwen2, Mistral, ...)\n"
    )
    assert not (tmp_path / "run").exists()


def _saved_model(folder: Path, **save: Any) -> Path:
    from chat_model_support import chat_tokenizer
    from model_support import tiny_qwen2

    tokenizer = chat_tokenizer()
    tokenizer.save_pretrained(folder)
    tiny_qwen2(tied=False, vocab_size=len(tokenizer)).save_pretrained(folder, **save)
    return folder


def test_damaged_weight_files_are_refused_before_ray(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A copy cut short, a shard missing, a file that is not safetensors: each worker's load
    raised after Ray started (SafetensorError: 'incomplete metadata, file not fully covered',
    exit 1, half a minute in); now one line naming the file, before Ray."""
    one = _saved_model(tmp_path / "one")
    capsys.readouterr()  # the save's progress bar
    weights = one / "model.safetensors"
    whole = weights.read_bytes()
    out = f"trainer.output_dir={tmp_path / 'run'}"
    weights.write_bytes(whole[: len(whole) // 2])
    err = run(capsys, "train", "--config", CONFIG, f"model.path={one}", out)
    assert err == (
        f"verlite: error: model.path={str(one)!r}: model.safetensors is cut short or damaged: "
        f"{len(whole) // 2} bytes where its header describes {len(whole)}; copy or save the "
        "model again\n"
    )
    weights.write_bytes(b"not a safetensors file")
    err = run(capsys, "train", "--config", CONFIG, f"model.path={one}", out)
    assert err.startswith(
        f"verlite: error: model.path={str(one)!r}: model.safetensors is not a safetensors file"
    ), err
    sharded = _saved_model(tmp_path / "sharded", max_shard_size="20KB")
    capsys.readouterr()
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    err = run(capsys, "train", "--config", CONFIG, f"model.path={sharded}", out)
    assert err == (
        f"verlite: error: model.path={str(sharded)!r}: model.safetensors.index.json names "
        f"{shards[-1].name}, which is not in the folder; copy or save the model again\n"
    )
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny saved model for the tests that copy it and damage the copy."""
    return _saved_model(tmp_path_factory.mktemp("saved") / "model")


def _edit_json(path: Path, **fields: object) -> str:
    return json.dumps({**json.loads(path.read_text()), **fields})


# (file, its new text from the saved one's, the error after "model.path=FOLDER: ")
MODEL_FILE_PROBLEMS = [
    (
        "generation_config.json",
        lambda _: "{not json",
        "its generation_config.json is not valid JSON (Expecting property name enclosed in "
        "double quotes: line 1 column 2 (char 1))",
    ),
    ("generation_config.json", lambda _: "", "its generation_config.json is not valid JSON"),
    (
        "generation_config.json",
        lambda _: "[2]",
        "its generation_config.json holds list, not a JSON object",
    ),
    (
        "generation_config.json",
        lambda path: _edit_json(path, eos_token_id="<|im_end|>"),
        "its generation_config.json has eos_token_id='<|im_end|>'; expected a token id (an "
        "integer >= 0) or a list of them",
    ),
    (
        "config.json",
        lambda path: _edit_json(path, model_type="qwen9"),
        "no model config loads from it: model_type='qwen9' is no model type of the installed "
        "transformers",
    ),
    (
        "config.json",
        lambda path: _edit_json(path, hidden_size="big"),
        # was "no tokenizer loads from it", the tokenizer's load reading config.json first
        "no model config loads from it: \"Validation error for field 'hidden_size'",
    ),
]


@pytest.mark.parametrize(
    ("name", "edit", "expected"),
    MODEL_FILE_PROBLEMS,
    ids=[
        "generation not JSON",
        "generation empty",
        "generation list",
        "eos a string",
        "unknown model_type",
        "field of another type",
    ],
)
def test_a_model_folder_whose_configs_do_not_load_is_refused_before_ray(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    saved_model: Path,
    name: str,
    edit: Callable[[Path], str],
    expected: str,
) -> None:
    """A hand-edited generation_config.json or config.json: a traceback (Hugging Face's
    OSError or TypeError for the generation config, its ValueError for a model type it does
    not know), or a config.json field of the wrong type named as a tokenizer problem; now one
    line naming the field, the folder and the file, before Ray."""
    model = shutil.copytree(saved_model, tmp_path / "model")
    (model / name).write_text(edit(model / name))
    out = f"trainer.output_dir={tmp_path / 'run'}"
    err = run(capsys, "train", "--config", CONFIG, f"model.path={model}", out)
    assert err.startswith(f"verlite: error: model.path={str(model)!r}: {expected}"), err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("command", "field"),
    [
        (["check-invariance", "--dp", "1"], "model.path"),
        (["measure-packing"], "model.path"),
        (["train"], "reward.model.path"),
    ],
    ids=["check-invariance", "measure-packing", "reward model"],
)
def test_a_model_type_transformers_does_not_know_is_one_line_in_every_command(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    saved_model: Path,
    command: list[str],
    field: str,
) -> None:
    """The commands that read model.path besides `verlite train` (a traceback before), and
    the reward model's folder (Hugging Face's message of several sentences before)."""
    model = shutil.copytree(saved_model, tmp_path / "model")
    (model / "config.json").write_text(_edit_json(model / "config.json", model_type="qwen9"))
    err = run(capsys, *command, "--config", CONFIG, f"{field}={model}")
    assert err == (
        f"verlite: error: {field}={str(model)!r}: no model config loads from it: "
        f"model_type='qwen9' is no model type of the installed transformers "
        f"{importlib.metadata.version('transformers')}\n"
    )


def test_training_prompts_fewer_than_a_batch_are_refused_before_ray(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = f"trainer.output_dir={tmp_path / 'run'}"
    err = run(capsys, "train", "--config", CONFIG, out, "data.num_train_samples=40")
    assert err == (
        "verlite: error: 40 training prompts (data.task=copy, data.num_train_samples=40) are "
        "fewer than one batch of data.train_batch_size=64\n"
    )
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "{i}", "answer": "{i}"}}\n' for i in range(70)))
    from_file = [out, "data.task=null", f"data.train_file={prompts}"]
    err = run(capsys, "train", "--config", CONFIG, *from_file)
    assert err == (
        f"verlite: error: 6 training prompts (data.train_file={str(prompts)!r} less "
        "data.num_val_samples=64 held out) are fewer than one batch of data.train_batch_size=64\n"
    )
    # Nothing was written: the corrected command runs in the same folder.
    assert not (tmp_path / "run").exists()


def test_validation_prompts_fewer_than_its_workers_are_refused_before_ray(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Validation spreads its prompts over the actor's workers; a data-parallel share is
    never empty, so one prompt over two workers raised a traceback at the first validation,
    after the first step had trained."""
    two = [
        "actor.workers_per_node=2",
        "actor.micro_batch_size_per_worker=8",
        "trainer.cpus_per_worker=0.5",  # three workers on this machine's two CPUs
    ]
    out = f"trainer.output_dir={tmp_path / 'run'}"
    err = run(capsys, "train", "--config", CONFIG, out, *two, "data.num_val_samples=1")
    assert err == (
        "verlite: error: 1 validation prompts (data.num_val_samples=1) are fewer than the 2 "
        "actor workers validation spreads them over, one at least each; validate on more "
        "prompts, use fewer workers, or trainer.val_freq=0\n"
    )
    assert not (tmp_path / "run").exists()


def test_a_missing_extra_names_its_requirement_or_the_editable_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "math_verify", None)  # not installed: import fails
    with pytest.raises(MissingExtraError, match=r"pip install 'math-verify>=0\.7' \(verl"):
        import_extra("math_verify", feature="reward.fn=math", extra="math")

    def not_installed(name: str) -> list[str]:
        raise importlib.metadata.PackageNotFoundError(name)

    # verlite run from its folder (PYTHONPATH), not installed: the extra from that folder
    monkeypatch.setattr(importlib.metadata, "requires", not_installed)
    with pytest.raises(MissingExtraError) as info:
        import_extra("math_verify", feature="reward.fn=math", extra="math")
    assert str(info.value).endswith("install it with: pip install -e '.[math]' in verlite's folder")


def test_a_moved_key_is_one_line_naming_its_new_place(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    expected = (
        "verlite: error: trainer.max_staleness moved to rollout.max_staleness; set "
        "rollout.max_staleness instead\n"
    )
    assert run(capsys, "train", "--config", CONFIG, "trainer.max_staleness=1") == expected
    (tmp_path / "old.yaml").write_text(
        "data: {task: copy}\nrollout: {placement: split}\ntrainer: {max_staleness: 1}\n"
    )
    assert run(capsys, "train", "--config", str(tmp_path / "old.yaml")) == expected


def test_no_error_shows_the_value_of_a_credential_in_the_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Any message may quote what it was given: a value, or a user reward's exception text.
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "hunter2-pw")
    err = run(capsys, "train", "--config", CONFIG, "actor.loss_agg_mode=hunter2-pw")
    assert "actor.loss_agg_mode='***'" in err and "hunter2" not in err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (  # was: malformed override '4': no '=' (argparse leaves the 4 to the overrides)
            ["check-invariance", "--config", CONFIG, "--dp", "2", "4"],
            "verlite check-invariance: error: --dp takes one value, got '2' and then '4'; a "
            "config override is one word, dotted.key=value (see verlite check-invariance --help)\n",
        ),
        (
            ["train", "--config", CONFIG, "--address=a", "b", "trainer.seed=1"],
            "verlite train: error: --address takes one value, got 'a' and then 'b'; a config",
        ),
        (  # a flag by a prefix of its name, as argparse takes it
            ["measure-packing", "--conf", CONFIG, "--tri", "5", "6"],
            "verlite measure-packing: error: --trials takes one value, got '5' and then '6'",
        ),
        (
            ["measure-packing", "--config", CONFIG, "--json", "200"],
            "verlite measure-packing: error: --json takes no value, got '200' after it; a config",
        ),
        (
            ["submit", "--config", CONFIG, "--runtime-env", "env.yaml", "more.yaml"],
            "verlite submit: error: --runtime-env takes one value, got 'env.yaml' and then "
            "'more.yaml'",
        ),
    ],
)
def test_a_second_value_of_a_flag_is_named_with_its_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(expected), err


def test_an_override_without_its_equals_sign_is_named_as_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # a dotted key after a flag's value is an override that lacks its '=', not a flag's value
    assert run(capsys, "train", "--config", CONFIG, "trainer.total_steps", "5") == (
        "verlite: error: malformed override 'trainer.total_steps': no '='; write dotted.key=value "
        "as one word (no spaces around '='), e.g. actor.loss_agg_mode=token-sum\n"
    )
    # after --, every word is an override
    assert "malformed override '4': no '='" in run(
        capsys, "check-invariance", "--config", CONFIG, "--dp", "2", "--", "4"
    )
    # quoted as every value a message quotes (errors.shown): a pasted page is cut, not repeated
    err = run(capsys, "train", "x" * 5000, "--config", CONFIG)
    assert "malformed override 'xxx" in err and "[...]" in err and len(err) < 400


def test_a_refused_metrics_command_makes_no_folder_for_its_plot(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`verlite metrics --plot` makes the folders missing from the PNG's path, as a run makes
    its output folder, and its help says so; only as it writes the plot: a command refused
    (a run folder that does not exist) left them behind, made before anything was read."""
    png = tmp_path / "plots" / "deep" / "run.png"
    no_run = str(tmp_path / "no-run")
    assert "no such folder" in run(capsys, "metrics", no_run, "--plot", str(png))
    assert not (tmp_path / "plots").exists()
    (tmp_path / "file").write_text("")  # still refused before the table: no folder to make
    assert run(capsys, "metrics", no_run, "--plot", str(tmp_path / "file" / "run.png")) == (
        f"verlite: error: --plot {str(tmp_path / 'file' / 'run.png')!r}: cannot write: "
        f"{str(tmp_path / 'file')!r} is not a folder\n"
    )
    with pytest.raises(SystemExit):
        main(["metrics", "--help"])
    assert "folders missing from its path are made" in " ".join(capsys.readouterr().out.split())


def test_bad_config_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert "cannot read config file" in run(
        capsys, "train", "--config", str(tmp_path / "missing.yaml")
    )
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    assert "must hold a mapping of sections" in run(
        capsys, "train", "--config", str(tmp_path / "list.yaml")
    )
    (tmp_path / "broken.yaml").write_text("data: {task: copy\n")
    assert "is not valid YAML at line" in run(
        capsys, "train", "--config", str(tmp_path / "broken.yaml")
    )
    (tmp_path / "latin1.yaml").write_bytes(b"data:\n  task: copy\n# caf\xe9\n")
    assert "is not UTF-8 text (byte 0xe9 at offset 24, line 3)" in run(
        capsys, "train", "--config", str(tmp_path / "latin1.yaml")
    )
    (tmp_path / "binary.yaml").write_bytes(b"data:\n  task: copy\x00\x01\n")  # was: "invalid YAML"
    assert run(capsys, "train", "--config", str(tmp_path / "binary.yaml")) == (
        f"verlite: error: config file {str(tmp_path / 'binary.yaml')!r} is not valid YAML at line "
        "2: special characters are not allowed (U+0000); is it a text file?\n"
    )
    for text in ("", "# nothing set yet\n\n"):  # was: "data: required field is missing"
        (tmp_path / "empty.yaml").write_text(text)
        assert run(capsys, "train", "--config", str(tmp_path / "empty.yaml")) == (
            f"verlite: error: config file {str(tmp_path / 'empty.yaml')!r} is empty (comments "
            "and blank lines aside); it must hold a mapping of sections: model:, data:, ...\n"
        )
    (tmp_path / "twice.yaml").write_text("data:\n  task: copy\n  task: add\n")
    assert "sets data.task twice (line 3)" in run(
        capsys, "train", "--config", str(tmp_path / "twice.yaml")
    )
    (tmp_path / "unknown.yaml").write_text("data: {task: copy}\ntrainer: {nodes: 2}\n")
    assert "unknown key 'trainer.nodes'; did you mean 'trainer.nnodes'" in run(
        capsys, "train", "--config", str(tmp_path / "unknown.yaml")
    )
    # A socket is no file to read (ENXIO): the user's to fix, not an I/O error of the machine.
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(tmp_path / "socket.yaml"))
        assert "cannot read config file" in run(
            capsys, "train", "--config", str(tmp_path / "socket.yaml")
        )


def write_jsonl(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        ([], "is empty"),
        (['{"prompt": "12=", "answer": "12"}', '{"prompt": "13=", "answer": '], "prompts.jsonl:2"),
        (['{"question": "12=", "answer": "12"}'], "prompts.jsonl:1"),
        (['{"prompt": 12, "answer": "12"}'], "prompts.jsonl:1"),
        (
            ['{"prompt": "' + "1" * 40 + '=", "answer": "1"}', '{"prompt": "1=", "answer": "1"}'],
            "longer than data.max_prompt_length=8",
        ),
    ],
    ids=["empty", "malformed line", "missing prompt", "not a string", "too long"],
)
def test_bad_prompt_files(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, lines: list[str], expected: str
) -> None:
    path = write_jsonl(tmp_path / "prompts.jsonl", lines)
    err = run(
        capsys,
        "train",
        "--config",
        CONFIG,
        "data.task=null",
        f"data.train_file={path}",
        "data.num_val_samples=1",
    )
    assert expected in err


def test_checkpoint_rng_files_are_loaded_without_running_code(tmp_path: Path) -> None:
    """A checkpoint is data: a pickle that would run code is refused (weights_only=True)."""
    from verlite.workers.training_worker import TrainingWorker

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (tmp_path / "rng_rank0.pt").write_bytes(pickle.dumps({"cpu": Payload()}))
    (tmp_path / "schedule.json").write_text(json.dumps({}))
    worker = TrainingWorker(role="actor", rank=0, world_size=1, torch_threads=1)
    worker.engine = type(
        "NoEngine", (), {"load": lambda self, path: None, "device": torch.device("cpu")}
    )()
    with pytest.raises(DamagedFileError, match=r"rng_rank0\.pt is cut short or damaged \(Unp"):
        worker.load_checkpoint(str(tmp_path))
    assert not marker.exists()
    torch.save({"cpu": torch.get_rng_state()}, tmp_path / "rng_rank0.pt")
    worker.load_checkpoint(str(tmp_path))  # a real RNG file loads


def _checkpoint(output_dir: Path, step: int, model: dict[str, object], roles: list[str]) -> None:
    fake_checkpoint(output_dir, step, roles, model=model)


def _model_settings(*overrides: str) -> dict[str, object]:
    from verlite.config import load_config

    return load_config(CONFIG, list(overrides)).model.model_dump(mode="json")


@pytest.mark.parametrize(
    ("saved", "roles", "overrides", "expected"),
    [
        (
            ["model.hidden_size=64"],
            ["actor", "critic"],
            ["model.hidden_size=32"],
            "cannot resume from .*step_3: model.hidden_size=64 there, 32 here",
        ),
        (
            [],
            ["actor"],  # written by a GRPO run; this config has a critic
            [],
            "cannot resume from .*step_3: no critic weights. Use trainer.resume=disable",
        ),
        (
            [],
            ["actor", "critic"],
            ["trainer.total_steps=2"],
            "trainer.total_steps=2 but the checkpoint to resume, .*step_3, is at step 3",
        ),
    ],
    ids=["other model shape", "role without weights", "past total_steps"],
)
def test_resume_that_cannot_work_fails_before_ray(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    saved: list[str],
    roles: list[str],
    overrides: list[str],
    expected: str,
) -> None:
    _checkpoint(tmp_path, 3, _model_settings(*saved), roles)
    err = run(capsys, "train", "--config", CONFIG, f"trainer.output_dir={tmp_path}", *overrides)
    assert re.search(expected, err), err


def test_a_checkpoint_missing_its_shard_index_fails_before_ray(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    _checkpoint(tmp_path, 3, _model_settings(), ["actor", "critic"])
    (tmp_path / "checkpoints" / "step_3" / "critic" / "train_state" / ".metadata").unlink()
    err = run(capsys, "train", "--config", CONFIG, f"trainer.output_dir={tmp_path}")
    assert re.search(
        r"cannot resume from .*step_3: critic/train_state/\.metadata is missing", err
    ), err


@pytest.mark.parametrize(
    ("file", "text", "expected"),
    [
        (
            "trainer_state.json",
            '{"step": 3,',
            r"trainer_state\.json is damaged: malformed JSON: Expecting",
        ),
        ("trainer_state.json", '{"step": "3"}', r"'step' is not a whole number >= 0; 'kl_coef'"),
        ("trainer_state.json", "[3]", r"trainer_state\.json is damaged: a list, not a JSON"),
        ("critic/schedule.json", '{"last_epoch":', r"critic/schedule\.json is damaged"),
        ("actor/engine_state.json", "[0]", r"actor/engine_state\.json is damaged: a list"),
        (  # a rank's random state cut short: refused before Ray, not by torch.load in a worker
            "critic/rng_rank0.pt",
            "PK\x03\x04 a copy cut short",
            r"cannot resume from .*step_3: critic/rng_rank0\.pt is cut short or damaged \("
            r"RuntimeError: PytorchStreamReader failed reading zip archive: not a ZIP archive\)"
            r"\. No earlier checkpoint of its run is whole: start afresh",
        ),
        (  # each field a resume reads, of another shape: no traceback
            "trainer_state.json",
            '{"step": 3, "kl_coef": 0, "loader": {}, "config": [1], "model": "m"}',
            r"trainer_state\.json is damaged: 'config' is not a mapping; 'model' is not a mapping",
        ),
        (  # base_weights null: a run of the built-in model; the problem is the next key
            "trainer_state.json",
            '{"step": 3, "kl_coef": 0, "loader": {}, "base_weights": null, "train_set": {}}',
            r"damaged: 'train_set' is not a mapping of 'records' \(a count\) and 'sha256'",
        ),
        (
            "trainer_state.json",
            '{"step": 3, "kl_coef": 0, "loader": {}, "train_set": [8], "base_weights": 1}',
            r"'base_weights' is not a mapping; 'train_set' is not a mapping of 'records'",
        ),
        (  # the packages' versions: a mapping of names to text
            "trainer_state.json",
            '{"step": 3, "kl_coef": 0, "loader": {}, "versions": {"torch": 2.11}}',
            r"trainer_state\.json is damaged: 'versions' is not a mapping of package names to "
            r"versions \(text\)\. No earlier checkpoint",
        ),
        (
            "trainer_state.json",
            '{"step": 3, "kl_coef": 0, "loader": {}, "versions": ["torch"]}',
            r"trainer_state\.json is damaged: 'versions' is not a mapping of package names",
        ),
    ],
)
def test_a_damaged_checkpoint_file_is_one_line_before_ray(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, file: str, text: str, expected: str
) -> None:
    _checkpoint(tmp_path, 3, _model_settings(), ["actor", "critic"])
    (tmp_path / "checkpoints" / "step_3" / file).write_text(text)
    err = run(capsys, "train", "--config", CONFIG, f"trainer.output_dir={tmp_path}")
    assert re.search(expected, err), err


def _rng_file(content: object) -> Callable[[Path], None]:
    return lambda step: torch.save(content, step / "critic" / "rng_rank0.pt")


def _text(name: str, text: str) -> Callable[[Path], None]:
    return lambda step: (step / name).write_text(text)


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (_text("critic/schedule.json", '{"last_epoch": 3,'), r"critic/schedule\.json is damaged"),
        (_text("critic/schedule.json", "not json"), r"critic/schedule\.json is damaged: malf"),
        (
            _text("critic/schedule.json", '{"last_epoch": "3", "_step_count": 1}'),
            r"critic/schedule\.json is damaged: 'last_epoch' is not a whole number >= 0; "
            r"'lr_lambdas' is not a list of nulls",
        ),
        (
            _text("actor/engine_state.json", '{"nonfinite_streak": [1]}'),
            r"actor/engine_state\.json is damaged: 'nonfinite_streak' is not a whole number",
        ),
        (_text("trainer_state.json", '{"step": 3'), r"step_3/trainer_state\.json is damaged"),
        (  # valid archives whose content is no random state: refused before the worker's load
            _rng_file({"cpu": torch.get_rng_state().double()}),
            r"critic/rng_rank0\.pt is damaged: its 'cpu' is not a CPU random state",
        ),
        (
            _rng_file({"cuda": torch.get_rng_state()}),
            r"critic/rng_rank0\.pt is damaged: holds a mapping of \['cuda'\], not a mapping",
        ),
    ],
    ids=[
        "schedule cut short",
        "schedule not JSON",
        "schedule of wrong types",
        "engine state of wrong types",
        "trainer state cut short",
        "random state of wrong dtype",
        "random state without the CPU's",
    ],
)
def test_a_damaged_checkpoint_file_names_the_earlier_checkpoint_to_resume(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    damage: Callable[[Path], None],
    named: str,
) -> None:
    """Each damaged file of a checkpoint is one line (exit 2, before Ray) that says to resume
    the run's earlier checkpoint, which passes; one damaged alike is passed over."""
    model = _model_settings()
    whole = [fake_checkpoint(tmp_path, step, ["actor", "critic"], model=model) for step in (1, 2)]
    damage(fake_checkpoint(tmp_path, 3, ["actor", "critic"], model=model))
    err = run(capsys, "train", "--config", CONFIG, f"trainer.output_dir={tmp_path}")
    assert re.search(f"cannot resume from .*step_3: .*{named}", err), err
    assert f". Resume from an earlier one with trainer.resume={whole[1]}, or start afresh " in err
    damage(whole[1])
    err = run(capsys, "train", "--config", CONFIG, f"trainer.output_dir={tmp_path}")
    assert f". Resume from an earlier one with trainer.resume={whole[0]}, or start afresh " in err


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs /proc/self/mem (Linux)")
@pytest.mark.parametrize(
    "name", ["critic/rng_rank0.pt", "critic/schedule.json", "actor/train_state/.metadata"]
)
def test_an_io_error_reading_a_checkpoint_is_no_damage(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str
) -> None:
    """A read that fails with EIO (a real one: /proc/self/mem's offset 0 is no address of the
    reader's) is the machine's: one line naming the file, exit 1, not called damage."""
    step = fake_checkpoint(tmp_path, 3, ["actor", "critic"], model=_model_settings())
    (step / name).unlink(missing_ok=True)
    (step / name).symlink_to("/proc/self/mem")
    assert main(["train", "--config", CONFIG, f"trainer.output_dir={tmp_path}"]) == 1
    out, err = capsys.readouterr()
    assert err == (
        f"verlite: error: reading checkpoint file {str(step / name)!r} failed: Input/output "
        "error (an I/O error of this machine, not the file's content; try again)\n"
    )
    assert out == ""


def test_a_checkpoint_in_another_precision_is_resumable(tmp_path: Path) -> None:
    from verlite.driver.checkpoint import check_resumable

    _checkpoint(tmp_path, 3, _model_settings("model.precision=fp64"), ["actor"])
    check_resumable(
        tmp_path / "checkpoints" / "step_3",
        config={"model": _model_settings()},
        workers={"actor": 1},
        total_steps=3,
        train_set={"records": 8, "sha256": "0" * 64},  # the checkpoint records none: any pass
    )


@pytest.mark.parametrize(
    ("saved", "here"),
    [
        ("model.device=cpu", "model.device=cuda"),
        ("model.attention_crossover=256", "model.attention_crossover=512"),
        ("data.num_val_samples=32", "data.num_val_samples=16"),
    ],
)
def test_a_checkpoint_resumes_on_another_machine_or_validation_set(
    tmp_path: Path, saved: str, here: str
) -> None:
    """Settings of where and how a run computes, not what it trains (and the held-out
    prompts: the training prompts are checked by their fingerprint) were refused as a
    model or data setting that must match."""
    from verlite.config import load_config
    from verlite.driver.checkpoint import check_resumable

    fake_checkpoint(
        tmp_path, 3, ["actor"], config=load_config(CONFIG, [saved]).model_dump(mode="json")
    )
    changed = check_resumable(
        tmp_path / "checkpoints" / "step_3",
        config=load_config(CONFIG, [here]).model_dump(mode="json"),
        workers={"actor": 1},
        total_steps=4,
        train_set={"records": 8, "sha256": "0" * 64},  # the checkpoint records none: any pass
    )
    # another device is named: model.precision=auto resolves by it (fp32 or bf16-mixed)
    key = here.partition("=")[0]
    assert changed.settings == ([f"{key}: 'cpu' -> 'cuda'"] if key == "model.device" else [])


def test_a_lora_checkpoint_resumes_only_with_the_same_adapters(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from verlite.config import load_config

    saved = load_config(CONFIG, ["actor.lora.rank=4"]).model_dump(mode="json")
    fake_checkpoint(tmp_path, 3, ["actor", "critic"], config=saved)
    err = run(capsys, "train", "--config", CONFIG, f"trainer.output_dir={tmp_path}")
    assert re.search(r"cannot resume from .*step_3: actor.lora.rank=4 there, 0 here", err), err


def test_a_lora_checkpoint_resumes_with_its_target_modules_in_another_order(
    tmp_path: Path,
) -> None:
    """peft adapts the layers a list names in the model's order: the same names listed in
    another order were refused as other adapters; other names still are."""
    from verlite.config import load_config
    from verlite.driver.checkpoint import CheckpointError, check_resumable

    def lora(targets: str) -> dict[str, Any]:
        overrides = ["actor.lora.rank=4", f"actor.lora.target_modules={targets}"]
        return load_config(CONFIG, overrides).model_dump(mode="json")

    step_3 = fake_checkpoint(tmp_path, 3, ["actor", "critic"], config=lora("[q_proj,v_proj]"))
    common = {"workers": {"actor": 1, "critic": 1}, "total_steps": 4, "train_set": "none recorded"}
    assert check_resumable(step_3, config=lora("[v_proj,q_proj]"), **common).settings == []
    with pytest.raises(CheckpointError, match=r"actor\.lora\.target_modules="):
        check_resumable(step_3, config=lora("[q_proj,k_proj]"), **common)


# Both configs leave the setting without effect (verlite.config.inert): it changes nothing the
# checkpoint holds. (The base config, then the checkpoint's and the resumed run's overrides.)
_GRPO = ["algorithm.adv_estimator=grpo", "rollout.n=2"]
_INERT_IN_BOTH = [
    (["model.path=base"], "model.hidden_size=64", "model.hidden_size=128"),
    (["data.task=null", "data.train_file=p.jsonl"], "data.max_digits=3", "data.max_digits=5"),
    ([], "actor.lora.alpha=16", "actor.lora.alpha=8"),
    ([], "actor.lora.target_modules=[q_proj]", "actor.lora.target_modules=[v_proj]"),
    (_GRPO, "critic.optim.name=adamw", "critic.optim.name=sgd"),
]
# The same settings where they have an effect in either config: refused, naming the key.
_EFFECTIVE_IN_ONE = [
    ([], "model.hidden_size=64", "model.hidden_size=128", "model.hidden_size"),  # built-in
    (["model.path=base"], "model.path=null", "model.hidden_size=128", "model.hidden_size"),
    ([], "data.max_digits=3", "data.max_digits=5", "data.max_digits"),  # the task's prompts
    (["actor.lora.rank=4"], "actor.lora.alpha=16", "actor.lora.alpha=8", "actor.lora.alpha"),
    ([], "actor.lora.alpha=8", "actor.lora.rank=4", "actor.lora.alpha"),  # now with adapters
    ([], "critic.optim.name=adamw", "critic.optim.name=sgd", "critic.optim.name"),  # PPO's
    (_GRPO, "critic.optim.name=sgd", "algorithm.adv_estimator=gae", "critic.optim.name"),
]


@pytest.mark.parametrize(("base", "saved", "here"), _INERT_IN_BOTH)
def test_a_resume_allows_a_change_that_has_no_effect(
    tmp_path: Path, base: list[str], saved: str, here: str
) -> None:
    """The start-up line calls such a setting without effect; a resume still refused its
    change as a model, data, LoRA or optimizer setting that must match ("cannot resume ...:
    model.hidden_size=64 there, 128 here" under model.path). Reported as any change."""
    changed = _resume(tmp_path, [*base, saved], [*base, here])
    assert [line.partition(":")[0] for line in changed] == [here.partition("=")[0]]


@pytest.mark.parametrize(("base", "saved", "here", "key"), _EFFECTIVE_IN_ONE)
def test_a_resume_refuses_a_change_that_has_an_effect_in_either_run(
    tmp_path: Path, base: list[str], saved: str, here: str, key: str
) -> None:
    from verlite.driver.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match=rf"cannot resume .*{re.escape(key)}="):
        _resume(tmp_path, [*base, saved], [*base, here])


def test_a_resume_compares_every_setting_of_a_config_it_cannot_read(tmp_path: Path) -> None:
    """A checkpoint's record this version cannot read whole (a setting since removed) leaves
    no knowing what had an effect there: the settings that must match are compared."""
    from verlite.config import load_config
    from verlite.driver.checkpoint import CheckpointError, check_resumable

    saved = load_config(CONFIG, ["model.path=base"]).model_dump(mode="json")
    saved["trainer"]["a_setting_since_removed"] = 1
    step_3 = fake_checkpoint(tmp_path, 3, ["actor", "critic"], config=saved)
    cfg = load_config(CONFIG, ["model.path=base", "model.hidden_size=128"])
    with pytest.raises(CheckpointError, match=r"model\.hidden_size=64 there, 128 here"):
        config = cfg.model_dump(mode="json")
        check_resumable(
            step_3, config=config, workers=cfg.trained_workers, total_steps=4, train_set={}
        )


@pytest.mark.parametrize(
    ("saved", "here"),
    [
        ("{}", "{enable_thinking: false}"),
        ("{enable_thinking: true}", "{}"),
        ("{enable_thnking: false}", "{enable_thinking: false}"),
    ],
    ids=["added", "removed", "renamed"],
)
def test_a_resume_refuses_template_variables_added_or_removed(
    tmp_path: Path, saved: str, here: str
) -> None:
    """data.chat_template_kwargs was compared name by name (a dotted key per variable): only
    a variable both runs set was compared, so one added, removed or renamed resumed without
    a word, rendering the prompts (and multi-turn turns) otherwise."""
    from verlite.driver.checkpoint import CheckpointError

    base = ["model.path=base", "data.chat_template=true"]
    with pytest.raises(CheckpointError, match=r"data\.chat_template_kwargs=\{.*\} there, \{"):
        _resume(
            tmp_path,
            [*base, f"data.chat_template_kwargs={saved}"],
            [*base, f"data.chat_template_kwargs={here}"],
        )
    assert (
        _resume(
            tmp_path,
            [*base, f"data.chat_template_kwargs={here}"],
            [*base, f"data.chat_template_kwargs={here}"],
        )
        == []
    )


def test_a_checkpoint_recorded_before_template_variables_ran_with_none(tmp_path: Path) -> None:
    """A record without data.chat_template_kwargs (written before the setting) ran with no
    variables: resumed with none it passes, with one it is refused."""
    from verlite.config import load_config
    from verlite.driver.checkpoint import CheckpointError, check_resumable

    base = ["model.path=base", "data.chat_template=true"]
    saved = load_config(CONFIG, base).model_dump(mode="json")
    del saved["data"]["chat_template_kwargs"]
    step_3 = fake_checkpoint(tmp_path, 3, ["actor", "critic"], config=saved)
    common = {"workers": {"actor": 1, "critic": 1}, "total_steps": 4, "train_set": {}}
    assert (
        check_resumable(
            step_3, config=load_config(CONFIG, base).model_dump(mode="json"), **common
        ).settings
        == []
    )
    thinking = load_config(CONFIG, [*base, "data.chat_template_kwargs={enable_thinking: false}"])
    with pytest.raises(CheckpointError, match=r"data\.chat_template_kwargs=\{\} there"):
        check_resumable(step_3, config=thinking.model_dump(mode="json"), **common)


def _resume(tmp_path: Path, saved: list[str], here: list[str]) -> list[str]:
    """The settings check_resumable reports of a run with the ``here`` overrides from a
    checkpoint of ``saved``."""
    from verlite.config import load_config
    from verlite.driver.checkpoint import check_resumable

    there = load_config(CONFIG, saved)
    step_3 = fake_checkpoint(tmp_path, 3, there.roles, config=there.model_dump(mode="json"))
    cfg = load_config(CONFIG, here)
    config = cfg.model_dump(mode="json")  # the checkpoint records no training prompts: any pass
    return check_resumable(
        step_3, config=config, workers=cfg.trained_workers, total_steps=4, train_set={}
    ).settings


def test_a_checkpoint_of_another_optimizer_is_refused_before_ray(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Its state is another optimizer's: loading it in the workers failed after Ray started,
    on a key DCP could not find (``optim.state...step``)."""
    from verlite.config import load_config

    saved = load_config(CONFIG, ["critic.optim.name=sgd"]).model_dump(mode="json")
    fake_checkpoint(tmp_path, 3, ["actor", "critic"], config=saved)
    err = run(capsys, "train", "--config", CONFIG, f"trainer.output_dir={tmp_path}")
    assert re.search(
        r"cannot resume from .*step_3: critic.optim.name='sgd' there, 'adamw' here", err
    ), err


# A record of the whole config from before a setting existed: its absence meant the
# setting's old behaviour (full training; the built-in model with the tokenizer's rows).
# Another value is refused before Ray; the shards, read as another model's at the load,
# would be called damaged (its model settings found unchanged).
BEFORE_A_SETTING = {
    "actor.lora": ("actor.lora.rank=4", "actor.lora.rank=0 there, 4 here"),
    "model.vocab_size": ("model.vocab_size=1000", "model.vocab_size=None there, 1000 here"),
}


@pytest.mark.parametrize("setting", BEFORE_A_SETTING)
def test_a_checkpoint_from_before_a_setting_existed_had_its_old_behaviour(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, setting: str
) -> None:
    from verlite.config import load_config

    override, change = BEFORE_A_SETTING[setting]
    saved = load_config(CONFIG).model_dump(mode="json")
    section, key = setting.split(".")
    del saved[section][key]  # written before the setting existed
    fake_checkpoint(tmp_path, 3, ["actor", "critic"], config=saved)
    err = run(capsys, "train", "--config", CONFIG, f"trainer.output_dir={tmp_path}", override)
    assert re.search(rf"cannot resume from .*step_3: {re.escape(change)}", err), err


def test_a_checkpoint_from_before_a_key_moved_is_compared_under_its_new_name(
    tmp_path: Path,
) -> None:
    """It resumes; a setting it recorded under the old key, changed since, is reported under
    the new one, as any other change."""
    from verlite.config import load_config
    from verlite.driver.checkpoint import check_resumable

    split = ["rollout.placement=split"]
    saved = load_config(CONFIG, [*split, "rollout.max_staleness=1"]).model_dump(mode="json")
    saved["trainer"]["max_staleness"] = saved["rollout"].pop("max_staleness")  # as written then
    step_3 = fake_checkpoint(tmp_path, 3, ["actor", "critic"], config=saved)
    for staleness, changed in ((1, []), (0, ["rollout.max_staleness: 1 -> 0"])):
        here = load_config(CONFIG, [*split, f"rollout.max_staleness={staleness}"])
        assert (
            check_resumable(
                step_3,
                config=here.model_dump(mode="json"),
                workers=here.trained_workers,
                total_steps=5,
                train_set="a fake checkpoint records none",
            ).settings
            == changed
        )


@pytest.mark.parametrize("records", [1024, 960], ids=["same count", "fewer"])
def test_a_checkpoint_of_other_training_prompts_is_refused_before_ray(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, records: int
) -> None:
    """Its data position counts in another order of prompts (a prompt file edited between
    the runs): the same number of them, or fewer than the position (which the loader could
    not even load)."""
    from verlite.config import load_config
    from verlite.data import build_datasets, load_tokenizer
    from verlite.driver.checkpoint import check_resumable

    cfg = load_config(CONFIG)
    train_set, _ = build_datasets(cfg, load_tokenizer(None, task=cfg.data.task))
    here = train_set.fingerprint
    there = {"records": records, "sha256": "0" * 64}
    step_3 = fake_checkpoint(tmp_path, 3, ["actor", "critic"], config=cfg.model_dump(mode="json"))

    def check_resume() -> None:
        config = cfg.model_dump(mode="json")
        check_resumable(
            step_3, config=config, workers=cfg.trained_workers, total_steps=3, train_set=here
        )

    check_resume()  # a checkpoint from before the record passes
    state = json.loads((step_3 / "trainer_state.json").read_text())
    (step_3 / "trainer_state.json").write_text(json.dumps({**state, "train_set": here}))
    check_resume()
    (step_3 / "trainer_state.json").write_text(json.dumps({**state, "train_set": there}))
    err = run(capsys, "train", "--config", CONFIG, f"trainer.output_dir={tmp_path}")
    assert re.search(
        rf"cannot resume from .*step_3: the training prompts differ from those it trained on "
        rf"\({records} records of sha256 000000000000 there, 1024 of {here['sha256'][:12]} here\)",
        err,
    ), err


def test_export_errors_are_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    err = run(capsys, "export", str(tmp_path / "typo"))
    assert f"verlite: error: no such folder: {str(tmp_path / 'typo')!r}" in err
    (tmp_path / "weights.bin").write_text("a file")  # a file, not a run's folder
    err = run(capsys, "export", str(tmp_path / "weights.bin"))
    assert (
        f"verlite: error: {str(tmp_path / 'weights.bin')!r} is a file; give a run's folder" in err
    )
    for empty in (["", "--merge"], [str(tmp_path), "--merge", "--out", ""]):
        # an unset shell variable: the current folder said to hold no policy, named ''
        with pytest.raises(SystemExit) as exit_info:
            main(["export", *empty])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "expected a path, got an empty string" in err, err
    (tmp_path / "weights.bin").unlink()
    err = run(capsys, "export", str(tmp_path))
    assert (
        f"{str(tmp_path)!r}: holds no exported policy (hf_actor/ is missing; a run exports" in err
    )
    (tmp_path / "config.json").write_text(json.dumps({"trainer": {"export": False}}))
    err = run(capsys, "export", str(tmp_path))
    assert "(hf_actor/ is missing; the run has trainer.export=false, which exports none)" in err
    (tmp_path / "hf_actor").mkdir()
    for merge in ([], ["--merge"]):  # an emptied folder was said to hold full weights (exit 0)
        err = run(capsys, "export", str(tmp_path), *merge)
        assert err == (
            f"verlite: error: {str(tmp_path / 'hf_actor')!r}: holds neither full weights "
            "(config.json) nor a LoRA adapter (adapter_config.json); it is no policy a run "
            "exported\n"
        )
    (tmp_path / "hf_actor" / "config.json").write_text("{}")
    err = run(capsys, "export", str(tmp_path / "hf_actor"))  # the policy, not its run
    assert f"this is the exported policy itself: give its run folder, {str(tmp_path)!r})" in err
    err = run(capsys, "export", str(tmp_path), "--merge")
    assert f"{str(tmp_path / 'hf_actor')!r}: holds full weights, not a LoRA adapter; " in err
    err = run(capsys, "export", str(tmp_path), "--out", str(tmp_path / "merged"))
    assert f"--out {str(tmp_path / 'merged')!r}: names where --merge writes; add --merge" in err
    (tmp_path / "hf_actor" / "adapter_config.json").write_text("{not json")
    err = run(capsys, "export", str(tmp_path))
    assert "adapter_config.json': not a readable peft adapter config (" in err
    for not_an_object in ("[1]", "null", '"r"'):  # JSON, but no adapter config
        (tmp_path / "hf_actor" / "adapter_config.json").write_text(not_an_object)
        for merge in ([], ["--merge"]):
            err = run(capsys, "export", str(tmp_path), *merge)
            assert "adapter_config.json': not a readable peft adapter config (" in err
    (tmp_path / "hf_actor" / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "base_model_name_or_path": str(tmp_path / "gone")})
    )
    (tmp_path / "taken").write_text("a file")
    err = run(capsys, "export", str(tmp_path), "--merge", "--out", str(tmp_path / "taken"))
    assert f"--out {str(tmp_path / 'taken')!r}: exists and is not an empty folder; name a" in err
    (tmp_path / "loop").symlink_to(tmp_path / "loop")  # it read as a new folder to merge into
    err = run(capsys, "export", str(tmp_path), "--merge", "--out", str(tmp_path / "loop"))
    assert f"--out {str(tmp_path / 'loop')!r} is a symbolic link loop" in err
    err = run(capsys, "export", str(tmp_path), "--merge")
    assert f"its base model {str(tmp_path / 'gone')!r} is not a folder here" in err
    # a run stopped while it wrote the export: the folder's files are not said to be a policy
    (tmp_path / "hf_actor.incomplete").write_text("")
    for merge in ([], ["--merge"]):
        err = run(capsys, "export", str(tmp_path), *merge)
        assert "hf_actor': incomplete: the run stopped (or runs) before it exported its last" in err


def test_static_decoding_of_a_sliding_window_model_is_refused_before_ray(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Accepted exactly when no sequence of the run can pass the window."""
    from transformers import LlamaConfig, MistralConfig

    from verlite.driver import preflight

    cfg = load_config(CONFIG, ["rollout.decode=static"])
    longest = cfg.max_sequence_length
    for window in (longest, longest + 1):
        monkeypatch.setattr(
            preflight,
            "hf_config",
            lambda *args, w=window: MistralConfig(vocab_size=64, sliding_window=w),
        )
        preflight.check_generation(cfg, 64)
        preflight.check_generation(
            load_config(CONFIG, ["rollout.decode=cuda_graphs", "model.device=cuda"]), 64
        )
    monkeypatch.setattr(
        preflight,
        "hf_config",
        lambda *args: MistralConfig(vocab_size=64, sliding_window=longest - 1),
    )
    with pytest.raises(
        UserError,
        match=rf"^rollout.decode=static: this mistral model attends through a sliding window "
        rf"of {longest - 1} tokens \(sliding_window\) and a sequence can be {longest} tokens",
    ):
        preflight.check_generation(cfg, 64)
    preflight.check_generation(load_config(CONFIG, ["rollout.decode=eager"]), 64)
    monkeypatch.setattr(
        preflight,
        "hf_config",
        lambda *args: LlamaConfig(
            vocab_size=64,
            rope_scaling={
                "rope_type": "longrope",
                "factor": 2.0,
                "short_factor": [1.0] * 64,
                "long_factor": [1.0] * 64,
                "original_max_position_embeddings": 16,
            },
        ),
    )
    with pytest.raises(UserError, match=r"rollout.decode=cuda_graphs: .*rope_type longrope"):
        preflight.check_generation(
            load_config(CONFIG, ["rollout.decode=cuda_graphs", "model.device=cuda"]), 64
        )
    preflight.check_generation(load_config(CONFIG, ["rollout.decode=static"]), 64)


@pytest.mark.parametrize(("total_gib", "refused"), [(1, True), (64, False)])
def test_generation_larger_than_this_machines_gpu_is_refused_before_ray(
    monkeypatch: pytest.MonkeyPatch, total_gib: int, refused: bool
) -> None:
    """A 0.5B-shaped policy generating 512 rows of 1088 positions on one GPU
    (``LARGE_GENERATION``: 6.4 GiB of KV cache alone)."""
    from types import SimpleNamespace

    from verlite.driver import preflight

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda device=None: SimpleNamespace(total_memory=total_gib * 2**30),
    )
    cfg = load_config(CONFIG, LARGE_GENERATION)
    if not refused:
        preflight.check_generation_fits(cfg, 32_000)
        return
    with pytest.raises(
        UserError,
        match=re.escape(
            "generation cannot fit Fake GPU (1.0 GiB): the KV cache of 512 rows per generating "
            "worker (data.train_batch_size x rollout.n / 1 workers) x 1088 positions "
            "(data.max_prompt_length + rollout.max_response_length) is 6.4 GiB and the weights"
        ),
    ):
        preflight.check_generation_fits(cfg, 32_000)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["train", "--config", CONFIG, "trainer.output_dir={loop}"], "trainer.output_dir={loop!r}"),
        (
            ["train", "--config", CONFIG, "trainer.resume={loop}/step_1"],
            "trainer.resume='{loop}/step_1'",
        ),
        (["check-invariance", "--config", CONFIG, "model.path={loop}"], "model.path={loop!r}"),
        (["submit", "--config", CONFIG, "--working-dir", "{loop}"], "--working-dir {loop!r}"),
        # a run folder, or its metrics.jsonl, read as "no such folder" (or "no metrics file")
        (["metrics", "{loop}"], "{loop!r}"),
        (["metrics", "{loop}/metrics.jsonl"], "'{loop}/metrics.jsonl'"),
        (["compare", "{loop}", "{loop}"], "{loop!r}"),
        (["export", "{loop}"], "{loop!r}"),
    ],
    ids=[
        "output_dir",
        "resume",
        "an input",
        "submit --working-dir",
        "metrics",
        "metrics file",
        "compare",
        "export",
    ],
)
def test_a_link_loop_a_user_names_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], named: str
) -> None:
    """Found in the sweep of every command's bad inputs: pathlib's RuntimeError for a path
    that is a link loop was a traceback (exit 1) where verlite resolved it; an input's loop
    was "no such file or directory"."""
    loop = str(tmp_path / "a")
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    err = run(capsys, *[arg.format(loop=loop) for arg in argv])
    assert err.startswith(f"verlite: error: {named.format(loop=loop)} is a symbolic link loop"), err


PASTED = "x" * 5000


@pytest.mark.parametrize(
    "argv",
    [
        ["compare", "a", "b", "--tolerance", PASTED],  # records.compare's number
        ["check-invariance", "--config", CONFIG, "--dp", PASTED],  # arguments.int_list
        ["metrics", PASTED[:200]],  # records.metrics_log: no such folder
        ["export", PASTED[:200]],  # export: no such folder
        ["check-invariance", "--config", CONFIG, "--micro", PASTED],  # a list flag's choices
        ["train", "--config", PASTED],  # user_files.read_text: cannot read (name too long)
        ["export", "configs", "--out", PASTED],  # export: --out without --merge
        ["check-invariance", "--config", CONFIG, "--run", "--layout", PASTED],  # run_invariance
    ],
    ids=[
        "compare-tolerance",
        "dp",
        "metrics-folder",
        "export-folder",
        "micro",
        "config-file",
        "export-out",
        "layout",
    ],
)
def test_a_pasted_value_is_quoted_cut(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    """A value a user pasted is quoted as every message quotes it (errors.shown): cut in the
    middle, not repeated whole (these were a bare repr)."""
    try:
        code = main(argv)
    except SystemExit as exit:  # argparse's refusal of a flag's value
        code = exit.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err[:300]
    assert "[...]" in err and len(err) < 400, err[:300]
