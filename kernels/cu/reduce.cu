// Reductions: the bias gradient (column sums) and a deterministic sum of a vector.

// gb[c] = beta * gb[c] + sum_r dy[r, c]. One thread per column: neighbouring threads read
// neighbouring addresses, and the row order of the sum is fixed (deterministic).
extern "C" __global__ void bias_grad(const float* dy, float* gb, int rows, int cols, float beta) {
    GRID_STRIDE(c, cols) {
        float acc = 0.0f;
        for (int r = 0; r < rows; ++r) acc += dy[(long long)r * cols + c];
        gb[c] = (beta == 0.0f ? 0.0f : beta * gb[c]) + acc;
    }
}

// out[0] = scale * sum(x[0..n]); launch with ONE block of 256 threads (fixed order).
extern "C" __global__ void sum_scaled(const float* x, float* out, int n, float scale) {
    __shared__ float part[256];
    float acc = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) acc += x[i];
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[0] = part[0] * scale;
}
