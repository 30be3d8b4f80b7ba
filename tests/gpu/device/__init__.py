"""GPU tier tests that need a GPU (graphs, streams, the pump, torch, CuPy, JAX, two devices)."""
