"""verlite's benchmarks: one module per question, each printing one JSON object (``make bench``)."""
