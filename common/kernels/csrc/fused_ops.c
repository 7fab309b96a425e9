/* Fused element-wise ops of the decoder layer for the CPU path: residual add + RMSNorm, rotary
 * embedding of q and k in one pass (plus storing k and v into their KV-cache slots), storing
 * K and V into a cache of another dtype (8-bit with scales, or float16), SiLU * up;
 * and each row's argmax, the sampler's greedy pick. Compiled on first use by
 * common/kernels/cpu_ops.py.
 *
 * Each op rounds where the eager torch code rounds (bfloat16 after every torch op, float32
 * statistics in RMSNorm), and is built with -ffp-contract=off (no FMA contraction), so rotary
 * and the residual add are bit-exact against torch; RMSNorm differs only in the order of its
 * sum of squares, SiLU only in the last bits of exp (a vectorisable polynomial). No -ffast-math:
 * it would also set the process-wide flush-to-zero flags when the library loads. AVX-512
 * builds run RMSNorm, rotary and SiLU on 16 lanes of their own, with the scalar code's
 * operations in its order (the same bits; tested against those steps done one at a time).
 * Rows are independent: a prefill chunk's and a decode step's of a few rows on go across the
 * OpenMP threads (torch's pool: the same runtime, so the same thread count), a step of one or
 * two on the calling thread, where a fork-join costs more than the work (STEP_PARALLEL_MIN).
 *
 * dtype: 0 = float32, 1 = bfloat16. Strides are in elements.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vecmath.h"

/* bfloat16 rounding of a float, kept as a float: what a bf16 torch op stores. */
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#define MAX_DIM 16384 /* widest RMSNorm row (cpu_ops.MAX_HIDDEN): the largest hidden size */
/* values an op touches below which one thread does it (argmax, store_kv_rows). A 64 x 256-token
 * prefill spent about a tenth of its time in these ops on one thread while the other waited
 * (perf, 2 threads). */
#define PARALLEL_MIN 32768L
/* ... but inside a decode step (RMSNorm, rotary, SiLU: the threads' pool is awake, the step's
 * matmuls just ran on it) the fork-join pays from a few rows on: a batch-16 decode step's SiLU
 * took 1.04 ms of its 11.1 on one thread, 0.53 on two, rotary 0.58 -> 0.37, the two RMSNorms
 * 0.47 -> 0.35 (default model, 2 threads, AVX-512 host; SiLU at 4 rows 0.24 -> 0.17 ms) */
#define STEP_PARALLEL_MIN 4096L

static inline void load_row(const void *base, long idx, int n, int dtype, float *restrict dst) {
    if (dtype == 0) {
        memcpy(dst, (const float *)base + idx, sizeof(float) * n);
    } else {
        const uint16_t *restrict src = (const uint16_t *)base + idx;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    }
}

static inline void store_row(void *base, long idx, int n, int dtype, const float *restrict src) {
    if (dtype == 0) {
        memcpy((float *)base + idx, src, sizeof(float) * n);
    } else {
        uint16_t *restrict dst = (uint16_t *)base + idx;
        for (int i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
    }
}

/* Sum of squares in eight float lanes (vectorises without reassociation flags). */
static inline float sum_squares(const float *restrict v, int n) {
    float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) lanes[l] += v[i + l] * v[i + l];
    float tail = 0.0f;
    for (; i < n; i++) tail += v[i] * v[i];
    return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
           ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7])) + tail;
}

