"""`verlite check-invariance` end to end (real ranks), through ``verlite.cli.main`` in this
process: the command's own code without a fresh interpreter's seconds of imports (tests/e2e
and tests/jobs run ``verlite`` as a user does, in a subprocess)."""

import json
from pathlib import Path

import pytest
import torch

CONFIG = "configs/ppo_tiny.yaml"


def test_json_report_ok(verlite_main) -> None:
    """The configured optimizer (AdamW, clipping) in float32: 3 steps by default and the
    tolerance for AdamW's magnified rounding."""
    proc = verlite_main(
        "check-invariance",
        "--config",
        CONFIG,
        "--dp",
        "1,2",
        "--micro",
        "2,dynamic",
        "--strategy",
        "fsdp",
        "--optimizer",
        "configured",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["tolerance"] == 1e-3
    assert (report["optimizer"], report["steps"], report["sequences"]) == ("configured", 3, 16)
    # What the text's first lines say: the layouts' common settings, no offload line.
    assert (report["precision"], report["rank_launches"]) == ("fp32", 2)
    assert (report["negative_control"], report["offload_note"]) == (False, None)
    assert proc.stderr == ""
    assert len(report["layouts"]) == 2 * 2 * 2  # dp x micro x role
    keys = {
        "dp",
        "micro",
        "strategy",
        "role",
        "max_rel_grad_diff",
        "max_rel_param_diff",
        "loss_diff",
        "grad_norm_diff",
    }
    for layout in report["layouts"]:
        assert keys <= layout.keys()
        assert layout["max_rel_grad_diff"] < 1e-3
    assert {(x["dp"], x["micro"], x["role"]) for x in report["layouts"]} == {
        (dp, micro, role)
        for dp in (1, 2)
        for micro in ("2", "dynamic")
        for role in ("actor", "critic")
    }


def test_table_and_failure_exit_code_with_the_negative_control(verlite_main) -> None:
    proc = verlite_main(
        "check-invariance",
        "--config",
        CONFIG,
        "--dp",
        "2",
        "--micro",
        "1",
        "--strategy",
        "ddp",
        "--negative-control",
    )
    assert proc.returncode == 1
    assert "FAIL" in proc.stdout and "FAILED: 2 layouts" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--micro", "3"], "allowed: 1,2,full,dynamic"),
        (["--dp", "0"], "expected positive integers"),
        (["--dp", "1000"], "--dp 1000: its ranks need about 500.0 GiB (512 MiB each)"),
        (
            ["--dp", "5,7,11"],
            "--dp 5,7,11: the audit's batch would hold 6160 sequences (the least multiple of 16 "
            "that every size splits into equal shares), over the 1024 allowed;",
        ),
        (["--strategy", "zero"], "allowed: ddp,fsdp"),
        (["--steps", "0"], "argument --steps: expected a positive integer, got '0'"),
        (["--steps", "3,"], "argument --steps: expected a positive integer, got '3,'"),
        (["--optimizer", "adam"], "argument --optimizer: invalid choice: 'adam'"),
        (["actor.loss_agg_mode=mean"], "actor.loss_agg_mode='mean'"),
        (["--tolerance", "-1"], "expected a positive finite number, got '-1'"),
        (["--tolerance", "nan"], "expected a positive finite number, got 'nan'"),
        # the whole-run audit's flags, refused before any Ray starts
        (["--layout", "2:ddp:1"], "--layout needs --run"),
        (["--atol", "1e-9"], "--atol needs --run"),
        (["--run", "--dp", "2"], "--dp is for the one-update audit; with --run, give --layout"),
        (["--run", "--layout", "2:ddp"], "--layout '2:ddp': expected WORKERS:STRATEGY:MICRO"),
        (
            ["--run", "--layout", "0:ddp:1"],
            "--layout '0:ddp:1': actor workers '0': expected an integer from 1 to 2147483647",
        ),
        (  # a digit to str.isdigit that int() refuses: a traceback before
            ["--run", "--layout", "\u00b2:ddp:1"],
            "--layout '\u00b2:ddp:1': actor workers '\u00b2': expected an integer from 1 to",
        ),
        (  # more digits than int() reads: a traceback before
            ["--run", "--layout", f"{'1' * 5000}:ddp:1"],
            "actor workers '1111111111",
        ),
        (
            ["--run", "--layout", "1:ddp:1/3000000000:ddp:1"],
            "critic workers '3000000000': expected an integer from 1 to 2147483647",
        ),
        (["--run", "--layout", "2:zero:1"], "actor strategy 'zero': expected one of ddp, fsdp"),
        (
            ["--run", "--layout", "2:ddp:half"],
            "actor micro 'half': expected a number of rows (an integer from 1 to 2147483647) or "
            "one of full, dynamic, packed, packed-dynamic, checkpointed",
        ),
        (["--run", "--layout", "1:ddp:1/1:ddp:1/1:ddp:1"], "expected WORKERS:STRATEGY:MICRO"),
        (["--run", "--layout", "1:ddp:full"], "give at least 2, got 1"),
        (["--run", "--layout", "1:ddp:1/1:ddp:1/0:3"], "reward workers '0': expected an integer"),
        (
            ["--run", "--layout", "1:ddp:1/1:ddp:1/2:dynamic"],
            "reward micro 'dynamic': expected a number of rows (an integer from 1 to 2147483647) "
            "or full",
        ),
        (["--run", "--layout", "1:ddp:1/1:ddp:1/2:3/1:1"], "expected WORKERS:STRATEGY:MICRO"),
        (
            # ppo_tiny has no reward model: a reward part is refused, not ignored
            ["--run", "--layout", "1:ddp:full", "--layout", "2:fsdp:1/1:ddp:full/2:3"],
            "--layout 2:fsdp:1/1:ddp:full/2:3: the reward part 2:3 is for a reward model's "
            "group, and the config has none (reward.model.path is unset)",
        ),
        (
            ["--run", "--layout", "1:ddp:full", "--layout", "3:ddp:full"],
            # the layout named first: the keys in the config's message are the layout's
            "--layout 3:ddp:full/1:ddp:full (actor.workers_per_node=3 actor.strategy=ddp ",
        ),
        (
            ["--run", "--layout", "1:ddp:full", "--layout", "3:ddp:full"],
            "): actor.ppo_mini_batch_size=16 must be divisible by the actor's 3 workers",
        ),
        # an input that is not there: a transformers traceback from the ranks (exit 1) before
        (["model.path=/no/such/model"], "model.path='/no/such/model': no such file or directory"),
        (["--run", "model.path=/no/such/model"], "model.path='/no/such/model': no such file"),
        (
            ["data.task=null", "data.train_file=/no/such.jsonl"],
            "data.train_file='/no/such.jsonl': no such file or directory",
        ),
    ],
)
def test_user_errors_exit_2_in_one_line(verlite_main, args: list[str], message: str) -> None:
    proc = verlite_main("check-invariance", "--config", CONFIG, *args)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr


