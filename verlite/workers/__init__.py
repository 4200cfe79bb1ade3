"""Ray worker classes of each role and the engine they drive."""
