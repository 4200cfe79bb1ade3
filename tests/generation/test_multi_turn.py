"""Multi-turn rollouts (``verlite.generation.multi_turn``) on a real Hugging Face model and a real
BPE tokenizer: the trajectory is the sampled token ids and the observations tokenized once
(decoding and re-encoding it would change it), the model's log-probs over the assembled
batch are the ones the tokens were sampled with, observations are holes in the loss mask,
and a trajectory ends on done, end of sequence, a failed tool, or its limits."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from typing import ClassVar

import pytest
import torch
from tensordict import TensorDict
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from verlite.config import ModelConfig
from verlite.data import position_ids
from verlite.envs import AbandonedCalls, EnvironmentBroken, SessionThreads, open_sessions
from verlite.envs.base import Turn
from verlite.generation import DecodeSettings, KeyedNoise, Sampler, SamplingParams, sample_keys
from verlite.generation.decode import EAGER
from verlite.generation.multi_turn import EnvironmentSession, TurnLimits, generate_multi_turn
from verlite.generation.noise import turn_keys
from verlite.models import build_policy
from verlite.workers.forward import response_log_probs

CORPUS = ["48 12 4812 1248 84 21 ? ! 482 124 812"] * 50


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-pair tokenizer with merges ("48", "12", ...), so that tokens sampled one by
    one can decode to text that encodes to fewer tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<eos>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


class Echo:
    """Answers every turn with ``observation``; done after ``turns`` turns, reward 0.25 a turn."""

    def __init__(self, observation: str = "4812", turns: int = 3, fail_on: int = -1) -> None:
        self.observation, self.turns, self.fail_on = observation, turns, fail_on
        self.seen: list[str] = []
        self.error: str | None = None
        self.timed_out = False

    def observation_ids(self, observation: str, tokenizer: PreTrainedTokenizerFast) -> list[int]:
        return tokenizer.encode(observation, add_special_tokens=False)

    def start_step(self, action: str) -> Callable[[], Turn | None]:
        self.seen.append(action)
        if len(self.seen) == self.fail_on:
            self.error = "step raised RuntimeError: boom"
            return lambda: None
        done = len(self.seen) == self.turns
        turn = Turn(self.observation, min(1.0, 0.25 * len(self.seen)), done)
        return lambda: turn


def prompts(tokenizer: PreTrainedTokenizerFast, rows: int) -> TensorDict:
    texts = ["48 12", "84", "1248 ?", "21 21 21"] * (rows // 4)
    ids = [tokenizer.encode(t) for t in texts]
    width = max(map(len, ids))
    input_ids = torch.full((rows, width), tokenizer.pad_token_id)
    mask = torch.zeros((rows, width), dtype=torch.long)
    for row, seq in enumerate(ids):
        input_ids[row, width - len(seq) :] = torch.tensor(seq)
        mask[row, width - len(seq) :] = 1
    td = TensorDict(
        {
            "input_ids": input_ids,
            "attention_mask": mask,
            "position_ids": position_ids(mask),
            "uid": torch.arange(rows),
            "sample_key": sample_keys(0, 1, rows, 1),
        },
        batch_size=[rows],
    )
    td.set_non_tensor("temperature", 1.0)
    return td


def run(
    envs: Sequence[EnvironmentSession],
    *,
    width: int = 24,
    max_turns: int = 3,
    turn_tokens: int = 5,
    decode: DecodeSettings = EAGER,
    model: torch.nn.Module | None = None,
    rows: list[int] | None = None,
):
    """``envs`` generated as one batch: of the first ``len(envs)`` prompts, or of ``rows``
    of the first eight."""
    tokenizer = bpe_tokenizer()
    model = model or build_policy(
        ModelConfig(
            hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64
        ),
        vocab_size=len(tokenizer),
        max_positions=64,
        seed=3,
    )
    sampler = Sampler(
        model,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        lockstep=False,
        decode=decode,
    )
    stop = tokenizer.convert_tokens_to_ids("?")
    sampled: list[TensorDict] = []

    def turn(td: TensorDict, index: int, max_new_tokens: int) -> TensorDict:
        params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(stop,))
        noise = KeyedNoise(turn_keys(td["sample_key"], index), horizon=max_new_tokens)
        out = sampler.generate(td, params, noise)
        sampled.append(out)
        return out

    limits = TurnLimits(
        max_turns=max_turns,
        width=width,
        turn_tokens=turn_tokens,
        end_token_ids=(tokenizer.eos_token_id,),
        pad_token_id=tokenizer.pad_token_id,
    )
    batch_prompts = prompts(tokenizer, len(envs)) if rows is None else prompts(tokenizer, 8)[rows]
    batch = generate_multi_turn(turn, batch_prompts, envs, tokenizer, limits)
    return batch, sampled, tokenizer, model, stop


def test_the_trajectory_is_the_sampled_tokens_and_observations_tokenized_once() -> None:
    envs = [Echo() for _ in range(8)]
    batch, sampled, tokenizer, _, _ = run(envs)
    observation = tokenizer.encode("4812", add_special_tokens=False)
    changed = 0
    for row, env in enumerate(envs):
        real = batch["attention_mask"][row, -24:].bool()
        tokens = batch["responses"][row][real].tolist()
        # Rebuild the row from what each turn's sampler returned, and the tokenized observation.
        expected, cursor = [], 0
        for turn, action in enumerate(env.seen):
            out = sampled[turn]
            j = int((out["uid"] == row).nonzero())
            n = int(out["response_mask"][j].sum())
            expected += out["responses"][j, :n].tolist()
            turn_tokens = expected[cursor:]
            if turn_tokens[-1:] == [tokenizer.eos_token_id]:
                turn_tokens = turn_tokens[:-1]
            # the environment reads the turn decoded once, special tokens shown
            assert tokenizer.decode(turn_tokens, skip_special_tokens=False) == action
            if turn + 1 < len(env.seen):
                expected += observation
            cursor = len(expected)
        assert tokens == expected
        text = tokenizer.decode(tokens, skip_special_tokens=False)
        changed += tokenizer.encode(text, add_special_tokens=False) != tokens
    assert changed > 0, "no row would have been re-tokenized differently: the test proves nothing"


def test_observations_are_holes_in_the_loss_mask_and_positions_run_on() -> None:
    envs = [Echo() for _ in range(8)]
    batch, _, tokenizer, _, _ = run(envs)
    observation = tokenizer.encode("4812", add_special_tokens=False)
    width = batch["responses"].shape[1]
    for row in range(8):
        real = batch["attention_mask"][row, -width:].bool()
        policy = batch["response_mask"][row].bool()
        assert not (policy & ~real).any()
        holes = (real & ~policy).sum()
        assert holes == int(batch["observation_tokens"][row])
        assert holes == len(observation) * int(batch["tool_calls"][row])
        mask = batch["attention_mask"][row].bool()
        positions = batch["position_ids"][row][mask]
        assert positions.tolist() == list(range(int(mask.sum())))


def test_the_model_over_the_batch_gives_the_log_probs_the_tokens_were_sampled_with() -> None:
    """What the trainer computes over the assembled trajectory is what the sampler drew:
    the same tokens, in the same context, at the same positions."""
    envs = [Echo() for _ in range(8)]
    batch, _, _, model, _ = run(envs)
    with torch.no_grad():
        log_probs, _ = response_log_probs(model, batch, temperature=1.0, entropy="none")
    policy = batch["response_mask"].bool()
    assert policy.sum() > 30
    torch.testing.assert_close(
        log_probs[policy], batch["rollout_log_probs"][policy], rtol=1e-4, atol=1e-5
    )
    assert (batch["rollout_log_probs"][~policy] == 0).all()


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_no_row_runs_past_its_room_whatever_the_rows_beside_it(mode: str) -> None:
    """A turn generates for as long as the row with the most room may; each other row stops
    one token past its own room (which says whether the turn was cut), and a finished row
    is not fed at later positions. So no forward reaches a position a trajectory cannot
    hold: with a rotary scaling set by the batch's largest position (``dynamic``, allowed
    while the run's sequences stay within the model's context), rows that ran past their
    room changed every row's frequencies, and the sampler's log-probs were not the
    trainer's (1.4e-4 apart in float64; positions up to 51 of 43)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from verlite.models.logits_chunk import set_logits_chunk_tokens

    tokenizer, width = bpe_tokenizer(), 40
    longest = prompts(tokenizer, 8)["input_ids"].shape[1] + width  # prompt and trajectory
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=longest,
        rope_scaling={"rope_type": "dynamic", "factor": 4.0},
    )
    model = LlamaForCausalLM(config).double()
    set_logits_chunk_tokens(model, 64)
    reached: list[int] = []
    model.register_forward_pre_hook(
        lambda _, args, kwargs: reached.append(int(kwargs["position_ids"].max())),
        with_kwargs=True,
    )
    # Observations of other lengths: the rows' rooms differ from the second turn on.
    envs = [Echo(observation="4812 1248 12 84 " * 4 if i % 2 else "4", turns=9) for i in range(8)]
    batch, *_ = run(
        envs, width=width, max_turns=4, turn_tokens=16, decode=DecodeSettings(mode), model=model
    )
    assert max(reached) < longest
    assert batch["truncated"].sum() > 0
    reached.clear()
    with torch.no_grad():
        log_probs, _ = response_log_probs(model, batch, temperature=1.0, entropy="none")
    assert max(reached) < longest
    policy = batch["response_mask"].bool()
    torch.testing.assert_close(
        log_probs[policy], batch["rollout_log_probs"][policy].double(), rtol=0, atol=1e-6
    )


