"""The prompt loader (seeded order, epochs, exact resume), prompt collation (left padding)
and the record each row of a step batch answers."""

import itertools

import pytest
import torch

from verlite.data import (
    DataError,
    PromptLoader,
    PromptRecord,
    build_task_tokenizer,
    collate_prompts,
    position_ids,
    prompt_tensordict,
    row_records,
)


def _records(n: int) -> list[PromptRecord]:
    return [PromptRecord(prompt=f"copy {i}=", answer=str(i)) for i in range(n)]


def _take(loader: PromptLoader, n: int) -> list[list[PromptRecord]]:
    return list(itertools.islice(loader, n))


def test_batches_are_seeded_shuffles_of_the_dataset() -> None:
    data = _records(20)
    batches = _take(PromptLoader(data, 5, seed=0), 4)  # one epoch
    assert all(len(b) == 5 for b in batches)
    seen = [r["answer"] for b in batches for r in b]
    assert sorted(seen, key=int) == [r["answer"] for r in data]
    assert seen != [r["answer"] for r in data]  # shuffled
    assert _take(PromptLoader(data, 5, seed=0), 4) == batches
    assert _take(PromptLoader(data, 5, seed=1), 4) != batches


def test_no_shuffle_keeps_order() -> None:
    data = _records(6)
    assert _take(PromptLoader(data, 3, seed=0, shuffle=False), 3) == [data[:3], data[3:], data[:3]]


def test_epoch_rollover_drops_the_remainder_and_reshuffles() -> None:
    data = _records(11)  # 2 batches of 5 per epoch, 1 record dropped each epoch
    loader = PromptLoader(data, 5, seed=0)
    assert loader.batches_per_epoch == 2
    first = _take(loader, 2)
    assert loader.epoch == 0
    assert loader.state_dict() == {"epoch": 0, "position": 2, "seed": 0}
    second = _take(loader, 2)
    assert loader.epoch == 1
    assert loader.state_dict() == {"epoch": 1, "position": 2, "seed": 0}
    for epoch in (first, second):
        answers = [r["answer"] for b in epoch for r in b]
        assert len(set(answers)) == 10  # no record twice within an epoch
    assert first != second


# After 4 and 8 batches an epoch has ended and the next not begun: position 4 of 4 (what a
# checkpoint at an epoch's end saves).
@pytest.mark.parametrize(
    ("taken", "epoch", "position"),
    [(0, 0, 0), (4, 0, 4), (5, 1, 1), (6, 1, 2), (8, 1, 4), (9, 2, 1)],
)
def test_resume_continues_with_the_same_batches(taken: int, epoch: int, position: int) -> None:
    data = _records(23)  # 4 batches of 5 per epoch
    uninterrupted = _take(PromptLoader(data, 5, seed=7), taken + 6)
    loader = PromptLoader(data, 5, seed=7)
    assert _take(loader, taken) == uninterrupted[:taken]
    state = loader.state_dict()
    assert state == {"epoch": epoch, "position": position, "seed": 7}
    resumed = PromptLoader(data, 5, seed=123)  # the saved seed wins
    resumed.load_state_dict(state)
    assert _take(resumed, 6) == uninterrupted[taken:]


def test_load_state_dict_rejects_bad_states() -> None:
    loader = PromptLoader(_records(10), 5, seed=0)
    with pytest.raises(ValueError, match="loader state lacks seed"):
        loader.load_state_dict({"epoch": 0, "position": 0})
    with pytest.raises(ValueError, match="position=3 does not fit this dataset"):
        loader.load_state_dict({"epoch": 0, "position": 3, "seed": 0})


def test_dataset_smaller_than_a_batch() -> None:
    with pytest.raises(
        DataError, match=r"3 training prompts are fewer than one batch of data\.train_batch_size=4"
    ):
        PromptLoader(_records(3), 4, seed=0)


def test_position_ids_count_real_tokens_from_zero_and_are_zero_on_pads() -> None:
    mask = torch.tensor(
        [
            [0, 0, 1, 1, 1],  # left padding
            [0, 0, 0, 0, 0],  # all padding
            [1, 1, 1, 1, 1],  # none
            [1, 1, 0, 1, 0],  # pads after and between real tokens
        ]
    )
    assert position_ids(mask).tolist() == [
        [0, 0, 0, 1, 2],
        [0, 0, 0, 0, 0],
        [0, 1, 2, 3, 4],
        [0, 1, 0, 2, 0],
    ]
    assert position_ids(mask).dtype == mask.dtype


def test_collate_left_pads_with_positions() -> None:
    tok = build_task_tokenizer()
    records = [PromptRecord(prompt="1+1=", answer="2"), PromptRecord(prompt="12+34=", answer="46")]
    batch = collate_prompts(records, tok, 8)
    pad, bos = tok.pad_token_id, tok.bos_token_id
    ids = tok(["1+1=", "12+34="], add_special_tokens=False)["input_ids"]
    assert batch["input_ids"].tolist() == [
        [pad, pad, pad, bos, *ids[0]],
        [pad, bos, *ids[1]],
    ]
    assert batch["attention_mask"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 0, 0, 0, 1, 2, 3, 4], [0, 0, 1, 2, 3, 4, 5, 6]]
    assert all(
        t.dtype == torch.long
        for t in (batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    )
    assert batch["answers"] == ["2", "46"]
    assert batch["prompts"] == ["1+1=", "12+34="]


def test_collate_keeps_the_last_tokens_of_a_long_prompt() -> None:
    tok = build_task_tokenizer()
    batch = collate_prompts([PromptRecord(prompt="123456789+1=", answer="123456790")], tok, 6)
    assert tok.decode(batch["input_ids"][0].tolist()) == "789+1="
    assert batch["attention_mask"].tolist() == [[1] * 6]
    assert batch["position_ids"].tolist() == [list(range(6))]


def test_collate_empty_batch() -> None:
    with pytest.raises(ValueError, match="empty batch"):
        collate_prompts([], build_task_tokenizer(), 4)


def test_collate_needs_a_pad_token() -> None:
    tok = build_task_tokenizer()
    tok.pad_token = None
    with pytest.raises(ValueError, match="no pad token"):
        collate_prompts([PromptRecord(prompt="1=", answer="1")], tok, 4)


def test_each_row_gets_the_record_of_the_prompt_it_holds_on_any_share_of_the_rows() -> None:
    """A step's records stay one per prompt; a row's (with rollout.n repeats, and on the
    share of rows a worker gets) is found by its uid, and its prompt is the row's text."""
    tokenizer = build_task_tokenizer()
    records = _records(5)
    td = prompt_tensordict(records, tokenizer, max_prompt_length=12, repeat=3, temperature=1.0)
    for rows in (td, td[4:11], td[torch.tensor([14, 0, 7])]):
        matched = row_records(records, rows["uid"])
        assert len(matched) == rows.batch_size[0]
        for record, ids, mask in zip(
            matched, rows["input_ids"], rows["attention_mask"].bool(), strict=True
        ):
            assert tokenizer.decode(ids[mask], skip_special_tokens=True) == record["prompt"]
