"""The driver: a run's lifecycle, the training loop, where each step's batch comes from,
checkpoint folders and the output folder."""