/* add_rms_norm's row r (below) */
static void rms_norm_row(const void *x, long x_stride, void *residual, long res_stride,
                         const float *w, void *out, long out_stride, int r, int dim, float eps,
                         int dtype) {
    float row[MAX_DIM], tmp[MAX_DIM];
    load_row(x, r * x_stride, dim, dtype, row);
    if (residual != NULL) {
        load_row(residual, r * res_stride, dim, dtype, tmp);
        if (dtype == 0) {
            for (int i = 0; i < dim; i++) row[i] += tmp[i];
        } else {
            for (int i = 0; i < dim; i++) row[i] = round_bf16(row[i] + tmp[i]);
        }
        store_row(residual, r * res_stride, dim, dtype, row);
    }
    const float inv = 1.0f / sqrtf(sum_squares(row, dim) / (float)dim + eps);
    if (dtype == 0) {
        for (int i = 0; i < dim; i++) tmp[i] = row[i] * inv * w[i];
    } else {
        for (int i = 0; i < dim; i++) tmp[i] = round_bf16(row[i] * inv) * w[i];
    }
    store_row(out, r * out_stride, dim, dtype, tmp);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
/* f32_to_bf16 (vecmath.h) on 16 lanes: the 16-bit results in 32-bit lanes */
static inline __m512i bf16_bits16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
}
static inline __m512 round_bf16_16(__m512 v) { /* round_bf16 on 16 lanes */
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16));
}
static inline __m512 load16_at(const void *base, long idx, int dtype) {
    if (dtype == 0) return _mm512_loadu_ps((const float *)base + idx);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + idx));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline void store16_at(void *base, long idx, int dtype, __m512 v) {
    if (dtype == 0)
        _mm512_storeu_ps((float *)base + idx, v);
    else /* v is already rounded: its high halves are the bfloat16 values */
        _mm256_storeu_si256((__m256i *)((uint16_t *)base + idx),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}

#define NORM_ROWS 4
/* rms_norm_row on rows r0..r0+R-1 (R <= NORM_ROWS) together, 16 lanes at a time, for dim %
 * 16 == 0: each row through the scalar code's operations in its order (the sum of squares in
 * the same eight lanes, element 8k + l into lane l in order of k), so the same bits; the rows'
 * chains of dependent adds side by side (one row's alone bounded the scalar code) */
static void rms_norm_rows_avx512(const void *x, long x_stride, void *residual, long res_stride,
                                 const float *w, void *out, long out_stride, int r0, int R,
                                 int dim, float eps, int dtype) {
    __m256 acc[NORM_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int i = 0; i < dim; i += 16)
        for (int r = 0; r < R; r++) {
            __m512 y = load16_at(x, (r0 + r) * x_stride + i, dtype);
            if (residual != NULL) {
                y = _mm512_add_ps(y, load16_at(residual, (r0 + r) * res_stride + i, dtype));
                if (dtype != 0) y = round_bf16_16(y);
                store16_at(residual, (r0 + r) * res_stride + i, dtype, y);
            }
            const __m256 lo = _mm512_castps512_ps256(y);
            const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(y), 1));
            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(lo, lo));
            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(hi, hi));
        }
    float inv[NORM_ROWS];
    for (int r = 0; r < R; r++) {
        float l[8];
        _mm256_storeu_ps(l, acc[r]);
        const float sum = ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7])) + 0.0f;
        inv[r] = 1.0f / sqrtf(sum / (float)dim + eps);
    }
    for (int r = 0; r < R; r++) {
        const void *src = residual != NULL ? residual : x;
        const long stride = residual != NULL ? res_stride : x_stride;
        const __m512 iv = _mm512_set1_ps(inv[r]);
        for (int i = 0; i < dim; i += 16) {
            __m512 n = _mm512_mul_ps(load16_at(src, (r0 + r) * stride + i, dtype), iv);
            if (dtype != 0) n = round_bf16_16(n);
            n = _mm512_mul_ps(n, _mm512_loadu_ps(w + i));
            if (dtype != 0) n = round_bf16_16(n);
            store16_at(out, (r0 + r) * out_stride + i, dtype, n);
        }
    }
}
#endif

/* Per row: if residual is given, residual = x + residual (rounded to dtype), normalised row =
 * residual; else normalised row = x. out = weight * norm(row), where for bfloat16 the normalised
 * value is rounded to bfloat16 before the weight multiply (HF's order). */
