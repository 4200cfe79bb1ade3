"""The files of a training role's checkpoint folder (``<checkpoint>/actor/``, ``critic/``).

``TrainEngine`` writes them; the driver checks a checkpoint holds them before any worker
starts (``driver/checkpoint.py``), which must not cost it the engine's imports (DCP, the
models): each name is owned here, with nothing to import.
"""

# DCP's folder of the trained parameters and the optimizer state, a shard per rank.
TRAIN_STATE = "train_state"
# The LR schedule's position (LambdaLR's state).
SCHEDULE = "schedule.json"
# The engine's own numbers besides the LR schedule: the streak of skipped updates.
ENGINE_STATE = "engine_state.json"
# Each rank's random state (``torch.save``'s zip archive), by rank: each rank of a resume
# restores its own, where the checkpoint has one.
RNG_FILE = "rng_rank{rank}.pt"
# What every role's folder must hold: the DCP index of its shards, and the LR schedule.
ENGINE_FILES = (f"{TRAIN_STATE}/.metadata", SCHEDULE)