def test_a_trajectory_is_the_same_alone_or_beside_other_rows() -> None:
    """Whatever rows a worker's share holds, each trajectory is the same, its outcomes
    included. A turn generated at most as many tokens as the most room of its rows: a row
    generating alone could not draw the token past its room that says whether its turn was
    cut, and a turn the environment ended there was ``truncated`` (and dropped by
    ``algorithm.overlong.filter``) beside a row with more room only (rows 1, 3, 5 and 7)."""

    def envs() -> list[Echo]:
        return [
            Echo(observation="4812 1248 12 84 " * 4 if i % 2 else "4", turns=2) for i in range(8)
        ]

    settings = {"width": 40, "max_turns": 4, "turn_tokens": 16}
    together, *_ = run(envs(), **settings)
    assert together["truncated"].sum() > 0
    for row, env in enumerate(envs()):
        alone, *_ = run([env], rows=[row], **settings)
        for key in alone.keys():  # noqa: SIM118 (a TensorDict iterates over its rows)
            if key == "rollout_log_probs":  # float32 over a batch of another width
                torch.testing.assert_close(alone[key][0], together[key][row], rtol=0, atol=1e-5)
            elif isinstance(alone[key], torch.Tensor):
                assert torch.equal(alone[key][0], together[key][row]), (row, key)


