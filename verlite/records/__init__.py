"""A run's records: the metrics log, the trackers, and the comparison of two runs."""
