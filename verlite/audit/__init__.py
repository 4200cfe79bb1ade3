"""The invariance audits: one update under several layouts, and whole runs."""
