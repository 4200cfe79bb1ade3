"""The ``verlite`` command line is assembled from its command modules: each registers its
commands through ``add_commands``, every command with the handler that runs it."""

import argparse
import importlib.metadata

import pytest

from verlite import cli


def test_every_command_module_registers_commands_that_each_have_a_handler() -> None:
    commands: dict[str, argparse.ArgumentParser] = {}
    for module in cli.COMMAND_MODULES:
        parser = argparse.ArgumentParser()
        subparsers = parser.add_subparsers(dest="command")
        module.add_commands(subparsers)
        assert subparsers.choices, f"{module.__name__} registers no command"
        assert not commands.keys() & subparsers.choices.keys()
        commands.update(subparsers.choices)
    for name, parser in commands.items():
        assert callable(parser.get_default("handler")), name
    assert list(commands) == [
        "train",
        "check-invariance",
        "measure-packing",
        "metrics",
        "compare",
        "export",
        "submit",
        "status",
        "logs",
        "stop",
        "list",
    ]


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        cli.main(list(argv))
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1, err
    return err


def test_a_misspelled_flag_is_named_by_its_command_before_the_flags_it_leaves_missing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # argparse alone says "the following arguments are required: --config"
    assert _refused(capsys, "train", "--confg", "configs/ppo_tiny.yaml") == (
        "verlite train: error: unrecognized arguments: --confg (did you mean --config?) "
        "(see verlite train --help)\n"
    )
    # with every required flag given, the command (not `verlite`) names it, with its help
    err = _refused(capsys, "check-invariance", "--config", "configs/ppo_tiny.yaml", "--mikro", "1")
    assert err == (
        "verlite check-invariance: error: unrecognized arguments: --mikro (did you mean "
        "--micro?) (see verlite check-invariance --help)\n"
    )
    # a dotted key written as a flag, as other trainers take overrides: the override it meant
    err = _refused(capsys, "train", "--config", "c.yaml", "--trainer.total_steps=5", "--actor.lr")
    assert err == (
        "verlite train: error: unrecognized arguments: --trainer.total_steps=5 (an override "
        "takes no dashes: trainer.total_steps=5) --actor.lr (an override takes no dashes: "
        "actor.lr=VALUE) (see verlite train --help)\n"
    )
    # a flag the command knows by a prefix is no mistake; nothing given is still "required"
    assert "required: --config" in _refused(capsys, "train")
    # the config file given without its flag (read as an override): the flag to write
    assert _refused(capsys, "train", "configs/ppo_tiny.yaml", "trainer.seed=1") == (
        "verlite train: error: the following arguments are required: --config; give the "
        "config file with the flag: --config configs/ppo_tiny.yaml (see verlite train --help)\n"
    )
    # never another flag's value: submit's --runtime-env FILE is no config file
    assert _refused(capsys, "submit", "--runtime-env", "env.yaml", "job.yaml") == (
        "verlite submit: error: the following arguments are required: --config; give the "
        "config file with the flag: --config job.yaml (see verlite submit --help)\n"
    )
    assert _refused(capsys, "submit", "--runtime-env", "env.yaml", "a=1").startswith(
        "verlite submit: error: the following arguments are required: --config (see"
    )
    assert "unrecognized" not in _refused(capsys, "check-invariance", "--micr", "1")
    # after --, words are positional (overrides); verlite itself asks for its command
    assert "required: --config" in _refused(capsys, "train", "--", "--confg")
    assert "required: COMMAND" in _refused(capsys)


