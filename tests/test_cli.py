"""The ``verlite`` command line is assembled from its command modules: each registers its
commands through ``add_commands``, every command with the handler that runs it."""

import argparse

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