int add_rms_norm(const void *x, long x_stride, void *residual, long res_stride,
                 const void *weight, void *out, long out_stride, int rows, int dim, float eps,
                 int dtype) {
    if (dim <= 0 || dim > MAX_DIM) return 1;
    float w[MAX_DIM];
    load_row(weight, 0, dim, dtype, w);
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (dim % 16 == 0) {
        const int groups = (rows + NORM_ROWS - 1) / NORM_ROWS;
#define NORM_GROUP(g)                                                                            \
    rms_norm_rows_avx512(x, x_stride, residual, res_stride, w, out, out_stride, (g) * NORM_ROWS,  \
                         rows - (g) * NORM_ROWS < NORM_ROWS ? rows - (g) * NORM_ROWS : NORM_ROWS, \
                         dim, eps, dtype)
        if ((long)rows * dim < STEP_PARALLEL_MIN) {
            for (int g = 0; g < groups; g++) NORM_GROUP(g);
            return 0;
        }
#pragma omp parallel for schedule(static)
        for (int g = 0; g < groups; g++) NORM_GROUP(g);
#undef NORM_GROUP
        return 0;
    }
#endif
    if ((long)rows * dim < STEP_PARALLEL_MIN) { /* not even an if(0) region: it costs ~0.5 us */
        for (int r = 0; r < rows; r++)
            rms_norm_row(x, x_stride, residual, res_stride, w, out, out_stride, r, dim, eps,
                         dtype);
        return 0;
    }
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++)
        rms_norm_row(x, x_stride, residual, res_stride, w, out, out_stride, r, dim, eps, dtype);
    return 0;
}

/* Rotate one head in place (half-split layout): x*cos + cat(-x2, x1)*sin, each product and the
 * sum rounded to dtype as the eager ops round them; cos/sin rounded to dtype first, as eager
 * casts its tables. */
