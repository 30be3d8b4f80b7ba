"""The CUDA side: NVRTC compile and its cubin cache, the driver, launches, device memory, streams."""