@pytest.mark.parametrize("rows", [None, [3, 3, 3, 3]], ids=["padded", "unpadded"])
def test_turns_on_the_static_cache_are_the_eager_turns(rows: list[int] | None) -> None:
    """Each turn a generation of its own width and length on one decoder's static cache (the
    stop token of a turn among its ends), its prompts padded or (the widest prompt alone, as
    a step of one prompt's samples has) not: the trajectories of the eager sampler, exactly."""
    envs = [Echo() for _ in range(8 if rows is None else len(rows))]
    eager, _, _, _, _ = run(envs, rows=rows)
    envs = [Echo() for _ in envs]
    decode = DecodeSettings("static", batch_buckets=(1, 2))
    static, _, _, _, _ = run(envs, decode=decode, rows=rows)
    for key in eager.keys():  # noqa: SIM118 (a TensorDict iterates over its rows)
        if isinstance(eager[key], torch.Tensor):
            assert torch.equal(static[key], eager[key]), key


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_turns_of_a_window_no_trajectory_passes_on_the_static_cache_are_the_eager_turns(
    kind: str,
) -> None:
    """A sliding window as long as the longest trajectory (the prompt width and the 24
    tokens of room: ``max_sequence_length``): a turn's static cache can span more positions
    than that (its prompt left-padded to the widest trajectory, and a whole turn), yet no
    row's real tokens are farther apart than the window, so the windowless static masks
    give the eager sampler's trajectories, Hugging Face's window applied, exactly."""
    from tests.model_support import tiny_sliding

    tokenizer = bpe_tokenizer()
    longest = prompts(tokenizer, 8)["input_ids"].shape[1] + 24
    model = tiny_sliding(kind, longest, vocab_size=len(tokenizer), seed=3).double()
    eager, *_ = run([Echo() for _ in range(8)], model=model)
    static, *_ = run(
        [Echo() for _ in range(8)],
        model=model,
        decode=DecodeSettings("static", batch_buckets=(1, 2)),
    )
    assert int(eager["attention_mask"].sum(-1).max()) > longest // 2  # several turns in
    for key in eager.keys():  # noqa: SIM118 (a TensorDict iterates over its rows)
        if isinstance(eager[key], torch.Tensor):
            assert torch.equal(static[key], eager[key]), key