static inline void rotate_head(float *restrict h, const float *restrict c,
                               const float *restrict s, int D, int dtype) {
    const int half = D / 2;
    float out[D];
    if (dtype == 0) {
        for (int i = 0; i < half; i++) {
            out[i] = h[i] * c[i] + (-h[i + half]) * s[i];
            out[i + half] = h[i + half] * c[i + half] + h[i] * s[i + half];
        }
    } else {
        for (int i = 0; i < half; i++) {
            out[i] = round_bf16(round_bf16(h[i] * c[i]) + round_bf16(-h[i + half] * s[i]));
            out[i + half] = round_bf16(round_bf16(h[i + half] * c[i + half]) +
                                       round_bf16(h[i] * s[i + half]));
        }
    }
    memcpy(h, out, sizeof(float) * D);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* rotate_head on every head of a row, 16 lanes at a time, straight from and to qkv (and the k
 * heads to their cache slot): the same operations in the same order (no FMA), so the same
 * bits. For head sizes with half % 16 == 0. The compiler's 8-lane loops through float copies
 * took 1.1 ms a layer for 2,048 tokens (2 threads). */
static void rotate_heads_avx512(void *qkv, long row, const float *restrict c,
                                const float *restrict s, int H, int Hkv, int D, void *k_cache,
                                int64_t slot, int dtype) {
    const int half = D / 2;
    for (int h = 0; h < H + Hkv; h++) {
        const long idx = row + (long)h * D;
        const long kidx = (slot * Hkv + (h - H)) * D;
        for (int i = 0; i < half; i += 16) {
            const __m512 x1 = load16_at(qkv, idx + i, dtype);
            const __m512 x2 = load16_at(qkv, idx + half + i, dtype);
            const __m512 c1 = _mm512_loadu_ps(c + i), s1 = _mm512_loadu_ps(s + i);
            const __m512 c2 = _mm512_loadu_ps(c + half + i), s2 = _mm512_loadu_ps(s + half + i);
            const __m512 neg2 = _mm512_castsi512_ps(
                _mm512_xor_si512(_mm512_castps_si512(x2), _mm512_set1_epi32((int)0x80000000)));
            __m512 o1, o2;
            if (dtype == 0) {
                o1 = _mm512_add_ps(_mm512_mul_ps(x1, c1), _mm512_mul_ps(neg2, s1));
                o2 = _mm512_add_ps(_mm512_mul_ps(x2, c2), _mm512_mul_ps(x1, s2));
            } else {
                o1 = round_bf16_16(_mm512_add_ps(round_bf16_16(_mm512_mul_ps(x1, c1)),
                                                 round_bf16_16(_mm512_mul_ps(neg2, s1))));
                o2 = round_bf16_16(_mm512_add_ps(round_bf16_16(_mm512_mul_ps(x2, c2)),
                                                 round_bf16_16(_mm512_mul_ps(x1, s2))));
            }
            store16_at(qkv, idx + i, dtype, o1);
            store16_at(qkv, idx + half + i, dtype, o2);
            if (slot >= 0 && h >= H) {
                store16_at(k_cache, kidx + i, dtype, o1);
                store16_at(k_cache, kidx + half + i, dtype, o2);
            }
        }
    }
}
#endif

#define ROPE_AHEAD 2 /* rows */
/* rope_qk's row t (below) */
static void rope_row(void *qkv, long qkv_stride, const int64_t *positions,
                     const float *cos_table, const float *sin_table, int t, int T, int H,
                     int Hkv, int D, void *k_cache, void *v_cache, const int64_t *slot_mapping,
                     int dtype) {
    float c[D], s[D], head[D];
    /* the cache slots of the row ROPE_AHEAD on, asked for with intent to write: their lines
     * are seldom cached (a new token's slot), and the stores below waited on each in turn
     * (default model, 64-row decode step: rotary with the stores 1.37-1.40 -> 0.94-0.98 ms) */
    if (k_cache != NULL && t + ROPE_AHEAD < T && slot_mapping[t + ROPE_AHEAD] >= 0) {
        const size_t bytes = (size_t)Hkv * D * (dtype == 0 ? 4 : 2);
        const char *k = (const char *)k_cache + slot_mapping[t + ROPE_AHEAD] * bytes;
        const char *v = (const char *)v_cache + slot_mapping[t + ROPE_AHEAD] * bytes;
        for (size_t o = 0; o < bytes; o += 64) {
            __builtin_prefetch(k + o, 1, 3);
            __builtin_prefetch(v + o, 1, 3);
        }
    }
    const int heads = H + Hkv;
    const int64_t p = positions[t];
    for (int i = 0; i < D; i++) {
        c[i] = cos_table[p * D + i];
        s[i] = sin_table[p * D + i];
        if (dtype == 1) {
            c[i] = round_bf16(c[i]);
            s[i] = round_bf16(s[i]);
        }
    }
    const long row = t * qkv_stride;
    const int64_t slot = k_cache != NULL ? slot_mapping[t] : -1;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if ((D / 2) % 16 == 0)
        rotate_heads_avx512(qkv, row, c, s, H, Hkv, D, k_cache, slot, dtype);
    else
#endif
    for (int h = 0; h < heads; h++) {
        const long idx = row + (long)h * D;
        load_row(qkv, idx, D, dtype, head);
        rotate_head(head, c, s, D, dtype);
        store_row(qkv, idx, D, dtype, head);
        if (slot >= 0 && h >= H) store_row(k_cache, (slot * Hkv + (h - H)) * D, D, dtype, head);
    }
    if (slot >= 0) {
        const size_t elem = dtype == 0 ? 4 : 2;
        const char *v = (const char *)qkv + (row + (long)heads * D) * elem;
        memcpy((char *)v_cache + slot * Hkv * D * elem, v, (size_t)Hkv * D * elem);
    }
}

/* qkv [T, (H + 2*Hkv) * D] with row stride qkv_stride: rotates q's H heads and k's Hkv heads in
 * place at positions[t] (cos/sin tables float32 [max_pos, D]). If k_cache is given (contiguous
 * [num_slots, Hkv, D]), also stores the rotated k and the v heads at slot_mapping[t] (negative
 * slots are padding and skipped). Returns 2 for a position outside the tables, 3 for a slot
 * past the cache, both checked before anything is written. */
int rope_qk(void *qkv, long qkv_stride, const int64_t *positions, const float *cos_table,
            const float *sin_table, long max_pos, int T, int H, int Hkv, int D, void *k_cache,
            void *v_cache, const int64_t *slot_mapping, long num_slots, int dtype) {
    if (D <= 0 || D % 2 != 0 || D > 1024) return 1;
    for (int t = 0; t < T; t++) {
        if (positions[t] < 0 || positions[t] >= max_pos) return 2;
        if (k_cache != NULL && slot_mapping[t] >= num_slots) return 3;
    }
    if ((long)T * (H + Hkv) * D < STEP_PARALLEL_MIN) {
        for (int t = 0; t < T; t++)
            rope_row(qkv, qkv_stride, positions, cos_table, sin_table, t, T, H, Hkv, D, k_cache,
                     v_cache, slot_mapping, dtype);
        return 0;
    }
#pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++)
        rope_row(qkv, qkv_stride, positions, cos_table, sin_table, t, T, H, Hkv, D, k_cache,
                 v_cache, slot_mapping, dtype);
    return 0;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* exp_approx on V vectors of 16 lanes, step by step across them (each step's V operations are
 * independent, so they overlap: one vector's chain of ~20 dependent operations alone measured
 * ~27 cycles), the same operations in the same order as exp_approx (no FMA): the same bits */
#define SILU_V 4
static inline void exp16s(__m512 *x, int V) {
    __m512 n[SILU_V], r[SILU_V], p[SILU_V];
    for (int v = 0; v < V; v++) {
        x[v] = _mm512_min_ps(_mm512_set1_ps(88.72283f),
                             _mm512_max_ps(_mm512_set1_ps(-87.33654f), x[v]));
        n[v] = _mm512_roundscale_ps(
            _mm512_add_ps(_mm512_mul_ps(x[v], _mm512_set1_ps(1.44269504088896341f)),
                          _mm512_set1_ps(0.5f)),
            _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        r[v] = _mm512_sub_ps(x[v], _mm512_mul_ps(n[v], _mm512_set1_ps(0.693359375f)));
        r[v] = _mm512_sub_ps(r[v], _mm512_mul_ps(n[v], _mm512_set1_ps(-2.12194440e-4f)));
        p[v] = _mm512_set1_ps(1.9875691500e-4f);
    }
    static const float c[5] = {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                               1.6666665459e-1f, 5.0000001201e-1f};
    for (int i = 0; i < 5; i++)
        for (int v = 0; v < V; v++)
            p[v] = _mm512_add_ps(_mm512_mul_ps(p[v], r[v]), _mm512_set1_ps(c[i]));
    for (int v = 0; v < V; v++) {
        p[v] = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p[v], _mm512_mul_ps(r[v], r[v])), r[v]),
                             _mm512_set1_ps(1.0f));
        const __m512i bits = _mm512_slli_epi32(
            _mm512_add_epi32(_mm512_cvttps_epi32(n[v]), _mm512_set1_epi32(127)), 23);
        x[v] = _mm512_mul_ps(p[v], _mm512_castsi512_ps(bits));
    }
}

