"""Engine checkpoints: save, load, continue identically; reshard between worker counts."""

from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from verlite.audit.invariance import make_batch
from verlite.config import load_config
from verlite.distributed import full_state_dict, run_on_ranks
from verlite.models import build_policy
from verlite.workers.objectives import ActorLossSettings, ppo_loss
from verlite.workers.train_engine import TrainEngine

CONFIG = load_config(
    "configs/ppo_tiny.yaml",
    ["model.precision=fp64", "actor.optim.warmup_steps=3", "actor.optim.schedule=cosine"],
)
LOSS = partial(ppo_loss, settings=ActorLossSettings.from_config(CONFIG.actor))


def engine(strategy: str = "none") -> TrainEngine:
    model = build_policy(CONFIG.model, vocab_size=64, max_positions=64, seed=0)
    cfg = CONFIG.actor.model_copy(update={"strategy": strategy})
    return TrainEngine(model, cfg=cfg, total_updates=10, metric_prefix="actor")


def two_updates(eng: TrainEngine, batch) -> list[dict]:
    return [eng.train_mini_batch(batch.clone(), LOSS) for _ in range(2)]


def test_resume_continues_exactly(tmp_path: Path) -> None:
    batch = make_batch(CONFIG)
    straight = engine()
    first = two_updates(straight, batch)
    then = two_updates(straight, batch)

    saved = engine()
    assert two_updates(saved, batch) == first
    saved.save(tmp_path)
    resumed = engine()
    resumed.load(tmp_path)
    assert two_updates(resumed, batch) == then  # same losses, grad norms and learning rates
    for name, value in full_state_dict(straight.model).items():
        torch.testing.assert_close(full_state_dict(resumed.model)[name], value, rtol=0, atol=0)


def _save_sharded(rank: int, world: int, path: str, batch) -> dict[str, torch.Tensor]:
    eng = engine("fsdp")
    local = batch[rank::world]
    eng.train_mini_batch(local, LOSS)
    eng.save(Path(path))
    return full_state_dict(eng.model)


def test_fsdp_checkpoint_of_two_ranks_loads_into_one(tmp_path: Path) -> None:
    batch = make_batch(CONFIG)
    saved, _ = run_on_ranks(_save_sharded, world_size=2, args=(str(tmp_path), batch))
    single = engine()
    single.load(tmp_path)
    loaded = full_state_dict(single.model)
    assert loaded.keys() == saved.keys()
    for name, value in saved.items():  # the trained weights, bit for bit
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0)
    assert single.scheduler.last_epoch == 1
    assert all(len(state) > 0 for state in single.optimizer.state.values())


def test_missing_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="holds no engine checkpoint"):
        engine().load(tmp_path / "nope")


def test_a_lora_checkpoint_holds_the_adapters_and_resumes_exactly(tmp_path: Path) -> None:
    lora = CONFIG.actor.lora.model_copy(update={"rank": 4})

    def lora_engine() -> TrainEngine:
        model = build_policy(CONFIG.model, vocab_size=64, max_positions=64, seed=0, lora=lora)
        return TrainEngine(model, cfg=CONFIG.actor, total_updates=10, metric_prefix="actor")

    batch = make_batch(CONFIG)
    straight = lora_engine()
    first, then = two_updates(straight, batch), two_updates(straight, batch)
    saved = lora_engine()
    assert two_updates(saved, batch) == first
    saved.save(tmp_path)
    resumed = lora_engine()
    resumed.load(tmp_path)
    assert two_updates(resumed, batch) == then
    for name, value in full_state_dict(straight.model).items():
        torch.testing.assert_close(full_state_dict(resumed.model)[name], value, rtol=0, atol=0)
    # the adapters and their AdamW moments: less than the model's weights alone
    stored = sum(f.stat().st_size for f in (tmp_path / "train_state").glob("*.distcp"))
    assert stored < sum(p.numel() * p.element_size() for p in saved.model.parameters())


