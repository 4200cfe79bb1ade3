"""The driver: a run's lifecycle and restarts, the checks before Ray, the training loop,
where each step's batch comes from, a step's scores, checkpoint folders and the output
folder."""
