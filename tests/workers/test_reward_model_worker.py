"""The reward worker group (``reward.model.path``) on the shared Ray: each response's score,
returned in row order, is what a single-process Hugging Face forward of the same model gives
the same text alone, with 1 or 2 workers and micro-batches that split the rows; the texts are
the policy's tokens read as text and tokenized again by the reward model's own tokenizer."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from reward_model_support import reference_scores, save_tiny_reward_model
from tensordict import TensorDict

from verlite.config import load_config
from verlite.controller import WorkerGroup
from verlite.controller.resource_pool import build_pools
from verlite.data import build_task_tokenizer, prompt_tensordict, response_text
from verlite.data.tasks import TASK_ALPHABET
from verlite.workers.reward_model import REWARD_INPUT_KEYS, RewardModelWorker

ROWS = 10
PROMPT_WIDTH, RESPONSE_WIDTH = 8, 6


def _batch() -> tuple[TensorDict, list[str]]:
    """A step batch of ragged prompts and responses (some ended by EOS, some cut at the
    width) and the texts a reader of the policy's tokens sees, built here on their own."""
    rng = random.Random(0)
    tokenizer = build_task_tokenizer(TASK_ALPHABET)
    prompts = ["".join(rng.choices("0123456789", k=rng.randint(1, 6))) + "=" for _ in range(ROWS)]
    records = [{"prompt": p, "answer": ""} for p in prompts]
    td = prompt_tensordict(
        records, tokenizer, max_prompt_length=PROMPT_WIDTH, repeat=1, temperature=1.0
    )
    digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
    responses = torch.full((ROWS, RESPONSE_WIDTH), tokenizer.pad_token_id)
    response_mask = torch.zeros(ROWS, RESPONSE_WIDTH, dtype=torch.long)
    texts = []
    for row in range(ROWS):
        n = rng.randint(1, RESPONSE_WIDTH)
        ids = rng.choices(digits, k=n)
        if n < RESPONSE_WIDTH or row % 2:
            ids[-1] = tokenizer.eos_token_id
        responses[row, :n] = torch.tensor(ids)
        response_mask[row, :n] = 1
        texts.append(prompts[row] + response_text(tokenizer, ids))
    td["input_ids"] = torch.cat([td["input_ids"], responses], dim=1)
    td["attention_mask"] = torch.cat([td["attention_mask"], response_mask], dim=1)
    td["responses"], td["response_mask"] = responses, response_mask
    return td.select(*REWARD_INPUT_KEYS), texts


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_reward_model(tmp_path_factory.mktemp("rm"))


@pytest.mark.parametrize(("workers", "max_length"), [(1, None), (2, 9)])
def test_reward_group_scores_each_response_as_a_single_forward_does(
    reward_model: Path, local_ray, workers: int, max_length: int | None
) -> None:
    cfg = load_config(
        None,
        [
            "data.task=copy",
            f"reward.model.path={reward_model}",
            f"reward.model.workers_per_node={workers}",
            "reward.model.micro_batch_size_per_worker=3",  # 10 rows: micro-batches of 3, 2, ...
            f"reward.model.max_length={max_length or 'null'}",
            "trainer.cpus_per_worker=0.5",
        ],
    )
    pool, share = build_pools(cfg, ["reward"])["reward"]
    group = WorkerGroup(
        "reward",
        RewardModelWorker,
        pool,
        share=share,
        worker_kwargs={"cfg": cfg},
        torch_threads=1,
        run_id="rmtest",
    )
    try:
        group.call("init_model")
        batch, texts = _batch()
        scored = group.call("score", batch, dispatch="dp_split", collect="concat")
    finally:
        group.shutdown()
        pool.remove()
    expected = torch.tensor(reference_scores(reward_model, texts, max_length=max_length))
    torch.testing.assert_close(scored["rm_score"], expected, rtol=0, atol=1e-5)
    assert expected.std() > 0.05  # rows tell apart: a reordering would show
    assert ((scored["rm_score"] > 0) & (scored["rm_score"] < 1)).all()
    lengths = [len(t) + 1 for t in texts]  # one token per character, and BOS
    truncated = [max_length is not None and n > max_length for n in lengths]
    assert scored["rm_truncated"].tolist() == truncated
    assert max_length is None or 0 < sum(truncated) < ROWS
