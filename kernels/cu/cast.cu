// bf16 <-> fp32 casts for mixed precision (bf16 as raw 16-bit words).

extern "C" __global__ void f32_to_bf16_kernel(const float* x, bf16_t* y, long long n) {
    GRID_STRIDE(i, n) { y[i] = f32_to_bf16(x[i]); }
}

extern "C" __global__ void bf16_to_f32_kernel(const bf16_t* x, float* y, long long n) {
    GRID_STRIDE(i, n) { y[i] = bf16_to_f32(x[i]); }
}

// y = a * x + y, used to combine gradients and by the benchmarks.
extern "C" __global__ void axpy_f32(float* y, const float* x, float a, long long n) {
    GRID_STRIDE(i, n) { y[i] += a * x[i]; }
}