def test_whole_runs_need_a_new_or_empty_runs_dir(verlite_main, tmp_path) -> None:
    (tmp_path / "earlier.txt").write_text("someone's file")
    proc = verlite_main(
        "check-invariance", "--run", "--config", CONFIG, "--runs-dir", str(tmp_path)
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert f"--runs-dir {str(tmp_path)!r}: the folder is not empty" in proc.stderr
    assert (tmp_path / "earlier.txt").read_text() == "someone's file"


def test_a_runs_dir_that_cannot_be_a_new_folder_is_one_line(verlite_main, tmp_path) -> None:
    (file := tmp_path / "file").write_text("x")
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    for runs_dir, message in (
        (file, f"--runs-dir {str(file)!r}: not a folder"),
        (
            file / "sub",
            f"--runs-dir {str(file / 'sub')!r}: cannot make the folder: Not a directory",
        ),
        ("", "argument --runs-dir: expected a path, got an empty string"),
        # "cannot make the folder: File exists" before
        (tmp_path / "a", f"--runs-dir {str(tmp_path / 'a')!r} is a symbolic link loop"),
    ):
        proc = verlite_main(
            "check-invariance", "--run", "--config", CONFIG, "--runs-dir", str(runs_dir)
        )
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert message in proc.stderr


def test_missing_config_file(verlite_main) -> None:
    proc = verlite_main("check-invariance", "--config", "nope.yaml")
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == "verlite: error: cannot read config file 'nope.yaml': No such file or directory"
    )


