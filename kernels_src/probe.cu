// ABI probes for the GPU test tier and the launch-overhead benchmark: an empty kernel, the layout
// as the device compiler sees it, and a byte echo of every params struct passed by value.
#include "common.cuh"

__device__ unsigned char kvc_echo_buffer[KVC_ECHO_BYTES];

extern "C" __global__ void kvc_empty(const __grid_constant__ KvcProbeParams p) { KVC_AFTER_PREVIOUS_GRID(); }

extern "C" __global__ void kvc_abi_layout(const __grid_constant__ KvcProbeParams p) {
  KVC_AFTER_PREVIOUS_GRID();
  if (blockIdx.x == 0 && threadIdx.x == 0) kvc_abi_layout_dump(p.out);
}

#define KVC_ECHO_KERNEL(S)                                                            \
  extern "C" __global__ void kvc_echo_##S(const __grid_constant__ S p) {              \
    KVC_AFTER_PREVIOUS_GRID();                                                        \
    const unsigned char* src = reinterpret_cast<const unsigned char*>(&p);            \
    for (int i = threadIdx.x; i < (int)sizeof(S); i += blockDim.x) kvc_echo_buffer[i] = src[i]; \
  }
KVC_FOR_EACH_PARAMS_STRUCT(KVC_ECHO_KERNEL)