def test_a_resume_trains_with_its_own_optimizer_settings(tmp_path: Path) -> None:
    """The learning rate, weight decay and betas of the resuming config, not the checkpoint's
    (the optimizer's and the schedule's saved state hold those): a resume reports the change
    and must make it. Mutation: without ``_apply_settings`` the resumed engine goes on at the
    old peak lr, weight decay and betas."""
    batch = make_batch(CONFIG)
    saved = engine()
    two_updates(saved, batch)
    saved.save(tmp_path)
    changed = {"lr": 3e-4, "weight_decay": 0.25, "betas": (0.8, 0.95)}
    cfg = CONFIG.actor.model_copy(update={"optim": CONFIG.actor.optim.model_copy(update=changed)})

    def changed_engine() -> TrainEngine:
        model = build_policy(CONFIG.model, vocab_size=64, max_positions=64, seed=0)
        return TrainEngine(model, cfg=cfg, total_updates=10, metric_prefix="actor")

    resumed = changed_engine()
    resumed.load(tmp_path)
    # a run of the new settings from the start, at the same place of the schedule
    fresh = changed_engine()
    for _ in range(2):
        fresh.optimizer.step()
        fresh.scheduler.step()
    for got, want in zip(resumed.optimizer.param_groups, fresh.optimizer.param_groups, strict=True):
        assert {k: v for k, v in got.items() if k != "params"} == {
            k: v for k, v in want.items() if k != "params"
        }
    assert resumed.scheduler.state_dict() == fresh.scheduler.state_dict()
    after = two_updates(resumed, batch)
    assert [m["actor/lr"] for m in after] == [m["actor/lr"] for m in two_updates(fresh, batch)]


def _nonfinite(model, td):
    """The PPO loss made NaN: its update is skipped (a non-finite gradient norm)."""
    loss, metrics = LOSS(model, td)
    return loss * float("nan"), metrics


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_a_save_before_the_first_update_changes_nothing(tmp_path: Path, name: str) -> None:
    """A checkpoint of an optimizer that never stepped (the actor during the critic's
    warm-up) holds no optimizer state: the placeholder state a zero step gave it to save,
    kept, made AdamW's first real update its second (another bias correction) in the run
    that saved and in its resumes, so ``trainer.save_freq`` changed the training; nothing
    is created now (``test_a_checkpoint_of_an_optimizer_that_never_stepped_creates_no_state``)."""
    cfg = CONFIG.actor.model_copy(
        update={"optim": CONFIG.actor.optim.model_copy(update={"name": name})}
    )

    def fresh() -> TrainEngine:
        model = build_policy(CONFIG.model, vocab_size=64, max_positions=64, seed=0)
        return TrainEngine(model, cfg=cfg, total_updates=10, metric_prefix="actor")

    batch = make_batch(CONFIG)
    straight = fresh()
    updates = two_updates(straight, batch)
    saved = fresh()
    saved.save(tmp_path)
    assert two_updates(saved, batch) == updates
    resumed = fresh()
    resumed.load(tmp_path)
    assert two_updates(resumed, batch) == updates
    for name, value in full_state_dict(straight.model).items():
        torch.testing.assert_close(full_state_dict(resumed.model)[name], value, rtol=0, atol=0)


def test_skipped_updates_before_a_save_resume_exactly(tmp_path: Path) -> None:
    """Non-finite updates before a checkpoint: it loads (the run's first update skipped
    left NaN gradients, so DCP saved no optimizer state and the load asked for state the
    checkpoint lacked), and the resumed run counts on from the saved streak of skipped
    updates (it restarted from 0, so ``nonfinite_streak`` and the divergence stop
    differed)."""
    batch = make_batch(CONFIG)

    def run(eng: TrainEngine, save: Path | None = None) -> list[dict]:
        first = [eng.train_mini_batch(batch.clone(), _nonfinite)]
        if save is not None:
            eng.save(save)
            return first
        return [*first, eng.train_mini_batch(batch.clone(), _nonfinite), *two_updates(eng, batch)]

    straight = run(engine())
    assert [m["actor/nonfinite_streak"].value for m in straight] == [1, 2, 0, 0]
    # repr: the skipped updates' grad norms are NaN, which equals nothing
    assert repr(run(engine(), tmp_path)) == repr(straight[:1])
    resumed = engine()
    resumed.load(tmp_path)
    then = [resumed.train_mini_batch(batch.clone(), _nonfinite), *two_updates(resumed, batch)]
    assert repr(then) == repr(straight[1:])


def _save_after_a_skipped_update(rank: int, world: int, path: str, batch) -> None:
    eng = engine("fsdp")
    eng.train_mini_batch(batch[rank::world], _nonfinite)
    eng.save(Path(path))
    assert not eng.optimizer.state  # saving gave it none to train on


