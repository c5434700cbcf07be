// Shared helpers, pasted in front of every kernel source by the Rust side (NVRTC gets no
// include path, so nothing here may #include a toolkit header).
//
// bf16 values travel as their raw 16 bits (unsigned short): the conversions below are the
// IEEE round-to-nearest-even ones torch uses, written out so that no cuda_bf16.h is needed.
typedef unsigned short bf16_t;

__device__ __forceinline__ float bf16_to_f32(bf16_t h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0u) {
        return (bf16_t)((u >> 16) | 0x0040u);  // NaN stays a (quiet) NaN
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// A grid-stride loop over n elements, 64-bit so that parameter vectors over 2^31 work.
#define GRID_STRIDE(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (long long)(n); \
         i += (long long)blockDim.x * gridDim.x)