def test_trajectories_end_on_done_failure_turns_and_room() -> None:
    envs = [Echo(turns=1), Echo(fail_on=2), Echo(turns=9), Echo(turns=9)]
    batch, _, tokenizer, _, _ = run(envs, max_turns=3)
    assert batch["turns"].tolist()[:2] == [1.0, 2.0]
    assert batch["env_score"].tolist()[:2] == [0.25, 0.0]  # a failed tool scores 0
    # whole (the scorer casts it to the run's score dtype); mutation: a float32 column
    assert batch["env_score"].dtype == torch.float64
    assert batch["tool_error"].tolist() == [0.0, 1.0, 0.0, 0.0]
    # Rows 2 and 3 never hear "done": each ends the sequence itself (not truncated) or runs
    # out of its 3 turns (truncated).
    for row in (2, 3):
        policy = batch["response_mask"][row].bool()
        ended_itself = tokenizer.eos_token_id in batch["responses"][row][policy].tolist()
        assert bool(batch["truncated"][row]) is not ended_itself
        assert ended_itself or batch["turns"][row] == 3
    tight, *_ = run([Echo(turns=9) for _ in range(4)], width=6, max_turns=9)
    assert (tight["attention_mask"][:, -6:].sum(-1) <= 6).all()
    assert tight["truncated"].sum() >= 1


class Garbles:
    """An environment whose observation is not text: a lone surrogate."""

    def reset(self, record):
        pass

    def step(self, action: str) -> Turn:
        return Turn("48\ud800", 0.0, False)


def test_an_observation_that_cannot_be_tokenized_names_the_environment_and_prompt() -> None:
    """The observation goes through the session's checked encoding, not straight into the
    tokenizer (whose TypeError would name neither)."""
    sessions = [
        open_sessions(
            Garbles,
            [{"prompt": "48 12", "answer": ""}],
            indices=[uid],
            timeout_s=5.0,
            threads=SessionThreads(2, AbandonedCalls(limit=0)),
        )[0]
        for uid in range(4)
    ]
    with pytest.raises(EnvironmentBroken) as caught:
        run(sessions, max_turns=3)
    assert re.fullmatch(
        r"environment test_multi_turn:Garbles, prompt \d: step returned observation "
        r"'48\\ud800', not valid text \(surrogates not allowed at character 2\)",
        str(caught.value),
    ), str(caught.value)


def test_the_cache_a_run_reserves_holds_every_turn() -> None:
    """A turn's prompt is the trajectory so far (up to a token short of the longest
    sequence), and the row with the most room may take a whole turn after it: the static
    cache a worker reserves (``Config.cache_positions``) holds that, so it never grows in
    mid-run (dropping the CUDA graphs captured on it) past what start-up checked fits."""
    from types import SimpleNamespace

    from verlite.config import load_config
    from verlite.workers.policy_worker import PolicyWorker

    cfg = load_config(
        "configs/tool_tiny.yaml",
        [
            "data.max_prompt_length=4",
            "rollout.max_response_length=16",
            "rollout.multi_turn.max_total_length=44",
            "rollout.multi_turn.max_turns=4",
        ],
    )
    envs = [Echo(observation="4812 1248 12 84 " * 4 if i % 2 else "4", turns=9) for i in range(8)]
    _, sampled, *_ = run(
        envs,
        width=cfg.response_width,
        max_turns=cfg.rollout.multi_turn.max_turns,
        turn_tokens=cfg.rollout.max_response_length,
    )
    spans = [out["input_ids"].shape[1] for out in sampled]  # a turn's prompt and its turn
    assert max(spans) > cfg.max_sequence_length
    model = build_policy(ModelConfig(), vocab_size=40, max_positions=16, seed=0)
    settings = PolicyWorker.decode_settings(
        SimpleNamespace(cfg=cfg),  # type: ignore[arg-type]
        model,
        torch.device("cpu"),
        lockstep=False,
        trains_on=True,
    )
    assert max(spans) <= settings.reserve[1] == cfg.cache_positions


