// EPD layout kernel: DeepEP's get_dispatch_layout (the semantics of server/reference.py
// `layout`). A function of the caller's topk_idx alone: the engine runs it for a layout call, and
// a client with EPD_LOCAL_LAYOUT=1 runs it on its own stream (client/local_layout.py), compiled
// from this file and epd_common.cuh only.
#include "epd_common.cuh"

// ------------------------------------------------------------------------------------------
// layout: topk_idx [T, K] -> num_tokens_per_rank [R], num_tokens_per_expert [E],
//         is_token_in_rank [T, R]. Outputs must be zeroed (counts are accumulated atomically).
// ------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(256)
epd_layout(const i64* __restrict__ topk_idx, int T, int K, int E, int R,
           int* __restrict__ num_tokens_per_rank, int* __restrict__ num_tokens_per_expert,
           bool* __restrict__ is_token_in_rank,
           u64* call_err) {  // own control block: bad ids are reported there (or null)
    extern __shared__ int s_expert[];  // [E]
    __shared__ int s_rank[LL_MAX_RANKS];  // (a two-stage normal-mode group: up to 64 ranks)
    const int L = E / R;
    for (int i = threadIdx.x; i < E; i += blockDim.x) s_expert[i] = 0;
    if (threadIdx.x < LL_MAX_RANKS) s_rank[threadIdx.x] = 0;
    __syncthreads();
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < T) {
        const u64 mask = token_ranks(topk_idx, t, K, E, L, s_expert, call_err_words(call_err));
        for (int d = 0; d < R; ++d) {
            bool in = (mask >> d) & 1ull;
            is_token_in_rank[(i64)t * R + d] = in;
            if (in) atomicAdd(&s_rank[d], 1);
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < E; i += blockDim.x)
        if (s_expert[i]) atomicAdd(&num_tokens_per_expert[i], s_expert[i]);
    if (threadIdx.x < R && s_rank[threadIdx.x]) atomicAdd(&num_tokens_per_rank[threadIdx.x],
                                                          s_rank[threadIdx.x]);
}
