// Softmax cross-entropy on logits [rows x k]: per-row loss and the gradient of the mean loss.

// For row r with label y: loss[r] = log(sum_c exp(z_c - m)) + m - z_y, and
// dz[r, c] = (softmax(z)_c - [c == y]) * scale, scale = 1 / batch for the mean.
// One thread per row: k (classes) is small for this model. A label outside 0..k gives a NaN
// loss rather than reading out of bounds.
extern "C" __global__ void softmax_xent(const float* z, const unsigned int* labels, float* dz,
                                       float* loss, int rows, int k, float scale) {
    GRID_STRIDE(r, rows) {
        const float* row = z + r * (long long)k;
        float* drow = dz + r * (long long)k;
        unsigned int y = labels[r];
        float m = __int_as_float(0xff800000);  // -inf
        for (int c = 0; c < k; ++c) m = fmaxf(m, row[c]);
        float s = 0.0f;
        for (int c = 0; c < k; ++c) s += expf(row[c] - m);
        float zy = y < (unsigned int)k ? row[y] : __int_as_float(0x7fc00000);
        loss[r] = logf(s) + m - zy;
        for (int c = 0; c < k; ++c) {
            float p = expf(row[c] - m) / s;
            drow[c] = (p - (c == (int)y ? 1.0f : 0.0f)) * scale;
        }
    }
}
