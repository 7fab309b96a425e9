/* Paged decode attention for the CPU path: one query token per sequence, read straight from the
 * block table (no gathered copy of the KV cache), float32 accumulation, OpenMP over
 * (sequence, kv head) pairs. Compiled on first use by common/cpu_attention.py.
 *
 * Layouts: q [B, H, D] with row stride q_stride (elements); k_cache, v_cache [N, bs, Hkv, D];
 * block_tables [B, max_blocks] int32; seq_lens [B] int32; out [B, H, D] contiguous.
 * dtype: 0 = float32, 1 = bfloat16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fff + ((u >> 16) & 1); /* round to nearest even, as torch does */
    return (uint16_t)(u >> 16);
}

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int32_t *block_tables, *seq_lens;
    void *out;
    int B, H, Hkv, D, bs, max_blocks, dtype;
    long q_stride;
    float scale;
} Job;

static inline void load_row(const void *restrict base, long idx, int D, int dtype,
                            float *restrict dst) {
    if (dtype == 0) {
        memcpy(dst, (const float *)base + idx, sizeof(float) * D);
    } else {
        const uint16_t *restrict src = (const uint16_t *)base + idx;
        for (int d = 0; d < D; d++) dst[d] = bf16_to_f32(src[d]);
    }
}

/* One (sequence, kv head): scores for its G query heads, softmax, weighted sum of V. D is a
 * compile-time constant in the specialised copies below, so the inner loops vectorise fully. */
static inline void attend_one(const Job *j, int b, int h, const int D, float *restrict scores,
                              float *restrict qf, float *restrict acc, float *restrict row) {
    const int G = j->H / j->Hkv, bs = j->bs, Hkv = j->Hkv;
    const int len = j->seq_lens[b];
    const int32_t *table = j->block_tables + (long)b * j->max_blocks;
    for (int g = 0; g < G; g++)
        load_row(j->q, b * j->q_stride + (long)(h * G + g) * D, D, j->dtype, qf + g * D);
    for (int t = 0; t < len; t++) {
        const long slot = (long)table[t / bs] * bs + t % bs;
        load_row(j->k_cache, (slot * Hkv + h) * D, D, j->dtype, row);
        for (int g = 0; g < G; g++) {
            const float *restrict qg = qf + g * D;
            float s = 0.f;
            for (int d = 0; d < D; d++) s += qg[d] * row[d];
            scores[g * len + t] = s * j->scale;
        }
    }
    float total[64];
    for (int g = 0; g < G; g++) {
        float *restrict sg = scores + g * len;
        float mx = -INFINITY;
        for (int t = 0; t < len; t++) mx = sg[t] > mx ? sg[t] : mx;
        for (int t = 0; t < len; t++) sg[t] = expf(sg[t] - mx);
        float sum = 0.f;
        for (int t = 0; t < len; t++) sum += sg[t];
        total[g] = sum;
    }
    memset(acc, 0, sizeof(float) * G * D);
    for (int t = 0; t < len; t++) {
        const long slot = (long)table[t / bs] * bs + t % bs;
        load_row(j->v_cache, (slot * Hkv + h) * D, D, j->dtype, row);
        for (int g = 0; g < G; g++) {
            const float p = scores[g * len + t];
            float *restrict ag = acc + g * D;
            for (int d = 0; d < D; d++) ag[d] += p * row[d];
        }
    }
    for (int g = 0; g < G; g++) {
        const long o = ((long)b * j->H + h * G + g) * D;
        const float inv = total[g] > 0.f ? 1.f / total[g] : 0.f;
        if (j->dtype == 0) {
            for (int d = 0; d < D; d++) ((float *)j->out)[o + d] = acc[g * D + d] * inv;
        } else {
            for (int d = 0; d < D; d++)
                ((uint16_t *)j->out)[o + d] = f32_to_bf16(acc[g * D + d] * inv);
        }
    }
}

/* Returns 0 on success, -1 for a shape this kernel does not take. */
int paged_decode(const void *q, long q_stride, const void *k_cache, const void *v_cache,
                 const int32_t *block_tables, const int32_t *seq_lens, void *out, int B, int H,
                 int Hkv, int D, int bs, int max_blocks, float scale, int dtype, int num_threads) {
    if (H % Hkv != 0 || H / Hkv > 64) return -1;
    Job job = {q, k_cache, v_cache, block_tables, seq_lens, out, B, H, Hkv, D, bs, max_blocks,
               dtype, q_stride, scale};
    const int G = H / Hkv, items = B * Hkv;
    int max_len = 1;
    long work = 0;
    for (int b = 0; b < B; b++) {
        if (seq_lens[b] > max_len) max_len = seq_lens[b];
        work += (long)seq_lens[b] * Hkv;
    }
    /* Waking threads costs more than a small batch's whole attention. This OpenMP runtime is the
     * one torch loaded (same soname), so the threads are torch's own pool, not a competing one. */
    if (work < 32768 || num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)G * max_len);
        float *qf = malloc(sizeof(float) * G * D);
        float *acc = malloc(sizeof(float) * G * D);
        float *row = malloc(sizeof(float) * D);
#pragma omp for schedule(static)
        for (int item = 0; item < items; item++) {
            const int b = item / Hkv, h = item % Hkv;
            switch (D) {
            case 64: attend_one(&job, b, h, 64, scores, qf, acc, row); break;
            case 128: attend_one(&job, b, h, 128, scores, qf, acc, row); break;
            default: attend_one(&job, b, h, D, scores, qf, acc, row); break;
            }
        }
        free(scores);
        free(qf);
        free(acc);
        free(row);
    }
    return 0;
}