static inline __m512 load16_any(const void *base, long idx, __mmask16 m, int dtype) {
    if (dtype == 0) return _mm512_maskz_loadu_ps(m, (const float *)base + idx);
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)base + idx);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* V vectors (16 x V elements from i; the last masked by `last`) of silu_row */
static inline __attribute__((always_inline)) void silu_vectors(const void *gate_up, long in,
                                                               void *out, long o, int I, int i,
                                                               int V, __mmask16 last,
                                                               int dtype) {
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    __m512 g[SILU_V], u[SILU_V], e[SILU_V];
    for (int v = 0; v < V; v++) {
        const __mmask16 m = v == V - 1 ? last : (__mmask16)0xFFFF;
        g[v] = load16_any(gate_up, in + i + 16 * v, m, dtype);
        u[v] = load16_any(gate_up, in + I + i + 16 * v, m, dtype);
        e[v] = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g[v]), sign));
    }
    exp16s(e, V);
    for (int v = 0; v < V; v++) {
        const __mmask16 m = v == V - 1 ? last : (__mmask16)0xFFFF;
        __m512 s = _mm512_div_ps(g[v], _mm512_add_ps(_mm512_set1_ps(1.0f), e[v]));
        if (dtype == 0) {
            _mm512_mask_storeu_ps((float *)out + o + i + 16 * v, m, _mm512_mul_ps(s, u[v]));
            continue;
        }
        s = round_bf16_16(s);
        _mm256_mask_storeu_epi16((uint16_t *)out + o + i + 16 * v, m,
                                 _mm512_cvtepi32_epi16(bf16_bits16(_mm512_mul_ps(s, u[v]))));
    }
}