def test_overrides_on_both_sides_of_a_flag_are_all_taken_in_their_order(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # argparse takes the first run of overrides for the positional and left the rest over:
    # "unrecognized arguments: b=2 c=3", of overrides that are valid
    parser = cli.build_parser()
    argv = ["train", "a=1", "--config", "c.yaml", "b=2", "--address", "x", "c=3"]
    assert cli._parse(parser, argv).overrides == ["a=1", "b=2", "c=3"]
    for command in (["check-invariance", "--run"], ["submit", "--wait"]):
        argv = [command[0], "--config", "c.yaml", "a=1", command[1], "b=2"]
        assert cli._parse(parser, argv).overrides == ["a=1", "b=2"], command
    # after --, every word is an override, as before the first flag (was "unrecognized
    # arguments: --" once the positional had taken a=1)
    argv = ["submit", "--config", "c.yaml", "a=1", "--wait", "--", "b=2", "--c=3"]
    assert cli._parse(parser, argv).overrides == ["a=1", "b=2", "--c=3"]
    # an unknown flag among them is still refused, alone
    assert _refused(capsys, "train", "--config", "c.yaml", "a=1", "--confg", "b.yaml", "b=2") == (
        "verlite train: error: unrecognized arguments: --confg (did you mean --config?) "
        "(see verlite train --help)\n"
    )
    # a command without overrides refuses a word it does not take, as before
    assert "unrecognized arguments: c" in _refused(
        capsys, "compare", "a", "--tolerance", "0", "b", "c"
    )


def test_a_flag_given_before_the_command_is_named_with_the_commands_that_know_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # argparse alone takes the config's path for the command ("invalid choice"), or says
    # that COMMAND is required
    err = _refused(capsys, "--config", "configs/ppo_tiny.yaml", "trainer.seed=1")
    assert err == (
        "verlite: error: --config is a flag of verlite train, verlite check-invariance, verlite "
        "measure-packing, verlite submit, given before the command; a command comes first, as "
        "in: verlite train --config configs/ppo_tiny.yaml trainer.seed=1 (see verlite --help)\n"
    )
    # a command given after the flag is the one the line puts first, or named as not its own
    assert _refused(capsys, "--dp", "3", "check-invariance", "--config", "a.yaml").endswith(
        "as in: verlite check-invariance --dp 3 --config a.yaml (see verlite --help)\n"
    )
    assert _refused(capsys, "--out", "x", "compare", "a", "b") == (
        "verlite: error: --out is not a flag of verlite compare (a flag of verlite export) "
        "(see verlite --help)\n"
    )
    assert _refused(capsys, "--confg=a.yaml") == (
        "verlite: error: unrecognized arguments: --confg=a.yaml (did you mean --config?); a "
        "command comes first: verlite COMMAND ... (see verlite --help)\n"
    )
    assert "unrecognized arguments: --verbose (did you mean --version?)" in _refused(
        capsys, "--verbose"
    )
    assert _refused(capsys, "trian").endswith("; did you mean train? (see verlite --help)\n")
    assert "did you mean" not in _refused(capsys, "xyz")


def test_the_version_is_installed_verlites_or_says_it_runs_from_source(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"verlite {importlib.metadata.version('verlite')}\n"

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    # an offline GPU machine runs verlite from its folder on PYTHONPATH: every command works
    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out == "verlite (not installed: run from its source folder)\n"


def test_check_invariance_help_states_the_defaults_the_audits_compare_with(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Its --atol once said 1e-15 for float64 where --run compared with 1e-13.
    from verlite.audit.tolerances import CONFIGURED_OPTIMIZER_TOLERANCE, RUN_ATOL, TOLERANCE

    with pytest.raises(SystemExit) as info:
        cli.main(["check-invariance", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())

    def stated(after: str) -> dict[str, float]:
        listed = text.split(after, 1)[1].split(";", 1)[0].split(")", 1)[0]
        return {name: float(value) for name, value in (p.split() for p in listed.split(", "))}

    assert (
        stated("--tolerance TOLERANCE max relative difference (default by model.precision: ")
        == TOLERANCE
    )
    assert stated("with --optimizer configured: ") == CONFIGURED_OPTIMIZER_TOLERANCE
    assert stated("exact arithmetic (default by model.precision: ") == RUN_ATOL
