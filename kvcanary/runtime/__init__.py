"""The CUDA side: NVRTC compile and its cubin cache, the driver, launches, device memory, streams.

Each module imports only the ones below it, bottom to top (tests/test_layering.py keeps it so):
``driver`` (the cuda.bindings driver, cuInit, ``check``, primary contexts); ``cubin_cache``,
``nvrtc_program`` (one program to one cubin), ``parallel_compile``, ``nvrtc_build`` (the kernel
families at import); ``kernel_library`` (a device's loaded families), ``devices`` (a device's
runtime: its launches), ``launch`` (a packed launch), ``memory``, ``streams``.
"""