/* silu_row on 16 lanes, SILU_V vectors at a time (the last ones masked): the scalar loop's
 * operations lane by lane, so the same bits, straight from and to the rows (the compiler made
 * 8-lane loops through float buffers, ~3.3 cycles an element at the default model's width) */
static void silu_row_avx512(const void *gate_up, long in_stride, void *out, long out_stride,
                            int t, int I, int dtype) {
    const long in = t * in_stride, o = t * out_stride;
    int i = 0;
    for (; i + 16 * SILU_V <= I; i += 16 * SILU_V)
        silu_vectors(gate_up, in, out, o, I, i, SILU_V, (__mmask16)0xFFFF, dtype);
    for (; i < I; i += 16) {
        const __mmask16 m = I - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (I - i)) - 1);
        silu_vectors(gate_up, in, out, o, I, i, 1, m, dtype);
    }
}
#endif

/* out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i], silu rounded to dtype before the
 * multiply (F.silu(gate).mul_(up)). */
static void silu_row(const void *gate_up, long in_stride, void *out, long out_stride, int t,
                     int I, int dtype) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    silu_row_avx512(gate_up, in_stride, out, out_stride, t, I, dtype);
    return;
#endif
    enum { CHUNK = 4096 }; /* element-wise: any width, in chunks that stay in L1 */
    float g[CHUNK], u[CHUNK];
    for (int i0 = 0; i0 < I; i0 += CHUNK) {
        const int n = I - i0 < CHUNK ? I - i0 : CHUNK;
        load_row(gate_up, t * in_stride + i0, n, dtype, g);
        load_row(gate_up, t * in_stride + I + i0, n, dtype, u);
        if (dtype == 0) {
            for (int i = 0; i < n; i++) g[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
        } else {
            for (int i = 0; i < n; i++) g[i] = round_bf16(g[i] / (1.0f + exp_approx(-g[i]))) * u[i];
        }
        store_row(out, t * out_stride + i0, n, dtype, g);
    }
}

int silu_mul(const void *gate_up, long in_stride, void *out, long out_stride, int T, int I,
             int dtype) {
    if (I <= 0) return 1;
    if ((long)T * I < STEP_PARALLEL_MIN) {
        for (int t = 0; t < T; t++) silu_row(gate_up, in_stride, out, out_stride, t, I, dtype);
        return 0;
    }
#pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++) silu_row(gate_up, in_stride, out, out_stride, t, I, dtype);
    return 0;
}