def test_a_turn_reads_its_batch_on_the_host_once_whatever_its_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a GPU every read of a device tensor on the host waits for the device: the turns
    read the prompts and each turn's responses a few times in all, not once per row (8 and
    16 rows read alike); the reads inside generation (its own steps) are not counted."""
    import sys

    from torch.overrides import TorchFunctionMode

    reads = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "nonzero"}

    class HostReads(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.count, self.paused = 0, False

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if not self.paused and getattr(func, "__name__", "") in reads:
                self.count += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for rows in (8, 16):
        mode = HostReads()

        def counted(generate, *args, _mode=mode, _real=generate_multi_turn):  # type: ignore[no-untyped-def]
            def turn(td, index, max_new_tokens):  # type: ignore[no-untyped-def]
                _mode.paused = True
                try:
                    return generate(td, index, max_new_tokens)
                finally:
                    _mode.paused = False

            with _mode:
                return _real(turn, *args)

        monkeypatch.setattr(sys.modules[__name__], "generate_multi_turn", counted)
        _, sampled, _, _, _ = run([Echo() for _ in range(rows)])
        monkeypatch.undo()
        assert len(sampled) == 3  # every run takes its three turns
        counts.append(mode.count)
    assert counts[0] == counts[1] and counts[0] <= 2 + 3 * len(sampled), counts


class Meets:
    """A tool whose first step waits until ``parties`` trajectories' first steps run at
    once (``barrier``; broken after a few seconds alone: a tool error), each step noting
    its thread, turn and prompt (``calls``)."""

    barrier: threading.Barrier
    calls: ClassVar[list[tuple[threading.Thread, int, int]]] = []

    def reset(self, record: dict[str, str]) -> None:
        self.index, self.steps = int(record["answer"]), 0

    def step(self, action: str) -> Turn:
        self.steps += 1
        self.calls.append((threading.current_thread(), self.steps, self.index))
        if self.steps == 1:
            self.barrier.wait()
        return Turn("4812", 0.5 * self.steps, self.steps == 2)


def test_a_turn_runs_the_environment_steps_of_its_threads_side_by_side() -> None:
    """A turn stepped its trajectories one after another, each waited for before the next
    began, however many threads the worker had: a tool taking 0.5 s cost 32 s a turn for 64
    trajectories. Here each thread's first call waits for the first calls of the 3 other
    threads: one at a time, the barrier broke (4 tool errors); side by side every
    trajectory takes its turns, and a thread's calls still run in the order they were
    started (8 trajectories on 4 threads)."""
    Meets.barrier, Meets.calls[:] = threading.Barrier(4, timeout=5), []
    threads = SessionThreads(4, AbandonedCalls(limit=0))
    sessions = open_sessions(
        Meets,
        [{"prompt": "48 12", "answer": str(row)} for row in range(8)],
        indices=range(8),
        timeout_s=30,
        threads=threads,
    )
    batch, *_ = run(sessions, max_turns=3)
    for s in sessions:
        s.close()
    assert [s.error for s in sessions] == [None] * 8
    assert batch["tool_error"].tolist() == [0.0] * 8
    assert (batch["turns"] >= 1).all() and batch["env_score"].min() >= 0.5
    by_thread: dict[threading.Thread, list[tuple[int, int]]] = {}
    for thread, turn, row in Meets.calls:
        by_thread.setdefault(thread, []).append((turn, row))
    assert len(by_thread) == 4
    assert all(calls == sorted(calls) for calls in by_thread.values())
