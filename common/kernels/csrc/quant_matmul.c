/* Weight-only quantized matmul for the CPU path: out[M, N] = x[M, K] @ W.T with W stored as int4
 * (group-wise scale and zero) or int8 (group-wise or per-channel scale), the format of
 * common/model/quant.py. Each weight group is unpacked once and used for every row of x (M is a
 * decode batch, small), float32 accumulation, OpenMP over output columns. Compiled on first use by
 * common/kernels/cpu_quant.py.
 *
 * For a group g of row n with codes q_j, scale s and zero z:
 *   int4: sum_j x_j * ((q_j - 8) s + z) = s * sum_j x_j q_j + (z - 8 s) * sum_j x_j
 *   int8: sum_j x_j * (q_j s + z)       = s * sum_j x_j q_j + z * sum_j x_j
 * so the caller passes the per-group sums of x (xsum [M, G]) and the inner loop is a plain dot.
 * For int4 the caller also reorders x within each group as [even columns | odd columns], matching
 * the packed bytes (low nibble = column 2j, high nibble = column 2j+1).
 *
 * Layouts: x [M, K] float32 contiguous; xsum [M, G] float32; qweight uint8 [N, K/2] or int8 [N, K];
 * scale, zero [N, G] float32 (sdtype 0) or bfloat16 (sdtype 1), zero may be NULL; out [M, N] f32.
 */
#include <stdint.h>
#include <string.h>

#define MAX_M 16

static inline float load_s(const void *p, long i, int sdtype) {
    if (sdtype == 0) return ((const float *)p)[i];
    uint32_t u = ((uint32_t)((const uint16_t *)p)[i]) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* dot of one int4 group (gs/2 bytes) with x laid out [even | odd] */
static inline float dot4(const uint8_t *restrict q, const float *restrict xe,
                         const float *restrict xo, int half) {
    float acc = 0.0f;
    for (int j = 0; j < half; j++) {
        acc += xe[j] * (float)(q[j] & 15) + xo[j] * (float)(q[j] >> 4);
    }
    return acc;
}

static inline float dot8(const int8_t *restrict q, const float *restrict x, int gs) {
    float acc = 0.0f;
    for (int j = 0; j < gs; j++) acc += x[j] * (float)q[j];
    return acc;
}

int quant_matmul(const float *x, const float *xsum, int M, int K, int N, int bits, int gs,
                 const void *qweight, const void *scale, const void *zero, int sdtype, float *out,
                 int nthreads) {
    if (M < 1 || M > MAX_M || gs <= 0 || K % gs || (bits != 4 && bits != 8) || (gs & 1))
        return 1;
    const int G = K / gs;
    const long row_bytes = bits == 4 ? K / 2 : K;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int n = 0; n < N; n++) {
        float acc[MAX_M];
        for (int m = 0; m < M; m++) acc[m] = 0.0f;
        const uint8_t *qrow = (const uint8_t *)qweight + (long)n * row_bytes;
        for (int g = 0; g < G; g++) {
            const float s = load_s(scale, (long)n * G + g, sdtype);
            const float z = zero ? load_s(zero, (long)n * G + g, sdtype) : 0.0f;
            const float zc = bits == 4 ? z - 8.0f * s : z;
            for (int m = 0; m < M; m++) {
                const float *xg = x + (long)m * K + (long)g * gs;
                float d = bits == 4 ? dot4(qrow + (long)g * (gs / 2), xg, xg + gs / 2, gs / 2)
                                    : dot8((const int8_t *)qrow + (long)g * gs, xg, gs);
                acc[m] += s * d + zc * xsum[(long)m * G + g];
            }
        }
        for (int m = 0; m < M; m++) out[(long)m * N + n] = acc[m];
    }
    return 0;
}