/* float32 (|y| <= 448, finite) -> float8 e4m3fn, round to nearest even, as torch's cast. */
static inline uint8_t f32_to_e4m3(float y) {
    uint32_t bits;
    memcpy(&bits, &y, 4);
    const uint8_t sign = (bits >> 24) & 0x80;
    bits &= 0x7fffffffu;
    float a;
    memcpy(&a, &bits, 4);
    if (a < 0.015625f) return sign | (uint8_t)rintf(a * 512.f); /* below 2^-6: steps of 2^-9 */
    /* keep 3 mantissa bits (ties to even); the exponent re-biased from 127 to 7 */
    const uint32_t r = (bits + 0x7ffffu + ((bits >> 20) & 1)) >> 20;
    return sign | (uint8_t)(r - (120u << 3));
}

/* float32 -> IEEE float16, round to nearest even (torch's cast); overflow to infinity. */
static inline uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (x >> 16) & 0x8000;
    const uint32_t a = x & 0x7fffffffu;
    if (a >= 0x7f800000u) return sign | 0x7c00 | (a > 0x7f800000u ? 0x200 : 0); /* inf, NaN */
    if (a >= 0x477ff000u) return sign | 0x7c00; /* 65520 and up round to infinity */
    if (a < 0x38800000u) {                      /* below 2^-14: subnormal, steps of 2^-24 */
        float v;
        memcpy(&v, &a, 4);
        return sign | (uint16_t)rintf(v * 16777216.f);
    }
    const uint32_t r = (a + 0xfffu + ((a >> 13) & 1)) >> 13; /* 10 mantissa bits, ties even */
    return sign | (uint16_t)(r - (112u << 10));
}

/* store_kv_rows's token t (below) */
static void store_kv_token(const void *k, long k_stride, const void *v, long v_stride, int t,
                           int Hkv, int D, int dtype, int64_t slot, void *k_cache, void *v_cache,
                           float *k_scales, float *v_scales, int kv_dtype) {
    const float qmax = kv_dtype == 2 ? 127.f : 448.f;
    float row[D];
    for (int part = 0; part < 2; part++) { /* K, then V */
        const void *src = part ? v : k;
        const long stride = part ? v_stride : k_stride;
        uint8_t *cache = part ? v_cache : k_cache;
        float *scales = part ? v_scales : k_scales;
        for (int j = 0; j < Hkv; j++) {
            load_row(src, t * stride + (long)j * D, D, dtype, row);
            const long slot_row = slot * Hkv + j;
            if (kv_dtype == 4) { /* float16: converted, no scale */
                uint16_t *dst16 = (uint16_t *)cache + slot_row * D;
                for (int d = 0; d < D; d++) dst16[d] = f32_to_f16(row[d]);
                continue;
            }
            float amax = 0.f;
            for (int d = 0; d < D; d++) amax = fabsf(row[d]) > amax ? fabsf(row[d]) : amax;
            const float scale = amax / qmax, div = scale > FLT_MIN ? scale : FLT_MIN;
            scales[slot_row] = scale;
            uint8_t *dst = cache + slot_row * D;
            for (int d = 0; d < D; d++) {
                float y = row[d] / div;
                y = y > qmax ? qmax : y < -qmax ? -qmax : y;
                dst[d] = kv_dtype == 2 ? (uint8_t)(int8_t)rintf(y) : f32_to_e4m3(y);
            }
        }
    }
}

/* New keys and values, token t's kv head j at k + t * k_stride + j * D (v alike; dtype 0 =
 * float32, 1 = bfloat16), into their slots of a cache not in that dtype: kv_dtype 2 = int8 or
 * 3 = float8 e4m3, each (token, kv head) row quantized with its float32 scale into k_scales /
 * v_scales [slots, Hkv] as common/kernels/kv_quant.py does (absmax / 127 or / 448, the same
 * float32 division, round to nearest even, so the bytes equal the torch path's); 4 = float16,
 * converted as torch casts (no scales). Caches [slots, Hkv, D], contiguous. Negative slots are
 * padding. Returns 1 for a bad shape or kv_dtype, 3 for a slot past the cache (checked before
 * anything is written). Called by decode_layer.c and by common.kernels.cpu_ops.store_kv. */
