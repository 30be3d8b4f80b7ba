"""Arrays from anywhere (torch, CuPy, JAX, numpy, DLPack, raw pointers) as one checked view."""
