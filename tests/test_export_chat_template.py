"""`verlite export`'s line about a chat template: the call that renders the prompts the run
trained on, with the template variables the run set (data.chat_template_kwargs, read from
the run's config.json)."""

import json
from pathlib import Path

import pytest
from chat_model_support import THINKING_TEMPLATE, chat_tokenizer

from verlite.cli import main


@pytest.mark.parametrize(
    ("data", "arguments"),
    [
        ({"chat_template": True}, ""),
        (
            {"chat_template": True, "chat_template_kwargs": {"enable_thinking": False}},
            ", enable_thinking=False",
        ),
    ],
    ids=["no variables", "enable_thinking"],
)
def test_the_export_line_names_the_template_variables_of_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], data: dict, arguments: str
) -> None:
    policy = tmp_path / "hf_actor"
    chat_tokenizer(THINKING_TEMPLATE).save_pretrained(policy)
    (policy / "config.json").write_text("{}")  # the model's, in a real export
    (tmp_path / "config.json").write_text(json.dumps({"data": data}))
    assert main(["export", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{policy}: full weights (Hugging Face format)",
        f"{policy}: its tokenizer has a chat template; generate from "
        f"tokenizer.apply_chat_template(messages, add_generation_prompt=True{arguments}), the "
        "prompts a run with data.chat_template=true trained on",
    ]