int store_kv_rows(const void *k, long k_stride, const void *v, long v_stride, int T, int Hkv,
                  int D, int dtype, const int64_t *slots, long num_slots, void *k_cache,
                  void *v_cache, float *k_scales, float *v_scales, int kv_dtype) {
    if (D <= 0 || D > 1024 || Hkv <= 0 || kv_dtype < 2 || kv_dtype > 4) return 1;
    if (kv_dtype != 4 && (k_scales == NULL || v_scales == NULL)) return 1;
    for (int t = 0; t < T; t++)
        if (slots[t] >= num_slots) return 3;
    if ((long)T * Hkv * D < PARALLEL_MIN) {
        for (int t = 0; t < T; t++)
            if (slots[t] >= 0)
                store_kv_token(k, k_stride, v, v_stride, t, Hkv, D, dtype, slots[t], k_cache,
                               v_cache, k_scales, v_scales, kv_dtype);
        return 0;
    }
#pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++)
        if (slots[t] >= 0)
            store_kv_token(k, k_stride, v, v_stride, t, Hkv, D, dtype, slots[t], k_cache, v_cache,
                           k_scales, v_scales, kv_dtype);
    return 0;
}

/* ---- argmax of each row (the sampler's greedy pick): 16 lanes of a GCC vector type at every ISA
 * level. The largest value's first index; a row holding a NaN: its first NaN's index (NaN ranks
 * above everything, as in torch's max). -0 and +0 are equal: the first of them. */
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef uint16_t vh16 __attribute__((vector_size(32)));

static inline v16 load16(const void *x, long i, int dtype) {
    if (dtype == 0) {
        v16 v;
        memcpy(&v, (const float *)x + i, sizeof v);
        return v;
    }
    vh16 h;
    memcpy(&h, (const uint16_t *)x + i, sizeof h);
    return (v16)(__builtin_convertvector(h, vi16) << 16);
}

static long argmax_row(const void *x, long off, int n, int dtype) {
    const int n16 = n / 16 * 16;
    const vi16 lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    /* per lane: the largest value and its first index, the first NaN's index (n: none) */
    v16 m = (v16){} - INFINITY;
    vi16 at = lanes, nan_at = (vi16){} + n;
    for (int i = 0; i < n16; i += 16) {
        const v16 v = load16(x, off + i, dtype);
        const vi16 idx = lanes + i, gt = v > m, first_nan = (v != v) & (nan_at == n);
        m = (v16)(((vi16)v & gt) | ((vi16)m & ~gt));
        at = (idx & gt) | (at & ~gt);
        nan_at = (idx & first_nan) | (nan_at & ~first_nan);
    }
    float best = -INFINITY;
    long best_at = n, first_nan = n;
    for (int c = 0; c < 16 && n16; c++) {
        if (nan_at[c] < first_nan) first_nan = nan_at[c];
        if (m[c] > best || (m[c] == best && at[c] < best_at)) best = m[c], best_at = at[c];
    }
    for (int i = n16; i < n; i++) {
        const float v = dtype == 0 ? ((const float *)x)[off + i]
                                   : bf16_to_f32(((const uint16_t *)x)[off + i]);
        if (v != v && first_nan == n) first_nan = i;
        if (v > best || best_at == n) best = v, best_at = i;
    }
    return first_nan < n ? first_nan : best_at;
}

/* out[r] = argmax_row of row r of x [rows, n] (row stride in elements). */
int argmax_rows(const void *x, long stride, int rows, int n, int dtype, int64_t *out) {
    if (n <= 0) return 1;
    if (rows < 2 || (long)rows * n < PARALLEL_MIN) {
        for (int r = 0; r < rows; r++) out[r] = argmax_row(x, (long)r * stride, n, dtype);
        return 0;
    }
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) out[r] = argmax_row(x, (long)r * stride, n, dtype);
    return 0;
}