def test_an_fsdp_checkpoint_before_any_step_loads_into_one_rank(tmp_path: Path) -> None:
    batch = make_batch(CONFIG)
    run_on_ranks(_save_after_a_skipped_update, world_size=2, args=(str(tmp_path), batch))
    single = engine()
    single.load(tmp_path)
    assert not single.optimizer.state and single.nonfinite_streak == 1
    straight = engine()
    straight.train_mini_batch(batch.clone(), _nonfinite)
    assert repr(two_updates(single, batch)) == repr(two_updates(straight, batch))


def test_a_gpu_ranks_rng_state_is_saved_and_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On cuda the worker's checkpoint holds its GPU's RNG state beside the CPU's (LoRA's
    dropout draws on the GPU), restored on that device; a CPU run's checkpoint resumed on a
    GPU has none to restore. The GPU is stood in for by torch.cuda's two RNG functions."""
    from verlite.workers.training_worker import TrainingWorker

    gpu = torch.device("cuda", 0)
    state = torch.arange(16, dtype=torch.uint8)
    restored: list[tuple[torch.Tensor, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: state.clone())
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda new, device: restored.append((new, device))
    )

    def worker(device: torch.device) -> TrainingWorker:
        out = TrainingWorker(role="actor", rank=0, world_size=1, torch_threads=1)
        out.engine = SimpleNamespace(device=device, save=lambda _: None, load=lambda _: None)
        return out

    worker(gpu).save_checkpoint(str(tmp_path / "gpu"))
    worker(gpu).load_checkpoint(str(tmp_path / "gpu"))
    assert len(restored) == 1 and torch.equal(restored[0][0], state) and restored[0][1] == gpu
    worker(torch.device("cpu")).save_checkpoint(str(tmp_path / "cpu"))
    worker(gpu).load_checkpoint(str(tmp_path / "cpu"))
    worker(torch.device("cpu")).load_checkpoint(str(tmp_path / "gpu"))
    assert len(restored) == 1


MIXED = load_config("configs/ppo_tiny.yaml", ["model.precision=bf16-mixed"])


def _mixed_state(rank: int, world: int, path: str, strategy: str, save: bool, batch) -> tuple:
    """A bf16-mixed engine on ``world`` ranks that trains once and saves to ``path``, or
    loads it; its full fp32 weights and AdamW state (step and moments), by name."""
    model = build_policy(MIXED.model, vocab_size=64, max_positions=64, seed=0)
    cfg = MIXED.actor.model_copy(update={"strategy": strategy})
    eng = TrainEngine(
        model, cfg=cfg, total_updates=10, metric_prefix="actor", precision="bf16-mixed"
    )
    if save:
        eng.train_mini_batch(
            batch[rank::world],
            partial(ppo_loss, settings=ActorLossSettings.from_config(MIXED.actor)),
        )
        eng.save(Path(path))
    else:
        eng.load(Path(path))
    optim = get_optimizer_state_dict(
        eng.model, eng.optimizer, options=StateDictOptions(full_state_dict=True)
    )["state"]
    moments = {
        f"{name}.{key}": value.detach().cpu().clone()
        for name, entry in optim.items()
        for key, value in entry.items()
    }
    return full_state_dict(eng.model), moments


@pytest.mark.parametrize(("saved_on", "loaded_on"), [(2, 1), (1, 2)])
def test_bf16_mixed_fp32_weights_and_moments_reshard_bit_for_bit(
    tmp_path: Path, saved_on: int, loaded_on: int
) -> None:
    """bf16-mixed's fp32 master weights and AdamW state, saved by FSDP on N ranks and loaded
    on M, come back in fp32 bit for bit (not rounded through the bf16 compute dtype)."""
    batch = make_batch(MIXED)

    def on_ranks(world: int, save: bool) -> tuple:
        strategy = "fsdp" if world > 1 else "none"
        args = (str(tmp_path), strategy, save, batch)
        return run_on_ranks(_mixed_state, world_size=world, args=args)[0]

    saved, loaded = on_ranks(saved_on, save=True), on_ranks(loaded_on, save=False)
    for expected, got in zip(saved, loaded, strict=True):
        assert got.keys() == expected.keys() and len(got) > 0
        for name, value in expected.items():
            assert value.dtype == got[name].dtype == torch.float32, name
            torch.testing.assert_close(got[name], value, rtol=0, atol=0)
