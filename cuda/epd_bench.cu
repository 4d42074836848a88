// Benchmark-only kernels (benchmarks/, tests/gpu/local_group.py). Never compiled by the engine:
// tests/gpu/local_group.BenchKernels adds this file to the engine's sources.
#include "epd_common.cuh"

// ------------------------------------------------------------------------------------------
// NVLink ceiling probe: every thread stores 16-byte vectors of src into dst (a peer pointer).
// ------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(1024)
epd_copy16(const int4* __restrict__ src, int4* __restrict__ dst, i64 n16) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        int4 a = __ldg(src + i), b = __ldg(src + i + stride), c = __ldg(src + i + 2 * stride),
             d = __ldg(src + i + 3 * stride);
        dst[i] = a; dst[i + stride] = b; dst[i + 2 * stride] = c; dst[i + 3 * stride] = d;
    }
    for (; i < n16; i += stride) dst[i] = __ldg(src + i);
}

// Benchmark gate: hold a stream until the host raises a mapped word, so that the ranks' timed
// work starts together regardless of host launch skew (bounded by a deadline).
extern "C" __global__ void epd_gate(const volatile int* flag, i64 timeout_ns) {
    u64 start = globaltimer();
    while (*flag == 0)
        if ((i64)(globaltimer() - start) > timeout_ns) break;
}
