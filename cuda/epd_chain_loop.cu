// The end of one round of a low-latency chain run as a CUDA graph loop (EPD_CHAIN_LOOP=graph;
// server/backends/cuda_chain_loop.py). Built alone, as relocatable device code linked against
// the CUDA device runtime (libcudadevrt.a), which cudaGraphSetConditional needs; the other
// kernels stay in the NVRTC module that needs no linking.
typedef unsigned long long u64;
typedef unsigned long long cudaGraphConditionalHandle;  // (cuda_device_runtime_api.h's type)
extern "C" __device__ void cudaGraphSetConditional(cudaGraphConditionalHandle handle,
                                                   unsigned int value);
// (LLS_K, the member's state word with the next instance's k, comes from proto/abi.py: the
// builder puts its #define first)

// One thread, after the round's finish kernel: the next round takes the next k, unless the
// engine asked the loop to stop (its `stop` word, set by close() with a released entry
// published so the gate lets this last round through).
extern "C" __global__ void epd_ll_loop_next(u64* state, cudaGraphConditionalHandle loop,
                                            const unsigned* stop) {
    if (threadIdx.x != 0) return;
    state[LLS_K] += 1;
    cudaGraphSetConditional(loop, *reinterpret_cast<const volatile unsigned*>(stop) ? 0u : 1u);
}