def test_a_gpu_audit_needs_a_gpu_per_rank(verlite_main) -> None:
    """Refused in its line alone: the audit's progress line ("checking 56 layouts ...") came
    first, as if the audit had started."""
    if torch.cuda.device_count() >= 4:
        pytest.skip("this machine has a GPU for every rank of --dp 4")
    proc = verlite_main("check-invariance", "--config", CONFIG, "model.device=cuda", "--dp", "1,4")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(
        "verlite: error: --dp 4 with model.device=cuda: NCCL needs one GPU per rank: 4 ranks"
    ), proc.stderr


def test_a_gpu_audit_in_bf16_needs_bf16_arithmetic(verlite_main, monkeypatch) -> None:
    """The audit's ranks run on this machine's GPUs: bf16 on one that only emulates it is
    refused as ``verlite train`` refuses it (it was not checked: on a T4 the ranks ran)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    proc = verlite_main("check-invariance", "--config", CONFIG, "model.device=cuda", "--dp", "1")
    assert proc.returncode == 2
    assert proc.stderr == (
        "verlite: error: model.precision=auto (which is bf16-mixed on cuda): the workers' "
        "GPU (Tesla T4) has no bf16 arithmetic; set model.precision=fp32\n"
    ), proc.stderr


def test_packed_layouts_of_a_window_a_sequence_passes_are_one_line(
    verlite_main, tmp_path, capsys
) -> None:
    """A Mistral whose window (8) is shorter than the audit's rows: packed attention applies
    no window, so the packed layouts are refused before any rank starts (they stopped in the
    ranks' first packed pass); the padded layouts run it (tests/workers/test_moe_training.py)."""
    from tests.model_support import tiny_sliding

    tiny_sliding("mistral", 8).save_pretrained(tmp_path)
    capsys.readouterr()  # the save's progress bar
    args = ["check-invariance", "--config", CONFIG, f"model.path={tmp_path}", "--dp", "1"]
    proc = verlite_main(*args, "--micro", "1,packed-dynamic")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(
        "verlite: error: --micro packed-dynamic: 2 of the model's 2 layers attend through a "
        "sliding window of 8 tokens (sliding_window), and a sequence can be "
        "data.max_prompt_length + rollout.max_response_length = 12 tokens;"
    ), proc.stderr
    assert proc.stderr.endswith("; leave the packed layouts out\n")


def test_packed_layouts_of_a_model_that_mixes_packed_sequences_are_one_line(
    verlite_main, monkeypatch
) -> None:
    """The packed layouts are checked as ``verlite train`` checks ``actor.packing=true``
    (``models.support.packing_unsupported``), not only for a sliding window: a model whose attention
    lets packed sequences attend to each other (here the packed attention replaced by one
    over the whole row, tests/workers/test_packing.py) was audited by ranks that do not see
    the replacement; now refused before any rank starts."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from verlite.models.varlen import ATTENTION, KWARG

    def mixing_attention(module, query, key, value, attention_mask, **kwargs):
        kwargs.pop(KWARG, None)
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, ATTENTION, mixing_attention)
    args = ["check-invariance", "--config", CONFIG, "--dp", "1", "--strategy", "ddp"]
    proc = verlite_main(*args, "--micro", "1,packed")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("verlite: error: --micro packed: "), proc.stderr
    assert "lets packed sequences attend to each other" in proc.stderr
    assert proc.stderr.endswith("; leave the packed layouts out\n")


def save_tiny_jetmoe(path: Path) -> None:
    """A two-layer JetMoe (a real causal LM class without activation checkpointing, its
    trunk neither) saved in ``path``."""
    from transformers import JetMoeConfig, JetMoeForCausalLM

    config = JetMoeConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_key_value_heads=2,
        kv_channels=8,
        intermediate_size=32,
        num_local_experts=2,
        num_experts_per_tok=1,
    )
    JetMoeForCausalLM(config).save_pretrained(path)


def test_the_checkpointed_layout_of_a_model_without_checkpointing_is_one_line(
    verlite_main, tmp_path, capsys
) -> None:
    """JetMoe (a real causal LM class) has no activation checkpointing: the checkpointed
    layout, one of the default --micro, is refused before any rank starts (each rank's
    build raised Hugging Face's ValueError: a traceback, exit 1)."""
    save_tiny_jetmoe(tmp_path)
    capsys.readouterr()  # the save's progress bar
    args = ["check-invariance", "--config", CONFIG, f"model.path={tmp_path}", "--dp", "1"]
    proc = verlite_main(*args, "--micro", "1,checkpointed")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr == (
        "verlite: error: --micro checkpointed: JetMoeForCausalLM (the actor's model) does not "
        "support activation checkpointing; leave checkpointed out of --micro\n"
    )


def test_the_configs_packing_and_checkpointing_are_checked_before_any_rank_starts(
    verlite_main, tmp_path, capsys
) -> None:
    """The audit's layouts keep the config's ``<role>.packing`` and
    ``<role>.gradient_checkpointing`` (a micro layout sets only its own fields): where the
    model does not support them they were refused by no one before the ranks, which stopped
    with a traceback (PackingUnsupported, Hugging Face's ValueError; exit 1). Now as
    ``verlite train`` refuses them (``models.support.check_training_features``)."""
    from tests.model_support import tiny_sliding

    tiny_sliding("mistral", 8).save_pretrained(tmp_path / "mistral")
    save_tiny_jetmoe(tmp_path / "jetmoe")
    capsys.readouterr()  # the saves' progress bars
    args = ["check-invariance", "--config", CONFIG, "--dp", "1", "--micro", "1"]
    for settings, line in (
        (
            [f"model.path={tmp_path / 'mistral'}", "actor.packing=true"],
            "actor.packing=true: 2 of the model's 2 layers attend through a sliding window of 8 "
            "tokens",
        ),
        (
            [f"model.path={tmp_path / 'jetmoe'}", "critic.gradient_checkpointing=true"],
            "critic.gradient_checkpointing=true: JetMoeModel does not support activation "
            "checkpointing; set critic.gradient_checkpointing=false\n",
        ),
    ):
        proc = verlite_main(*args, *settings)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith(f"verlite: error: {line}"), proc.stderr


@pytest.mark.parametrize("model", ["path", "builtin"])
def test_a_model_whose_vocabulary_is_under_the_audits_is_audited(
    verlite_main, tmp_path, capsys, model: str
) -> None:
    """The audit draws its batch's ids below 64 (audit.invariance.VOCAB_SIZE): a model of 32
    tokens (a model.path folder, or model.vocab_size=32) got ids past its embedding, an
    IndexError traceback in the reference pass, or a refusal of model.vocab_size=32 as
    'below the tokenizer's 64 tokens', a tokenizer the audit does not have."""
    from tests.model_support import tiny_qwen2

    if model == "path":
        tiny_qwen2(tied=False, vocab_size=32).save_pretrained(tmp_path)
        capsys.readouterr()  # the save's progress bar
        setting = f"model.path={tmp_path}"
    else:
        setting = "model.vocab_size=32"
    args = ["--dp", "1", "--micro", "1,packed", "--strategy", "ddp", "--json"]
    proc = verlite_main("check-invariance", "--config", CONFIG, setting, *args)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ok"] is True


NOTE = (
    "critic.offload=all (FSDP2's CPU offload) runs in the fsdp layouts only: the "
    "reference and the ddp layouts run without it"
)


@pytest.mark.parametrize("as_json", [False, True])
def test_offload_all_is_audited_in_the_fsdp_layouts_only_and_said_so(
    verlite_main, as_json: bool
) -> None:
    """``<role>.offload=all`` is FSDP2's CPU offload: the audit's ddp layouts and its
    single-process reference cannot offload, and kept the setting while it did nothing,
    silently. They now run without it (``TrainEngine`` refuses it under another strategy),
    and the first line says which layouts exercise it; ``--json`` says it in a field."""
    proc = verlite_main(
        "check-invariance",
        "--config",
        CONFIG,
        "critic.strategy=fsdp",
        "critic.offload=all",
        "--dp",
        "1",
        "--micro",
        "full",
        *(["--json"] if as_json else []),
    )
    assert proc.returncode == 0, proc.stderr
    if as_json:
        report = json.loads(proc.stdout)
        assert (report["offload_note"], report["rank_launches"]) == (NOTE, 2)
        assert (report["precision"], report["tolerance"]) == ("fp32", 1e-5)
        return
    assert proc.stderr.splitlines()[:2] == [
        "checking 4 layouts in 2 rank launches on a batch of 16 sequences ...",
        NOTE,
    ], proc.stderr


def test_a_layout_list_says_how_large_its_batch_is_up_front(verlite_main, monkeypatch) -> None:
    """--dp 5,7 audits a batch of 560 sequences (lcm(16, 5, 7)): said before the ranks start
    (here the audit is stopped as it would start them)."""
    from verlite.audit import invariance
    from verlite.errors import UserError

    def stopped(*args: object, **kwargs: object) -> None:
        raise UserError("stopped before the ranks start")

    monkeypatch.setattr(invariance, "check_invariance", stopped)
    proc = verlite_main("check-invariance", "--config", CONFIG, "--dp", "5,7", "--micro", "1")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "checking 8 layouts in 4 rank launches on a batch of 560 sequences (the least multiple "
        "of 16 that every --dp size splits into equal shares) ...",
        "verlite: error: stopped before the ranks start",
    ]
    # one launch is said in the singular ("in 1 rank launches")
    proc = verlite_main(
        "check-invariance", "--config", CONFIG, "--dp", "2", "--strategy", "ddp", "--micro", "1"
    )
    assert proc.stderr.splitlines()[0] == (
        "checking 2 layouts in 1 rank launch on a batch of 16 sequences ..."
    )


def test_whole_runs_are_checked_before_ray_starts(
    verlite_main, tmp_path, capsys, monkeypatch
) -> None:
    """Each layout's run is checked as ``verlite train`` checks it before Ray starts
    (``driver.run.prepare_run``): those checks ran in the audit's Ray session, each just
    before its run, so a stop token outside the vocabulary was refused after Ray started,
    a later layout's packed run of a sliding-window model after the earlier layouts had
    trained. Now every one is refused with Ray never started; a later layout's refusal names the layout."""
    from tests.chat_model_support import chat_tokenizer
    from tests.model_support import tiny_sliding
    from verlite.controller import session

    def no_ray(*args: object, **kwargs: object) -> None:
        raise AssertionError("Ray started")

    monkeypatch.setattr(session, "start_ray", no_ray)

    def audit(name: str, *args: str):  # each in a runs folder of its own
        runs = ["--runs-dir", str(tmp_path / name)]
        return verlite_main("check-invariance", "--run", "--config", CONFIG, *runs, *args)

    proc = audit("stops", "rollout.stop_token_ids=[999999]")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("verlite: error: rollout.stop_token_ids=[999999]: [999999] ")

    tokenizer = chat_tokenizer()
    tokenizer.save_pretrained(tmp_path / "mistral")
    tiny_sliding("mistral", 8, vocab_size=len(tokenizer)).save_pretrained(tmp_path / "mistral")
    capsys.readouterr()  # the save's progress bar
    layouts = ["--layout", "1:ddp:full", "--layout", "1:ddp:packed"]
    proc = audit("window", *layouts, f"model.path={tmp_path / 'mistral'}")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(
        "verlite: error: --layout 1:ddp:packed/1:ddp:full: actor.packing=true: 2 of the "
        "model's 2 layers attend through a sliding window of 8 tokens"
    ), proc.stderr


@pytest.mark.parametrize(
    ("settings", "cpus"),
    [
        ([], 6),
        (["trainer.cpus_per_worker=0.5"], 6),
        (["trainer.cpus_per_worker=2"], 12),
        (["rollout.placement=split"], 7),
    ],
)
def test_the_audits_ray_has_room_for_every_layouts_workers(
    verlite_main, tmp_path, monkeypatch, settings: list[str], cpus: int
) -> None:
    """The embedded Ray the audit starts has the CPUs its largest layout's workers ask for,
    at least one a worker: 6 for ppo_tiny's default layouts (with half a CPU a worker too),
    12 with two CPUs a worker, 7 with a rollout group beside the actor and critic. It had one
    a worker (6) whatever they asked for: such a config, which ``verlite train`` runs, was
    refused before Ray started ('the workers ask for 10 CPUs (actor 4x2 + critic 1x2), the
    embedded Ray has 6; lower the workers per node or the CPUs/GPUs per worker'), the Ray
    that was too small being the audit's own choice."""
    from verlite.controller import session

    started: list[int | None] = []

    def no_ray(address: str | None, *, num_cpus: int | None = None) -> None:
        started.append(num_cpus)
        raise KeyboardInterrupt  # the audit stops here, in one line

    monkeypatch.setattr(session, "start_ray", no_ray)
    runs = ["--runs-dir", str(tmp_path / "runs")]
    proc = verlite_main("check-invariance", "--run", "--config", CONFIG, *runs, *settings)
    assert proc.returncode == 130, proc.stderr
    assert started == [cpus]


def test_the_runs_checked_before_the_audit_hold_no_math_verify_process(tmp_path) -> None:
    """Every layout's run is checked, its inputs read, before the audit's Ray starts, and held
    until it runs: reading the answers started a math-verify process for each (24 layouts, 24
    processes of sympy held through the audit). Each is let go; its run starts one again."""
    from verlite.audit.run_invariance import (
        DEFAULT_LAYOUTS,
        layout_configs,
        prepare_runs,
        release,
    )
    from verlite.config import load_config

    layouts = DEFAULT_LAYOUTS[:2]
    base = load_config(CONFIG, ["reward.fn=math"])
    configs = layout_configs(base, layouts, steps=1, runs_dir=tmp_path / "runs")
    prepared = prepare_runs(configs, layouts, in_session=False, cpus=8)
    try:
        rewards = [run.inputs.reward_fn for run in prepared]
        assert [type(fn).__name__ for fn in rewards] == ["MathReward", "MathReward"]
        assert [fn._process for fn in rewards] == [None, None]
        assert rewards[0](r"\boxed{12}", "12", "") == 1.0  # its run's first call starts one
    finally:
        release(prepared)
        for run in prepared:
            run.inputs.reward_fn.close()


@pytest.mark.parametrize("config", ["configs/grpo_tiny.yaml", "configs/ppo_tiny.yaml"])
def test_the_audit_sets_no_setting_a_run_names_as_without_effect(config: str, tmp_path) -> None:
    """Each run's start-up line names the settings its config sets that have no effect
    (config.inert): the audit's own critic.warmup_steps=0 is not among them. It was set
    for every job, so each run of a GRPO job said, in its console.log, that
    critic.warmup_steps has no effect; with a critic the runs skip the warm-up."""
    from verlite.audit.run_invariance import DEFAULT_LAYOUTS, layout_configs
    from verlite.config import load_config
    from verlite.config.inert import inert_settings_line

    base = load_config(config)
    configs = layout_configs(base, DEFAULT_LAYOUTS[:2], steps=1, runs_dir=tmp_path / "runs")
    lines = [inert_settings_line(c) or "" for c in configs]
    assert not any("critic.warmup_steps" in line for line in lines), lines
    assert all(c.critic.warmup_steps == 0 for c in configs)


def test_a_multi_turn_configs_audit_batch_spans_every_turn() -> None:
    """The update audit's rows reach the whole response area of a multi-turn config
    (rollout.multi_turn.max_total_length, tool_tiny's 16 tokens), not one turn's
    rollout.max_response_length (4): the layouts never saw a row as long as a multi-turn
    run trains on."""
    from verlite.audit.invariance import make_batch
    from verlite.config import load_config

    cfg = load_config("configs/tool_tiny.yaml")
    assert cfg.response_width > cfg.rollout.max_response_length
    batch = make_batch(cfg, num_sequences=64)
    assert batch["input_ids"].shape[1] == cfg.max_sequence_length
    longest = int(batch["attention_mask"][:, cfg.data.max_prompt_length :].sum(1).max())
    assert longest > cfg.rollout.max_response_length


def reward_model_overrides(folder: Path) -> list[str]:
    from tests.reward_model_support import save_tiny_reward_model

    rm = save_tiny_reward_model(folder)
    return [f"reward.model.path={rm}", "reward.combine={fn: 0.5, model: 0.5}"]


def test_whole_runs_vary_a_reward_models_group(tmp_path) -> None:
    """With a reward model, the default layouts vary its group too (it kept the config's
    workers and micro-batch in every run): 1 worker scoring a step's rows in one forward,
    then 2 workers in micro-batches of 1, 3 and 2 rows; a layout's reward part sets the
    group, one without keeps the config's; the report names the group."""
    from verlite.audit.run_invariance import layout_configs, parse_layout, run_layouts
    from verlite.config import load_config

    overrides = reward_model_overrides(tmp_path / "rm")
    base = load_config(CONFIG, overrides)
    layouts = run_layouts(base)
    configs = layout_configs(base, layouts, steps=1, runs_dir=tmp_path / "runs")
    groups = [
        (c.reward.model.workers_per_node, c.reward.model.micro_batch_size_per_worker)
        for c in configs
    ]
    assert groups == [(1, base.sequences_per_step), (2, 1), (2, 3), (2, 2)]
    assert [layout.spec for layout in layouts] == [
        "1:ddp:full/1:ddp:full/1:full",
        "2:fsdp:1/2:ddp:dynamic/2:1",
        "4:ddp:dynamic/1:fsdp:1/2:3",
        "4:fsdp:full/2:fsdp:full/2:2",
    ]
    assert layouts[1].describe(use_critic=True) == (
        "actor 2 fsdp micro 1, critic 2 ddp micro dynamic, reward 2 micro 1"
    )
    assert [layout.workers for layout in layouts] == [3, 6, 7, 8]

    given = run_layouts(
        base, [parse_layout("1:ddp:full"), parse_layout("2:fsdp:1/1:ddp:full/2:full")]
    )
    configured = (base.reward.model.workers_per_node, base.reward.model.micro_batch_size_per_worker)
    assert [layout.spec for layout in given] == [
        f"1:ddp:full/1:ddp:full/{configured[0]}:{configured[1]}",
        "2:fsdp:1/1:ddp:full/2:full",
    ]
    configs = layout_configs(base, given, steps=1, runs_dir=tmp_path / "given")
    assert [
        (c.reward.model.workers_per_node, c.reward.model.micro_batch_size_per_worker)
        for c in configs
    ] == [configured, (2, base.sequences_per_step)]


def test_the_audits_ray_has_room_for_the_reward_models_workers(
    verlite_main, tmp_path, monkeypatch
) -> None:
    """The largest default layout of a reward model's config has 4 actor, 2 critic and 2
    reward workers: the embedded Ray gets a CPU each, 8, though they ask for half a CPU
    each."""
    from verlite.controller import session

    started: list[int | None] = []

    def no_ray(address: str | None, *, num_cpus: int | None = None) -> None:
        started.append(num_cpus)
        raise KeyboardInterrupt  # the audit stops here, in one line

    monkeypatch.setattr(session, "start_ray", no_ray)
    settings = [*reward_model_overrides(tmp_path / "rm"), "trainer.cpus_per_worker=0.5"]
    runs = ["--runs-dir", str(tmp_path / "runs")]
    proc = verlite_main("check-invariance", "--run", "--config", CONFIG, *runs, *settings)
    assert proc.returncode == 130, proc.stderr
    assert started == [8]


def test_the_whole_run_audit_reads_its_config_file_once(
    verlite_main, tmp_path, monkeypatch
) -> None:
    """The command loaded the user's config and overrides three times (itself,
    check_run_invariance, layout_configs) and each layout's run from the file again: every
    layout's config is now the one loaded config with the layout's keys."""
    from verlite.config import loading
    from verlite.controller import session

    read: list[str] = []
    read_mapping = loading.read_mapping

    def counted(path: str, **kwargs: object) -> object:
        read.append(str(path))
        return read_mapping(path, **kwargs)

    def no_ray(address: str | None, *, num_cpus: int | None = None) -> None:
        raise KeyboardInterrupt  # every layout's config was made before Ray starts

    monkeypatch.setattr(loading, "read_mapping", counted)
    monkeypatch.setattr(session, "start_ray", no_ray)
    runs = ["--runs-dir", str(tmp_path / "runs")]
    proc = verlite_main("check-invariance", "--run", "--config", CONFIG, *runs)
    assert proc.returncode == 130, proc.stderr
    assert read == [CONFIG]
