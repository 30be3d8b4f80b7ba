"""What the tests share: the scripted serving session, the seeded workloads, the fake CUDA driver,
guarded memory, the fuzz cases and their model, the SWA window variants and the bad-input rows."""
