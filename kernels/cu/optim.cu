// Fused optimizer updates: one pass over parameters, state and gradient (memory bound, so
// their speed is measured against the card's copy bandwidth).
//
// grad_scale folds the data-parallel averaging (1 / world) into the update. When p_bf16 is
// not null the updated parameter is also written in bf16 for the next forward pass.

// torch.optim.SGD with momentum: d = g + wd * p; v = momentum * v + d; p -= lr * v.
extern "C" __global__ void sgd_momentum(float* p, float* v, const float* g, bf16_t* p_bf16,
                                        long long n, float lr, float momentum, float wd,
                                        float grad_scale) {
    GRID_STRIDE(i, n) {
        float pi = p[i];
        float d = g[i] * grad_scale + wd * pi;
        float vi = momentum * v[i] + d;
        pi -= lr * vi;
        v[i] = vi;
        p[i] = pi;
        if (p_bf16) p_bf16[i] = f32_to_bf16(pi);
    }
}

// torch.optim.Adam (L2 weight decay added to the gradient). bc1 = 1 - beta1^t and
// bc2 = 1 - beta2^t are computed on the host for step t.
extern "C" __global__ void adam(float* p, float* m, float* v, const float* g, bf16_t* p_bf16,
                                long long n, float lr, float beta1, float beta2, float eps,
                                float wd, float bc1, float bc2, float grad_scale) {
    GRID_STRIDE(i, n) {
        float pi = p[i];
        float gi = g[i] * grad_scale + wd * pi;
        float mi = beta1 * m[i] + (1.0f - beta1) * gi;
        float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        pi -= lr * (mi / bc1) / (sqrtf(vi / bc2) + eps);
        p[i] = pi;
        if (p_bf16) p_bf16[i] = f32_to_bf16(pi);
    }
}
