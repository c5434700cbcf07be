// Bias and activation, forward and backward, for row-major activations [rows x cols].

// y[r, c] = act(y[r, c] + b[c]); act is ReLU when relu != 0, identity otherwise.
// When y_bf16 is not null it also receives the result in bf16 (the next layer's GEMM input
// under mixed precision), saving a separate cast pass.
extern "C" __global__ void bias_act_fwd(float* y, const float* b, bf16_t* y_bf16,
                                        int rows, int cols, int relu) {
    GRID_STRIDE(i, (long long)rows * cols) {
        float v = y[i] + b[i % cols];
        if (relu && v < 0.0f) v = 0.0f;
        y[i] = v;
        if (y_bf16) y_bf16[i] = f32_to_bf16(v);
    }
}

// dx[i] = 0 where the layer input a[i] (a ReLU output) was cut (a <= 0), as the CPU model does.
extern "C" __global__ void relu_bwd(float* dx, const float* a, bf16_t* dx_bf16, long long n) {
    GRID_STRIDE(i, n) {
        float g = a[i] > 0.0f ? dx[i] : 0.0f;
        dx[i] = g;
        if (dx_bf16) dx_bf16[i] = f32_to_bf16(g);
    }
}

// GELU (tanh approximation), forward and backward, for models that prefer it to ReLU.
extern "C" __global__ void bias_gelu_fwd(float* y, const float* b, float* pre, int rows, int cols) {
    GRID_STRIDE(i, (long long)rows * cols) {
        float x = y[i] + b[i % cols];
        pre[i] = x;
        float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
        // 0.5 (1 + tanh u) = sigmoid(2u): no cancellation where tanh u rounds to -1.
        y[i] = x / (1.0f + expf(-2.0f * u));
    }
}

extern "C" __global__ void gelu_bwd(float* dx, const float* pre, long long n) {
    GRID_STRIDE(i, n) {
        float x = pre[i];
        float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
        float du = 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * x * x);
        // With s = sigmoid(2u) = 0.5 (1 + tanh u) and sm = 1 - s = sigmoid(-2u), each from its
        // own exponential: 1 - tanh^2 u = 4 s sm. The tanh form rounds both terms to 0 in the
        // tails (x < -5: 1 + tanhf(u) == 0 in fp32) where the true derivative is ~1e-6.
        float s = 1.0f / (1.0f + expf(-2.0f * u));
        float sm = 1.0f / (1.0f + expf(2.0f * u));
        float d = s + 2.0f * x * s * sm * du;
        dx[i] *= d;
    }
}
