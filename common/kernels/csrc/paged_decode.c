/* Paged decode attention for the CPU path: one query token per sequence, read straight from the
 * block table (no gathered copy of the KV cache), float32 accumulation, OpenMP over
 * (sequence, kv head) pairs, and over token ranges of them when the pairs are too few for the
 * threads (see paged_decode), or in AVX-512 builds, for a step of enough sequences, over whole
 * sequences, each walking its cache rows once for all its kv heads (paged_decode_whole);
 * hand-vectorised with AVX2 for 1-4 query heads per kv head and head dims 64 and 128
 * (attend_part_avx2; attend_part_avx512 in AVX-512 builds). Compiled on first use by
 * common/cpu_attention.py. The work's cut is planned before the threads start (plan_make), so
 * decode_layer.c's team can share one plan over a step's layers (paged_decode_part).
 *
 * Layouts: q [B, H, D] with row stride q_stride (elements); k_cache, v_cache [N, bs, Hkv, D];
 * block_tables [B, max_blocks] int32; seq_lens [B] int32; out [B, H, D] contiguous.
 * dtype: 0 = float32, 1 = bfloat16. The cache may instead be 8-bit (paged_decode_kv, kv_dtype
 * 2 = int8, 3 = float8 e4m3) with float32 scales k_scales, v_scales [N, bs, Hkv], one per (token,
 * kv head): a row is dequantized in registers as value * scale (K's scale folded into the score,
 * V's into the softmax weight), never written back as floats. kv_dtype 4 = float16 (no scales):
 * a float16 cache beside bfloat16 or float32 activations, converted in registers (F16C).
 * AVX-512 BF16 builds read a bfloat16 cache with bfloat16 q their own way (kvq 3: the scores by
 * dpbf16 on the stored pairs, V converted 32 values a load; measured on an AVX-512 + AMX Xeon,
 * one thread, one layer of 64 x 320 tokens: 19.7 -> 18.0 ns a (token, kv head), 4 x 320: 14.9
 * -> 13.0; in a whole decode step, where the cache comes from memory, 5-10% of its attention).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vecmath.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define GROUP_ROWS 8 /* rows of one sequence attended together (attend_group_avx512) */

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int32_t *block_tables, *seq_lens;
    void *out;
    int B, H, Hkv, D, bs, max_blocks, dtype;
    long q_stride;
    float scale;
    int kv_dtype; /* dtype for a cache of q's dtype, 2 = int8, 3 = fp8 e4m3, 4 = float16 */
    const float *k_scales, *v_scales; /* 8-bit caches only */
} Job;

/* float8 e4m3 (fn: no infinities, 0x7f/0xff NaN) -> float32, by table: 1 KiB, built at load. */
static float fp8_table[256];

__attribute__((constructor)) static void build_fp8_table(void) {
    for (int x = 0; x < 256; x++) {
        const int e = (x >> 3) & 15, m = x & 7;
        /* normal: (8 + m) * 2^(e - 10); subnormal (e = 0): m * 2^-9 */
        float v = e ? (float)(8 + m) : (float)m;
        for (int p = e ? e - 10 : -9; p < 0; p++) v *= 0.5f;
        for (int p = e ? e - 10 : -9; p > 0; p--) v *= 2.f;
        if (e == 15 && m == 7) v = NAN;
        fp8_table[x] = x & 0x80 ? -v : v;
    }
}

static inline void load_row(const void *restrict base, long idx, int D, int dtype,
                            float *restrict dst) {
    if (dtype == 0) {
        memcpy(dst, (const float *)base + idx, sizeof(float) * D);
    } else {
        const uint16_t *restrict src = (const uint16_t *)base + idx;
        for (int d = 0; d < D; d++) dst[d] = bf16_to_f32(src[d]);
    }
}

/* K or V row `row` (= token slot * Hkv + kv head) of a cache as floats, dequantized when 8-bit. */
static inline void load_kv(const void *restrict base, const float *restrict scales, long row,
                           int D, int kv_dtype, float *restrict dst) {
    if (kv_dtype < 2) {
        load_row(base, row * D, D, kv_dtype, dst);
        return;
    }
    if (kv_dtype == 4) {
        const uint16_t *restrict src = (const uint16_t *)base + row * D;
        for (int d = 0; d < D; d++) dst[d] = f16_to_f32(src[d]);
        return;
    }
    const float s = scales[row];
    const uint8_t *restrict src = (const uint8_t *)base + row * D;
    if (kv_dtype == 2) {
        for (int d = 0; d < D; d++) dst[d] = (float)(int8_t)src[d] * s;
    } else {
        for (int d = 0; d < D; d++) dst[d] = fp8_table[src[d]] * s;
    }
}

/* out rows of (sequence b, kv head h)'s G query heads: acc / l. */
static void write_out(const Job *j, int b, int h, const float *acc, const float *l) {
    const int G = j->H / j->Hkv, D = j->D;
    for (int g = 0; g < G; g++) {
        const long o = ((long)b * j->H + h * G + g) * D;
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        if (j->dtype == 0) {
            for (int d = 0; d < D; d++) ((float *)j->out)[o + d] = acc[g * D + d] * inv;
        } else {
            for (int d = 0; d < D; d++)
                ((uint16_t *)j->out)[o + d] = f32_to_bf16(acc[g * D + d] * inv);
        }
    }
}

/* Each of G rows of n scores in place -> exp(score - the row's max); m[g] = that max, l[g] = the
 * sum of the row's exps (the part's share of a flash-decoding softmax). */
static inline void softmax_parts(float *restrict scores, int G, int n, float *restrict m,
                                 float *restrict l) {
    for (int g = 0; g < G; g++) {
        float *restrict sg = scores + g * n;
        float mx = -INFINITY;
        for (int t = 0; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;
        float sum = 0.f;
        for (int t = 0; t < n; t++) {
            sg[t] = exp_approx(sg[t] - mx);
            sum += sg[t];
        }
        m[g] = mx;
        l[g] = sum;
    }
}

/* Attention of one (sequence, kv head) over its tokens [t0, t1): for each of its G query heads
 * the scores' maximum m[g], the sum of exp(score - m[g]) l[g] and the unnormalised weighted sum
 * of V acc[g*D..]. Tokens are walked block by block (no division per token). D is a
 * compile-time constant in the specialised copies below, so the inner loops vectorise fully. */
static inline void attend_part(const Job *j, int b, int h, int t0, int t1, const int D,
                               float *restrict scores, float *restrict qf, float *restrict acc,
                               float *restrict m, float *restrict l, float *restrict row) {
    const int G = j->H / j->Hkv, bs = j->bs, Hkv = j->Hkv, n = t1 - t0;
    const int32_t *table = j->block_tables + (long)b * j->max_blocks;
    for (int g = 0; g < G; g++)
        load_row(j->q, b * j->q_stride + (long)(h * G + g) * D, D, j->dtype, qf + g * D);
    for (int t = t0; t < t1;) {
        const int off = t % bs, run = bs - off < t1 - t ? bs - off : t1 - t;
        const long base = (long)table[t / bs] * bs + off;
        for (int i = 0; i < run; i++) {
            load_kv(j->k_cache, j->k_scales, (base + i) * Hkv + h, D, j->kv_dtype, row);
            for (int g = 0; g < G; g++) {
                const float *restrict qg = qf + g * D;
                float s = 0.f;
                for (int d = 0; d < D; d++) s += qg[d] * row[d];
                scores[g * n + (t - t0) + i] = s * j->scale;
            }
        }
        t += run;
    }
    softmax_parts(scores, G, n, m, l);
    memset(acc, 0, sizeof(float) * G * D);
    for (int t = t0; t < t1;) {
        const int off = t % bs, run = bs - off < t1 - t ? bs - off : t1 - t;
        const long base = (long)table[t / bs] * bs + off;
        for (int i = 0; i < run; i++) {
            load_kv(j->v_cache, j->v_scales, (base + i) * Hkv + h, D, j->kv_dtype, row);
            for (int g = 0; g < G; g++) {
                const float p = scores[g * n + (t - t0) + i];
                float *restrict ag = acc + g * D;
                for (int d = 0; d < D; d++) ag[d] += p * row[d];
            }
        }
        t += run;
    }
}

#ifdef __AVX2__
/* ---- AVX2, G = 1..4 query heads per kv head, D a multiple of 32: the same part, vectorised by
 * hand. Scores go 4 tokens at a time with the 4 x G dot products in registers and one
 * horizontal reduction per 4 scores (instead of one per score); V is accumulated in tiles of 32
 * of D with the G x 4 accumulators in registers. Same float32 arithmetic, another summation
 * order. */
#include <immintrin.h>

static inline __m256 load8(const void *base, long idx, int dtype) {
    if (dtype == 0) return _mm256_loadu_ps((const float *)base + idx);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + idx));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* 8 values of a float16 cache at element idx as floats (F16C: the AVX2 level builds with it) */
static inline __m256 load8_h(const void *base, long idx) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + idx)));
}

/* 8 values of an 8-bit cache at element idx as floats, not yet scaled: kvq 2 = int8, 3 = fp8 */
static inline __m256 load8_q(const void *base, long idx, int kvq) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)((const int8_t *)base + idx));
    if (kvq == 2) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    return _mm256_i32gather_ps(fp8_table, _mm256_cvtepu8_epi32(b), 4);
}

/* the 4 sums of a0..a3's lanes, as one vector */
static inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* every token's cache row (slot * Hkv + h) of part [t0, t1), walked block by block once: the
 * vectorised parts index it instead of dividing by the block size per token (two integer
 * divisions a token were a third of the AVX2 part's time at 256 tokens) */
static inline void part_rows(const Job *j, int b, int h, int t0, int t1, long *restrict srow) {
    const int bs = j->bs, Hkv = j->Hkv;
    const int32_t *table = j->block_tables + (long)b * j->max_blocks;
    for (int t = t0; t < t1;) {
        const int off = t % bs, run = bs - off < t1 - t ? bs - off : t1 - t;
        long row = ((long)table[t / bs] * bs + off) * Hkv + h; /* a token on: Hkv rows on */
        for (int i = 0; i < run; i++, row += Hkv) srow[t - t0 + i] = row; /* no 64-bit vpmullq */
        t += run;
    }
}

#define PREFETCH_AHEAD 16 /* tokens: see attend_part_avx2 */

/* the K and V rows of cache row `slot_row` (token slot * Hkv + kv head), asked for into L2,
 * with their scales for an 8-bit cache: left to the loops, a scale line (about 5 tokens' worth
 * of one kv head) was a miss to memory every few tokens (harness, 64 sequences x ~320 tokens,
 * int8, 30 layers from memory, 2 threads: 28.1-28.9 -> 24.2-24.5 ms) */
static inline void prefetch_kv(const Job *j, long slot_row, size_t esize) {
    const long off = slot_row * j->D;
    const size_t row_bytes = (size_t)j->D * esize;
    for (size_t c = 0; c < row_bytes; c += 64) {
        _mm_prefetch((const char *)j->k_cache + off * esize + c, _MM_HINT_T1);
        _mm_prefetch((const char *)j->v_cache + off * esize + c, _MM_HINT_T1);
    }
    if (j->k_scales != NULL) {
        _mm_prefetch((const char *)(j->k_scales + slot_row), _MM_HINT_T1);
        _mm_prefetch((const char *)(j->v_scales + slot_row), _MM_HINT_T1);
    }
}

static inline float hmax4(__m128 v) {
    v = _mm_max_ps(v, _mm_movehl_ps(v, v));
    v = _mm_max_ss(v, _mm_shuffle_ps(v, v, 1));
    return _mm_cvtss_f32(v);
}

/* A vectorised part's start: its cache rows (part_rows), the K/V rows of its first
 * PREFETCH_AHEAD tokens asked for, q's G heads of kv head h as floats in qf. Returns the bytes of
 * one cache element. Ask for K and V rows ahead of the loops: in a decode step the weights
 * streamed since the last layer have evicted the cache, and many misses in flight at once cost
 * far less than one at a time as the loops reach them (41 -> 23 us a layer at 256 tokens). The
 * first PREFETCH_AHEAD tokens' rows now, the rest from inside the score loop (block_rows),
 * PREFETCH_AHEAD tokens ahead of it: asking for a whole part's rows at once stalled on the full
 * fill buffers (a fifth of a batch-64 step's attention). V is not read until the score loop
 * ends, so its rows are asked for at the same distance. */
static inline __attribute__((always_inline)) size_t part_start(const Job *j, int b, int h,
                                                               int t0, int t1, int G, int D,
                                                               int kvq, long *restrict srow,
                                                               float *restrict qf) {
    part_rows(j, b, h, t0, t1, srow);
    const size_t esize = kvq == 1 ? 1 : kvq == 2 ? 2 : j->dtype == 0 ? 4 : 2;
    const int ahead = t0 + PREFETCH_AHEAD < t1 ? t0 + PREFETCH_AHEAD : t1;
    for (int tt = t0; tt < ahead; tt++) prefetch_kv(j, srow[tt - t0], esize);
    for (int g = 0; g < G; g++)
        load_row(j->q, b * j->q_stride + (long)(h * G + g) * D, D, j->dtype, qf + g * D);
    return esize;
}

/* The score loop's 4 tokens from t (count of them real; a short tail repeats its first token):
 * their K/V rows' element offsets, K's scale times the softmax scale for an 8-bit cache, and the
 * rows PREFETCH_AHEAD tokens on asked for. */
static inline __attribute__((always_inline)) void block_rows(const Job *j,
                                                             const long *restrict srow, int t,
                                                             int t0, int t1, int count, int D,
                                                             int kvq, size_t esize, long *rows,
                                                             float *kscale) {
    for (int i = 0; i < 4; i++) {
        const long slot_row = srow[t + (i < count ? i : 0) - t0];
        rows[i] = slot_row * D;
        if (kvq == 1) kscale[i] = j->k_scales[slot_row] * j->scale;
    }
    for (int i = 0; i < count; i++)
        if (t + i + PREFETCH_AHEAD < t1) prefetch_kv(j, srow[t + i + PREFETCH_AHEAD - t0], esize);
}

/* 4 scores s of one query head: the first count stored at dst, all in the running maximum mx
 * (a short tail's repeats change no maximum) */
static inline void keep_scores(__m128 s, __m128 *mx, float *restrict dst, int count) {
    *mx = _mm_max_ps(*mx, s);
    if (count == 4) { /* one store (the copy below was 8 moves, a tenth of a part's time) */
        _mm_storeu_ps(dst, s);
        return;
    }
    float s4[4];
    _mm_storeu_ps(s4, s);
    for (int i = 0; i < count; i++) dst[i] = s4[i];
}

/* exp_approx (vecmath.h) on 8 lanes: the same steps */
static inline __m256 exp8(__m256 x) {
    /* the constants first: (v)maxps and minps return their second operand where one is NaN, so
     * a NaN score stays NaN (its weight, its row's sum and its output then NaN, as torch's) */
    x = _mm256_min_ps(_mm256_set1_ps(88.72283f), _mm256_max_ps(_mm256_set1_ps(-87.33654f), x));
    const __m256 n = _mm256_floor_ps(
        _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* softmax_parts with each row's maximum m[g] given: 8 exps at a time, 8 partial sums */
static inline void softmax_exp_avx2(float *restrict scores, int G, int n, const float *m,
                                    float *restrict l) {
    for (int g = 0; g < G; g++) {
        float *restrict sg = scores + g * n;
        const __m256 mx = _mm256_set1_ps(m[g]);
        __m256 sum8 = _mm256_setzero_ps();
        int t = 0;
        for (; t + 8 <= n; t += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), mx));
            _mm256_storeu_ps(sg + t, e);
            sum8 = _mm256_add_ps(sum8, e);
        }
        const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(sum8), _mm256_extractf128_ps(sum8, 1));
        const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
        float sum = _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
        for (; t < n; t++) {
            sg[t] = exp_approx(sg[t] - m[g]);
            sum += sg[t];
        }
        l[g] = sum;
    }
}

/* kvq: 0 for a cache of q's dtype, 1 for an 8-bit one, 2 for float16 (a constant in every copy;
 * int8 or fp8 is told apart per load, one well-predicted branch, to keep the copies few); 3 (the
 * AVX-512 parts only, with BF16): bfloat16 cache and q, see PAIRED */
static inline __attribute__((always_inline)) void attend_part_avx2(
    const Job *j, int b, int h, int t0, int t1, const int G, const int D, const int kvq,
    float *restrict scores, float *restrict qf, float *restrict acc, float *restrict m,
    float *restrict l, long *restrict srow) {
    const int n = t1 - t0, dtype = j->dtype;
    const size_t esize = part_start(j, b, h, t0, t1, G, D, kvq, srow, qf);
    /* element offsets of each token's K/V row of this kv head */
    long rows[4];
    float kscale[4] = {1.f, 1.f, 1.f, 1.f};
    __m128 mx4[4];
    for (int g = 0; g < G; g++) mx4[g] = _mm_set1_ps(-INFINITY);
    int t = t0;
    while (t < t1) {
        const int count = t1 - t < 4 ? t1 - t : 4;
        block_rows(j, srow, t, t0, t1, count, D, kvq, esize, rows, kscale);
        __m256 a[4][4];
        for (int g = 0; g < G; g++)
            for (int i = 0; i < 4; i++) a[g][i] = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8) {
            for (int i = 0; i < 4; i++) {
                const __m256 k = kvq == 1 ? load8_q(j->k_cache, rows[i] + d, j->kv_dtype)
                                 : kvq == 2 ? load8_h(j->k_cache, rows[i] + d)
                                            : load8(j->k_cache, rows[i] + d, dtype);
                for (int g = 0; g < G; g++)
                    a[g][i] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * D + d), k, a[g][i]);
            }
        }
        const __m128 sc = kvq == 1 ? _mm_loadu_ps(kscale) : _mm_set1_ps(j->scale);
        for (int g = 0; g < G; g++)
            keep_scores(_mm_mul_ps(reduce4(a[g][0], a[g][1], a[g][2], a[g][3]), sc), &mx4[g],
                        scores + g * n + (t - t0), count);
        t += count;
    }
    for (int g = 0; g < G; g++) m[g] = hmax4(mx4[g]);
    softmax_exp_avx2(scores, G, n, m, l);
    for (int d0 = 0; d0 < D; d0 += 32) {
        __m256 v_acc[4][4];
        for (int g = 0; g < G; g++)
            for (int i = 0; i < 4; i++) v_acc[g][i] = _mm256_setzero_ps();
        for (int idx = 0; idx < n; idx++) {
            const long row = srow[idx] * D + d0;
            const float vs = kvq == 1 ? j->v_scales[srow[idx]] : 1.f;
            for (int i = 0; i < 4; i++) {
                const __m256 v = kvq == 1 ? load8_q(j->v_cache, row + 8 * i, j->kv_dtype)
                                 : kvq == 2 ? load8_h(j->v_cache, row + 8 * i)
                                            : load8(j->v_cache, row + 8 * i, dtype);
                for (int g = 0; g < G; g++) {
                    const __m256 p = kvq == 1 ? _mm256_set1_ps(scores[g * n + idx] * vs)
                                         : _mm256_broadcast_ss(scores + g * n + idx);
                    v_acc[g][i] = _mm256_fmadd_ps(p, v, v_acc[g][i]);
                }
            }
        }
        for (int g = 0; g < G; g++)
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(acc + g * D + d0 + 8 * i, v_acc[g][i]);
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* ---- AVX-512, G = 1..4, D 64 or 128: attend_part_avx2's steps on 16 lanes. A K or V row is
 * D / 16 vectors (half the loads, conversions and FMAs of 8 lanes), the 4 x G score sums are
 * reduced by a 4-way transpose (one horizontal reduction per 4 scores), and with D = 64 a whole
 * V row is one tile: the tokens are walked once, not D / 32 times. Same float32 arithmetic,
 * another summation order than the AVX2 part's (each row's result still depends on that row
 * alone: a row's bits do not change with the batch beside it). */

static inline __m512 load16(const void *base, long idx, int dtype) {
    if (dtype == 0) return _mm512_loadu_ps((const float *)base + idx);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + idx));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 load16_h(const void *base, long idx) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + idx)));
}

/* 16 values of an 8-bit cache, not yet scaled: kvq 2 = int8, 3 = fp8 e4m3 */
static inline __m512 load16_q(const void *base, long idx, int kvq) {
    const __m128i b = _mm_loadu_si128((const __m128i *)((const int8_t *)base + idx));
    if (kvq == 2) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    return _mm512_i32gather_ps(_mm512_cvtepu8_epi32(b), fp8_table, 4);
}

/* the 4 sums of a0..a3's 16 lanes, as one vector */
static inline __m128 reduce4_16(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 x01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 x23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    /* per 128-bit lane: [a0 a1 a0 a1] + ... -> [a0 a1 a2 a3] */
    const __m512 y = _mm512_add_ps(_mm512_shuffle_ps(x01, x23, 0x44),
                                   _mm512_shuffle_ps(x01, x23, 0xEE));
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(y), 1));
    const __m256 z = _mm256_add_ps(_mm512_castps512_ps256(y), hi);
    return _mm_add_ps(_mm256_castps256_ps128(z), _mm256_extractf128_ps(z, 1));
}

/* 32 bfloat16 at base + idx as they are, in a float vector's register */
static inline __m512 load32_raw(const void *base, long idx) {
    return _mm512_castsi512_ps(_mm512_loadu_si512((const uint16_t *)base + idx));
}

#if defined(__AVX512BF16__)
/* kvq 3: a bfloat16 cache read by a bfloat16 q (AVX-512 BF16). Scores: dpbf16 multiplies 32
 * pairs of q and K as they are stored and sums each pair into a float32 lane (the products are
 * exact; only the sums round, as the FMAs' do, in another order), with no conversion of K. V:
 * 32 values a load, made float32 (exactly) by interleaving zero halves below them, one
 * instruction per 16 (instead of two): `split32`'s lanes hold them in a fixed order of its own,
 * which `unsplit32` undoes when the sums are stored. */
#define PAIRED 1
static inline void split32(const void *base, long idx, __m512 *lo, __m512 *hi) {
    const __m512i raw = _mm512_loadu_si512((const uint16_t *)base + idx);
    const __m512i z = _mm512_setzero_si512();
    *lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, raw)); /* lane l: values 8l .. 8l+3 */
    *hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, raw)); /* lane l: values 8l+4 .. 8l+7 */
}
/* split32's two vectors back in order: 32 floats to dst */
static inline void unsplit32(__m512 lo, __m512 hi, float *dst) {
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second =
        _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    _mm512_storeu_ps(dst, _mm512_permutex2var_ps(lo, first, hi));
    _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(lo, second, hi));
}
static inline __m512 dot_pairs(__m512 acc, const void *q, long qi, const void *k, long ki) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const uint16_t *)q + qi),
                            (__m512bh)_mm512_loadu_si512((const uint16_t *)k + ki));
}
#endif

/* 64 values of a V row from element `row`, as floats (kvq 1: not yet scaled; kvq 3: in
 * split32's order) */
static inline __attribute__((always_inline)) void load_v64(const Job *j, long row, const int kvq,
                                                           __m512 *v) {
#ifdef PAIRED
    if (kvq == 3) {
        split32(j->v_cache, row, &v[0], &v[1]);
        split32(j->v_cache, row + 32, &v[2], &v[3]);
        return;
    }
#endif
    for (int i = 0; i < 4; i++)
        v[i] = kvq == 1 ? load16_q(j->v_cache, row + 16 * i, j->kv_dtype)
               : kvq == 2 ? load16_h(j->v_cache, row + 16 * i)
                          : load16(j->v_cache, row + 16 * i, j->dtype);
}

/* The V sums of nr (1 or 2) rows of one sequence (their scores nr x [G * most] from sc, tokens
 * up to t1s[r]; acc nr x [G * D]), D (64 or 128) in tiles of 64: each V row loaded once for the
 * rows, one accumulator per (row, head, 16 of D) summing over the tokens in order, so a row's
 * sums do not depend on the row beside it. */
static inline __attribute__((always_inline)) void group_values(
    const Job *j, const long *restrict srow, const int nr, const float *restrict sc, int most,
    const int *t1s, int t0, float *restrict acc, const int G, const int D, const int kvq) {
    const int n_last = t1s[nr - 1] - t0;
    int n[2];
    for (int r = 0; r < nr; r++) n[r] = t1s[r] - t0;
    for (int d0 = 0; d0 < D; d0 += 64) {
        __m512 v_acc[2][4][4];
        for (int r = 0; r < nr; r++)
            for (int g = 0; g < G; g++)
                for (int i = 0; i < 4; i++) v_acc[r][g][i] = _mm512_setzero_ps();
        for (int idx = 0; idx < n_last; idx++) {
            const long row = srow[idx] * D + d0;
            const float vs = kvq == 1 ? j->v_scales[srow[idx]] : 1.f;
            __m512 v[4];
            load_v64(j, row, kvq, v);
            for (int r = 0; r < nr; r++) {
                if (idx >= n[r]) continue;
                const float *sr = sc + (size_t)r * G * most;
                for (int g = 0; g < G; g++) {
                    const __m512 p = _mm512_set1_ps(kvq == 1 ? sr[g * n[r] + idx] * vs
                                                        : sr[g * n[r] + idx]);
                    for (int i = 0; i < 4; i++)
                        v_acc[r][g][i] = _mm512_fmadd_ps(p, v[i], v_acc[r][g][i]);
                }
            }
        }
        for (int r = 0; r < nr; r++)
            for (int g = 0; g < G; g++) {
                float *dst = acc + ((size_t)r * G + g) * D + d0;
#ifdef PAIRED
                if (kvq == 3) {
                    unsplit32(v_acc[r][g][0], v_acc[r][g][1], dst);
                    unsplit32(v_acc[r][g][2], v_acc[r][g][3], dst + 32);
                    continue;
                }
#endif
                for (int i = 0; i < 4; i++) _mm512_storeu_ps(dst + 16 * i, v_acc[r][g][i]);
            }
    }
}

/* 4 tokens' scores (count of them real) against one kv head's G query heads: K rows at element
 * offsets rows[i], q as floats in qf or (kvq 3) as stored from element q0; each scaled by sc's
 * lane, kept (keep_scores) at scores + g * n, into the running maxima mx4[g]. The same steps for
 * a (sequence, kv head) part and for a whole sequence's part (attend_seq_avx512). */
static inline __attribute__((always_inline)) void score4(const Job *j, const long *rows,
                                                         const int G, const int D, const int kvq,
                                                         const float *restrict qf, long q0,
                                                         __m128 sc, __m128 *mx4,
                                                         float *restrict scores, int n,
                                                         int count) {
    __m512 a[4][4];
    for (int g = 0; g < G; g++)
        for (int i = 0; i < 4; i++) a[g][i] = _mm512_setzero_ps();
#ifdef PAIRED
    if (kvq == 3) {
        for (int d = 0; d < D; d += 32)
            for (int i = 0; i < 4; i++)
                for (int g = 0; g < G; g++)
                    a[g][i] = dot_pairs(a[g][i], j->q, q0 + g * D + d, j->k_cache, rows[i] + d);
    } else
#endif
        for (int d = 0; d < D; d += 16) {
            for (int i = 0; i < 4; i++) {
                const __m512 k = kvq == 1 ? load16_q(j->k_cache, rows[i] + d, j->kv_dtype)
                                 : kvq == 2 ? load16_h(j->k_cache, rows[i] + d)
                                            : load16(j->k_cache, rows[i] + d, j->dtype);
                for (int g = 0; g < G; g++)
                    a[g][i] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * D + d), k, a[g][i]);
            }
        }
    (void)q0;
    for (int g = 0; g < G; g++)
        keep_scores(_mm_mul_ps(reduce4_16(a[g][0], a[g][1], a[g][2], a[g][3]), sc), &mx4[g],
                    scores + g * n, count);
}

static inline __attribute__((always_inline)) void attend_part_avx512(
    const Job *j, int b, int h, int t0, int t1, const int G, const int D, const int kvq,
    float *restrict scores, float *restrict qf, float *restrict acc, float *restrict m,
    float *restrict l, long *restrict srow) {
    const int n = t1 - t0;
    const size_t esize = part_start(j, b, h, t0, t1, G, D, kvq, srow, qf);
    long rows[4];
    float kscale[4] = {1.f, 1.f, 1.f, 1.f};
    __m128 mx4[4];
    for (int g = 0; g < G; g++) mx4[g] = _mm_set1_ps(-INFINITY);
    int t = t0;
    while (t < t1) {
        const int count = t1 - t < 4 ? t1 - t : 4;
        block_rows(j, srow, t, t0, t1, count, D, kvq, esize, rows, kscale);
        const __m128 sc = kvq == 1 ? _mm_loadu_ps(kscale) : _mm_set1_ps(j->scale);
        score4(j, rows, G, D, kvq, qf, b * j->q_stride + (long)h * G * D, sc, mx4,
               scores + (t - t0), n, count);
        t += count;
    }
    for (int g = 0; g < G; g++) m[g] = hmax4(mx4[g]);
    softmax_exp_avx2(scores, G, n, m, l);
    group_values(j, srow, 1, scores, n, &t1, t0, acc, G, D, kvq);
}

/* Rows b0..b0+R-1 (R <= GROUP_ROWS) of one sequence (a verify step's, or a short prefill's:
 * the same block table, lengths one apart), kv head h, D = 64: each row's tokens [t0, t1s[r])
 * (t1s increasing). Each 4 tokens' K rows are loaded (and converted) once into registers and
 * serve every row's G heads; each row's softmax and V sum are as attend_part_avx512's. Per
 * (row, head) the same operations in the same order as that row alone there: for a row whose
 * last 4 tokens are fewer than the longest row's, the lanes past its tokens take its first
 * lane's score, which is what the repeated token gives alone. So the bits do not change.
 * scores [R][G * (t1s[R-1] - t0)], qf and acc [R][G * 64], m and l [R][G]. */
static inline __attribute__((always_inline)) void attend_group_avx512(
    const Job *j, int b0, int R, int h, int t0, const int *t1s, const int G, const int kvq,
    float *restrict scores, float *restrict qf, float *restrict acc, float *restrict m,
    float *restrict l, long *restrict srow) {
    const int D = 64, dtype = j->dtype, t1 = t1s[R - 1], most = t1 - t0;
    const size_t esize = part_start(j, b0 + R - 1, h, t0, t1, G, D, kvq, srow,
                                    qf + (size_t)(R - 1) * G * D);
    for (int r = 0; r < R - 1; r++)
        for (int g = 0; g < G; g++)
            load_row(j->q, (b0 + r) * j->q_stride + (long)(h * G + g) * D, D, dtype,
                     qf + ((size_t)r * G + g) * D);
    long rows[4];
    float kscale[4] = {1.f, 1.f, 1.f, 1.f};
    __m128 mx4[GROUP_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) mx4[r][g] = _mm_set1_ps(-INFINITY);
    int t = t0;
    while (t < t1) {
        const int count = t1 - t < 4 ? t1 - t : 4;
        block_rows(j, srow, t, t0, t1, count, D, kvq, esize, rows, kscale);
        __m512 k[4][4]; /* [token][16 of D]; kvq 3: [token][32 of D, as stored], two of them */
        for (int d = 0; d < (kvq == 3 ? 2 : 4); d++)
            for (int i = 0; i < 4; i++)
                k[i][d] = kvq == 3   ? load32_raw(j->k_cache, rows[i] + 32 * d)
                          : kvq == 1 ? load16_q(j->k_cache, rows[i] + 16 * d, j->kv_dtype)
                          : kvq == 2 ? load16_h(j->k_cache, rows[i] + 16 * d)
                                     : load16(j->k_cache, rows[i] + 16 * d, dtype);
        const __m128 sc = kvq == 1 ? _mm_loadu_ps(kscale) : _mm_set1_ps(j->scale);
        for (int r = 0; r < R; r++) {
            const int left = t1s[r] - t, n = t1s[r] - t0;
            if (left <= 0) continue;
            const int cnt = left < 4 ? left : 4;
            const __mmask8 past = (__mmask8)(0xF & ~((1 << cnt) - 1));
            for (int g = 0; g < G; g++) {
                const float *qg = qf + ((size_t)r * G + g) * D;
                __m512 a[4];
                for (int i = 0; i < 4; i++) a[i] = _mm512_setzero_ps();
#ifdef PAIRED
                if (kvq == 3) {
                    const long q0 = (b0 + r) * j->q_stride + (long)(h * G + g) * D;
                    for (int d = 0; d < 2; d++) {
                        const __m512bh qv = (__m512bh)_mm512_loadu_si512(
                            (const uint16_t *)j->q + q0 + 32 * d);
                        for (int i = 0; i < 4; i++)
                            a[i] = _mm512_dpbf16_ps(a[i], qv,
                                                    (__m512bh)_mm512_castps_si512(k[i][d]));
                    }
                } else
#endif
                    for (int d = 0; d < 4; d++) {
                        const __m512 qv = _mm512_loadu_ps(qg + 16 * d);
                        for (int i = 0; i < 4; i++) a[i] = _mm512_fmadd_ps(qv, k[i][d], a[i]);
                    }
                __m128 sv = _mm_mul_ps(reduce4_16(a[0], a[1], a[2], a[3]), sc);
                if (past) sv = _mm_mask_mov_ps(sv, past, _mm_permute_ps(sv, 0));
                keep_scores(sv, &mx4[r][g], scores + (size_t)r * G * most + g * n + (t - t0),
                            cnt);
            }
        }
        t += count;
    }
    for (int r = 0; r < R; r++) {
        float *mr = m + r * G;
        for (int g = 0; g < G; g++) mr[g] = hmax4(mx4[r][g]);
        softmax_exp_avx2(scores + (size_t)r * G * most, G, t1s[r] - t0, mr, l + r * G);
    }
    /* V: two rows at a time where their 2 x G x 4 accumulators fit the registers (G <= 3) */
    int r = 0;
    if (G <= 3)
        for (; r + 1 < R; r += 2)
            group_values(j, srow, 2, scores + (size_t)r * G * most, most, t1s + r, t0,
                         acc + (size_t)r * G * D, G, D, kvq);
    for (; r < R; r++)
        group_values(j, srow, 1, scores + (size_t)r * G * most, most, t1s + r, t0,
                     acc + (size_t)r * G * D, G, D, kvq);
}

/* A whole sequence's part: every kv head of row b over tokens [t0, t1) (Hkv <= SEQ_MAX_HKV), in
 * one walk over its cache rows instead of one walk per kv head. Each token's K (and V) rows of
 * all its kv heads lie side by side (Hkv * D elements), so a walk reads them whole where a kv
 * head's walk reads one in Hkv of them and leaves the rest to the next walk: measured on this
 * layout (64 sequences x 320 tokens, 3 kv heads, 30 layers from memory, 2 threads), plain reads
 * in the per-head order ran at 15-18.5 GB/s, in this one at 20.6-22.4. Per kv head the same
 * steps in the same order as attend_part_avx512's (score4 per 4 tokens, its softmax, each V
 * accumulator summed over the tokens in order; the V accumulators of every kv head do not fit
 * the registers, so they go to acc between chunks of SEQ_VCHUNK tokens), so the bits are a
 * part's. scores [Hkv][G * n], qf, acc and raw [Hkv][G * D], m and l [Hkv][G]. */
#define SEQ_MAX_HKV 8
#define SEQ_VCHUNK 16
/* tokens whose rows are asked for ahead of the score loop (64 x 320 tokens, 30 layers from
 * memory: 4, 8, 16 and 32 all within noise) */
#define SEQ_AHEAD 16
#define SEQ_MIN_UNITS 4 /* whole sequences per thread, at least */
static inline __attribute__((always_inline)) void attend_seq_avx512(
    const Job *j, int b, int t0, int t1, const int G, const int D, const int kvq,
    float *restrict scores, float *restrict qf, float *restrict acc, float *restrict raw,
    float *restrict m, float *restrict l, long *restrict srow) {
    const int n = t1 - t0, Hkv = j->Hkv, H = j->H, dtype = j->dtype;
    part_rows(j, b, 0, t0, t1, srow); /* head 0's rows; head h's are h rows on */
    const size_t esize = kvq == 1 ? 1 : kvq == 2 ? 2 : dtype == 0 ? 4 : 2;
    const size_t row_bytes = (size_t)Hkv * D * esize; /* a token's K (V) rows, all kv heads */
#define SEQ_PREFETCH(tt)                                                                         \
    do {                                                                                         \
        const long sr = srow[(tt) - t0];                                                         \
        const char *kr = (const char *)j->k_cache + sr * D * esize;                              \
        const char *vr = (const char *)j->v_cache + sr * D * esize;                              \
        for (size_t c = 0; c < row_bytes; c += 64) {                                             \
            _mm_prefetch(kr + c, _MM_HINT_T1);                                                   \
            _mm_prefetch(vr + c, _MM_HINT_T1);                                                   \
        }                                                                                        \
        if (j->k_scales != NULL) {                                                               \
            _mm_prefetch((const char *)(j->k_scales + sr), _MM_HINT_T1);                         \
            _mm_prefetch((const char *)(j->v_scales + sr), _MM_HINT_T1);                         \
        }                                                                                        \
    } while (0)
    const int ahead = t0 + SEQ_AHEAD < t1 ? t0 + SEQ_AHEAD : t1;
    for (int tt = t0; tt < ahead; tt++) SEQ_PREFETCH(tt);
    for (int hg = 0; hg < H; hg++)
        load_row(j->q, b * j->q_stride + (long)hg * D, D, dtype, qf + (size_t)hg * D);
    __m128 mx4[SEQ_MAX_HKV][4];
    for (int h = 0; h < Hkv; h++)
        for (int g = 0; g < G; g++) mx4[h][g] = _mm_set1_ps(-INFINITY);
    int t = t0;
    while (t < t1) {
        const int count = t1 - t < 4 ? t1 - t : 4;
        long rows[4];
        for (int i = 0; i < 4; i++) rows[i] = srow[t + (i < count ? i : 0) - t0] * D;
        for (int i = 0; i < count; i++)
            if (t + i + SEQ_AHEAD < t1) SEQ_PREFETCH(t + i + SEQ_AHEAD);
        for (int h = 0; h < Hkv; h++) {
            long hrows[4];
            float kscale[4] = {1.f, 1.f, 1.f, 1.f};
            for (int i = 0; i < 4; i++) {
                hrows[i] = rows[i] + (long)h * D;
                if (kvq == 1) kscale[i] = j->k_scales[rows[i] / D + h] * j->scale;
            }
            const __m128 sc = kvq == 1 ? _mm_loadu_ps(kscale) : _mm_set1_ps(j->scale);
            score4(j, hrows, G, D, kvq, qf + (size_t)h * G * D,
                   b * j->q_stride + (long)h * G * D, sc, mx4[h],
                   scores + (size_t)h * G * n + (t - t0), n, count);
        }
        t += count;
    }
#undef SEQ_PREFETCH
    for (int h = 0; h < Hkv; h++) {
        for (int g = 0; g < G; g++) m[h * G + g] = hmax4(mx4[h][g]);
        softmax_exp_avx2(scores + (size_t)h * G * n, G, n, m + h * G, l + h * G);
    }
    /* V, as group_values for one row: per (kv head, query head, 16 of D) one accumulator over
     * the tokens in order, kept in raw (register order) between chunks */
    for (int d0 = 0; d0 < D; d0 += 64) {
        for (int c0 = 0; c0 < n; c0 += SEQ_VCHUNK) {
            const int c1 = c0 + SEQ_VCHUNK < n ? c0 + SEQ_VCHUNK : n;
            for (int h = 0; h < Hkv; h++) {
                const float *sh = scores + (size_t)h * G * n;
                float *rh = raw + (size_t)h * G * D + d0;
                __m512 v_acc[4][4];
                for (int g = 0; g < G; g++)
                    for (int i = 0; i < 4; i++)
                        v_acc[g][i] = c0 ? _mm512_loadu_ps(rh + (size_t)g * D + 16 * i)
                                         : _mm512_setzero_ps();
                for (int idx = c0; idx < c1; idx++) {
                    const long row = (srow[idx] + h) * D + d0;
                    const float vs = kvq == 1 ? j->v_scales[srow[idx] + h] : 1.f;
                    __m512 v[4];
                    load_v64(j, row, kvq, v);
                    for (int g = 0; g < G; g++) {
                        const __m512 p = _mm512_set1_ps(kvq == 1 ? sh[g * n + idx] * vs
                                                            : sh[g * n + idx]);
                        for (int i = 0; i < 4; i++)
                            v_acc[g][i] = _mm512_fmadd_ps(p, v[i], v_acc[g][i]);
                    }
                }
                for (int g = 0; g < G; g++)
                    for (int i = 0; i < 4; i++)
                        _mm512_storeu_ps(rh + (size_t)g * D + 16 * i, v_acc[g][i]);
            }
        }
        for (int hg = 0; hg < H; hg++) {
            const float *src = raw + (size_t)hg * D + d0;
            float *dst = acc + (size_t)hg * D + d0;
#ifdef PAIRED
            if (kvq == 3) {
                unsplit32(_mm512_loadu_ps(src), _mm512_loadu_ps(src + 16), dst);
                unsplit32(_mm512_loadu_ps(src + 32), _mm512_loadu_ps(src + 48), dst + 32);
                continue;
            }
#endif
            memcpy(dst, src, sizeof(float) * 64);
        }
    }
}
#define GROUPED 1
#endif

/* X(kvq) for this job's cache, kvq as the parts take it: 3 a bfloat16 cache read by bfloat16 q
 * (AVX-512 BF16 builds: PAIRED), 0 a cache of q's dtype, 2 a float16 one, 1 an 8-bit one */
#ifdef PAIRED
#define BY_CACHE(j, X)                                                                           \
    if ((j)->kv_dtype == 1 && (j)->dtype == 1) {                                                 \
        X(3)                                                                                     \
    } else if ((j)->kv_dtype < 2) {                                                              \
        X(0)                                                                                     \
    } else if ((j)->kv_dtype == 4) {                                                             \
        X(2)                                                                                     \
    } else {                                                                                     \
        X(1)                                                                                     \
    }
#else
#define BY_CACHE(j, X)                                                                           \
    if ((j)->kv_dtype < 2) {                                                                     \
        X(0)                                                                                     \
    } else if ((j)->kv_dtype == 4) {                                                             \
        X(2)                                                                                     \
    } else {                                                                                     \
        X(1)                                                                                     \
    }
#endif

static void attend_dispatch(const Job *j, int b, int h, int t0, int t1, float *scores,
                            float *qf, float *acc, float *m, float *l, float *row, long *srow) {
#ifdef __AVX2__
    const int G = j->H / j->Hkv;
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PART(g, d, q) attend_part_avx512(j, b, h, t0, t1, g, d, q, scores, qf, acc, m, l, srow)
#else
#define PART(g, d, q) attend_part_avx2(j, b, h, t0, t1, g, d, q, scores, qf, acc, m, l, srow)
#endif
#define PARTS(q)                                                                                 \
    switch (G * 1000 + j->D) {                                                                   \
    case 1064: PART(1, 64, q); return;                                                           \
    case 2064: PART(2, 64, q); return;                                                           \
    case 3064: PART(3, 64, q); return;                                                           \
    case 4064: PART(4, 64, q); return;                                                           \
    case 1128: PART(1, 128, q); return;                                                          \
    case 2128: PART(2, 128, q); return;                                                          \
    case 3128: PART(3, 128, q); return;                                                          \
    case 4128: PART(4, 128, q); return;                                                          \
    default: break;                                                                              \
    }
    if (j->D == 64 || j->D == 128) {
        BY_CACHE(j, PARTS)
    }
#undef PARTS
#undef PART
#endif
    (void)srow; /* the portable part walks the blocks itself */
    switch (j->D) {
    case 64: attend_part(j, b, h, t0, t1, 64, scores, qf, acc, m, l, row); break;
    case 128: attend_part(j, b, h, t0, t1, 128, scores, qf, acc, m, l, row); break;
    default: attend_part(j, b, h, t0, t1, j->D, scores, qf, acc, m, l, row); break;
    }
}

#ifdef GROUPED
/* attend_group_avx512 for this job's G and cache (D = 64; G <= 4: the caller checks) */
static void group_dispatch(const Job *j, int b0, int R, int h, int t0, const int *t1s,
                           float *scores, float *qf, float *acc, float *m, float *l,
                           long *srow) {
    const int G = j->H / j->Hkv;
#define GROUP(g, q) attend_group_avx512(j, b0, R, h, t0, t1s, g, q, scores, qf, acc, m, l, srow)
#define GROUPS(q)                                                                                \
    switch (G) {                                                                                 \
    case 1: GROUP(1, q); return;                                                                 \
    case 2: GROUP(2, q); return;                                                                 \
    case 3: GROUP(3, q); return;                                                                 \
    default: GROUP(4, q); return;                                                                \
    }
    BY_CACHE(j, GROUPS)
#undef GROUPS
#undef GROUP
}

/* attend_seq_avx512 for this job's G, D (64 or 128) and cache; the caller checks Hkv */
static void seq_dispatch(const Job *j, int b, int t0, int t1, float *scores, float *qf,
                         float *acc, float *raw, float *m, float *l, long *srow) {
    const int G = j->H / j->Hkv;
#define SEQ(g, d, q) attend_seq_avx512(j, b, t0, t1, g, d, q, scores, qf, acc, raw, m, l, srow)
#define SEQS(q)                                                                                  \
    switch (G * 1000 + j->D) {                                                                   \
    case 1064: SEQ(1, 64, q); return;                                                            \
    case 2064: SEQ(2, 64, q); return;                                                            \
    case 3064: SEQ(3, 64, q); return;                                                            \
    case 4064: SEQ(4, 64, q); return;                                                            \
    case 1128: SEQ(1, 128, q); return;                                                           \
    case 2128: SEQ(2, 128, q); return;                                                           \
    case 3128: SEQ(3, 128, q); return;                                                           \
    default: SEQ(4, 128, q); return;                                                             \
    }
    BY_CACHE(j, SEQS)
#undef SEQS
#undef SEQ
}
#endif

#define SPLIT_TOKENS 512 /* a part's tokens: cut at fixed positions, whatever the batch */

/* Part (row b, kv head h, token range s): into its slot of partial (splits > 1), or written out
 * (acc and ml the thread's scratch). */
static void one_part(const Job *j, int b, int h, int s, int splits, float *partial,
                     size_t stride, float *scores, float *qf, float *acc, float *ml, float *row,
                     long *srow) {
    const int G = j->H / j->Hkv, D = j->D, chunk = SPLIT_TOKENS, len = j->seq_lens[b];
    const int t0 = s * chunk, t1 = t0 + chunk < len ? t0 + chunk : len;
    float *pa = splits > 1 ? partial + stride * (((size_t)b * j->Hkv + h) * splits + s) : acc;
    float *pm = splits > 1 ? pa + (size_t)G * D : ml, *pl = pm + G;
    if (t0 >= t1) { /* past this row's tokens: the merge reads its real parts only */
        if (splits == 1) { /* a row of no tokens (none in a real step): zeros */
            memset(pa, 0, sizeof(float) * G * D);
            for (int g = 0; g < G; g++) pl[g] = 0.f;
            write_out(j, b, h, pa, pl);
        }
        return;
    }
    attend_dispatch(j, b, h, t0, t1, scores, qf, pa, pm, pl, row, srow);
    if (splits == 1) write_out(j, b, h, pa, pl);
}

/* Unit `unit` of paged_decode_kv's loop: a part (row, kv head, token range), with groups
 * (first: group i's first row, first[groups] = B) a group's rows over one kv head's range, or
 * (whole) a row's every kv head over one token range. */
static void one_unit(const Job *j, int unit, int splits, const int *first, int whole,
                     float *partial, size_t stride, float *scores, float *qf, float *acc,
                     float *ml, float *row, long *srow) {
    const int Hkv = j->Hkv, pair = unit / splits, s = unit % splits, h = pair % Hkv;
#ifdef GROUPED
    if (whole) { /* a whole sequence's part: (row, token range), every kv head */
        const int b = unit / splits, G = j->H / Hkv, D = j->D, len = j->seq_lens[b];
        const int t0 = s * SPLIT_TOKENS, t1 = t0 + SPLIT_TOKENS < len ? t0 + SPLIT_TOKENS : len;
        if (t0 >= t1) { /* as one_part's, per kv head */
            for (int hk = 0; hk < Hkv; hk++)
                one_part(j, b, hk, s, splits, partial, stride, scores, qf, acc, ml, row, srow);
            return;
        }
        /* scratch: scores [H * n], qf, acc, raw [H * D], m and l [H] (over `row`, which only
         * the portable part uses) */
        float *sacc = qf + (size_t)j->H * D, *raw = sacc + (size_t)j->H * D;
        float *m = raw + (size_t)j->H * D, *l = m + j->H;
        seq_dispatch(j, b, t0, t1, scores, qf, sacc, raw, m, l, srow);
        for (int hk = 0; hk < Hkv; hk++) {
            const float *ah = sacc + (size_t)hk * G * D, *mh = m + hk * G, *lh = l + hk * G;
            if (splits == 1) {
                write_out(j, b, hk, ah, lh);
                continue;
            }
            float *pa = partial + stride * (((size_t)b * Hkv + hk) * splits + s);
            memcpy(pa, ah, sizeof(float) * G * D);
            memcpy(pa + (size_t)G * D, mh, sizeof(float) * G);
            memcpy(pa + (size_t)G * D + G, lh, sizeof(float) * G);
        }
        return;
    }
#else
    (void)whole;
#endif
    if (first == NULL) { /* a part: (row, kv head, token range) */
        one_part(j, pair / Hkv, h, s, splits, partial, stride, scores, qf, acc, ml, row, srow);
        return;
    }
#ifdef GROUPED
    const int G = j->H / Hkv, D = j->D, chunk = SPLIT_TOKENS;
    const int32_t *seq_lens = j->seq_lens;
    /* a group's rows that have tokens in this range (a suffix: lengths increase) */
    const int g0 = first[pair / Hkv], g1 = first[pair / Hkv + 1], t0 = s * chunk;
    int b0 = g0;
    while (b0 < g1 && seq_lens[b0] <= t0) b0++; /* none past t0: merged without it */
    if (g1 - b0 < 2) {
        if (b0 < g1)
            one_part(j, b0, h, s, splits, partial, stride, scores, qf, acc, ml, row, srow);
        return;
    }
    const int R = g1 - b0;
    int t1s[GROUP_ROWS];
    for (int r = 0; r < R; r++)
        t1s[r] = t0 + chunk < seq_lens[b0 + r] ? t0 + chunk : seq_lens[b0 + r];
    float *gm = acc + (size_t)GROUP_ROWS * G * D, *gl = gm + GROUP_ROWS * G;
    group_dispatch(j, b0, R, h, t0, t1s, scores, qf, acc, gm, gl, srow);
    for (int r = 0; r < R; r++) {
        const int b = b0 + r;
        float *ar = acc + (size_t)r * G * D, *lr = gl + r * G;
        if (splits == 1) {
            write_out(j, b, h, ar, lr);
            continue;
        }
        float *pa = partial + stride * (((size_t)b * Hkv + h) * splits + s);
        memcpy(pa, ar, sizeof(float) * G * D);
        memcpy(pa + (size_t)G * D, gm + r * G, sizeof(float) * G);
        memcpy(pa + (size_t)G * D + G, lr, sizeof(float) * G);
    }
#endif
}

#ifdef GROUPED
/* Rows of one sequence side by side (a verify step's, a short prefill's: the same block table,
 * lengths one apart) in groups of up to `cap` rows; first[i] = group i's first row, first[groups]
 * = B. Returns the number of groups. */
static int make_groups(const int32_t *block_tables, const int32_t *seq_lens, int B,
                       int max_blocks, int cap, int *first) {
    int groups = 0;
    for (int b = 0; b < B; b++) {
        const int32_t *tb = block_tables + (long)b * max_blocks;
        if (groups > 0 && b - first[groups - 1] < cap && seq_lens[b] == seq_lens[b - 1] + 1 &&
            memcmp(tb, tb - max_blocks, sizeof(int32_t) * max_blocks) == 0)
            continue;
        first[groups++] = b;
    }
    first[groups] = B;
    return groups;
}
#endif

/* Whether a decode step (one row per sequence, none grouped) of B sequences, the longest
 * max_len tokens, on num_threads threads goes by whole sequences (attend_seq_avx512: each unit a
 * sequence's part, every kv head in one walk over its cache rows, read whole) rather than by
 * (sequence, kv head) parts: where the build has it, for its shapes, and with enough sequences
 * to share out (with fewer, the kv heads' parts even out the threads' shares: one sequence on
 * 2 threads, 3 parts against 1). The same bits either way. Measured (default model, 2 threads,
 * 320 tokens of context, a whole decode step, old and new alternated three times): 64
 * sequences 45.9-46.9 -> 43.2-45.5 ms, 16 sequences 14.7-15.1 -> 14.3-14.7, 8 within noise. */
int paged_decode_whole(int B, int H, int Hkv, int D, int max_len, int num_threads) {
#ifdef GROUPED
    const int splits = (max_len + SPLIT_TOKENS - 1) / SPLIT_TOKENS;
    const int threads = num_threads > 1 ? num_threads : 1;
    return Hkv > 1 && Hkv <= SEQ_MAX_HKV && H % Hkv == 0 && H / Hkv <= 4 &&
           (D == 64 || D == 128) && B * splits >= SEQ_MIN_UNITS * threads;
#else
    (void)B, (void)H, (void)Hkv, (void)D, (void)max_len, (void)num_threads;
    return 0;
#endif
}

/* Returns 0 on success, -1 for a shape this kernel does not take, -2 when out of memory.
 *
 * Work is split into parts of (sequence, kv head, token range): each sequence's tokens are cut
 * at multiples of SPLIT_TOKENS, flash-decoding style, and the parts' softmax statistics merged
 * in order, in parallel over the pairs. The cut depends on the sequence alone, never on the
 * batch, so a row's result, to the last bit, does not depend on the rows beside it: where the
 * cut followed the batch, a verify step's rows differed from the decode steps they stand for in
 * the last bits, int8 activations turned such a bit into another code, and speculative decoding
 * changed greedy output. 512 tokens (measured, 2 threads: batch 1 at 256 and 2,000 tokens,
 * batch 16 at 256, batch 32 at 1,024, within noise of the batch-dependent cut; 64-token parts
 * cost 5-15% at batch 16-32). A step whose rows all fit one part skips the merge, which gives
 * the same bits (exp(0) is 1). */
/* What paged_decode_kv works out from a step's rows before its threads start: the cut of the
 * work into units, the threads it goes to, and the memory they share (the parts' statistics, each
 * thread's scratch). It depends on the rows, the heads and the head size alone, so a step's
 * layers can share one (decode_layer.c's team does). */
typedef struct {
    int threads, splits, units, pairs, interleave, whole;
    int rows_g, most; /* rows of a unit (a group's, a whole sequence's kv heads, or 1); a part's
                       * most tokens */
    size_t stride, share, rows_f;
    int *first;      /* group i's first row (first[groups] = B), or NULL */
    float *partial;  /* the parts' acc, m, l (splits > 1), or NULL */
    float *scratch;  /* `share` floats per thread */
} Plan;

static void plan_free(Plan *p) {
    free(p->scratch), free(p->partial), free(p->first);
    p->scratch = p->partial = NULL, p->first = NULL;
}

/* Returns 0, -1 for a shape this kernel does not take, -2 when out of memory. */
static int plan_make(Plan *p, const int32_t *block_tables, const int32_t *seq_lens, int B, int H,
                     int Hkv, int D, int max_blocks, int num_threads) {
    memset(p, 0, sizeof *p);
    if (Hkv < 1 || H % Hkv != 0 || H / Hkv > 64 || B < 1) return -1;
    const int G = H / Hkv, pairs = B * Hkv;
    int max_len = 1;
    long work = 0;
    for (int b = 0; b < B; b++) {
        if (seq_lens[b] > max_len) max_len = seq_lens[b];
        work += (long)seq_lens[b] * Hkv;
    }
    /* Waking threads costs more than a small batch's whole attention. This OpenMP runtime is the
     * one torch loaded (same soname), so the threads are torch's own pool, not a competing one. */
    if (work < 256 || num_threads < 1) num_threads = 1;
    const int chunk = SPLIT_TOKENS, splits = (max_len + chunk - 1) / chunk;
    const int parts = pairs * splits;
    const size_t stride = (size_t)G * (D + 2); /* one part's acc, m, l */
    float *partial = splits > 1 ? malloc(sizeof(float) * stride * parts) : NULL;
    if (splits > 1 && partial == NULL) return -2;
    /* Rows of one sequence side by side (a verify step's, a short prefill's: the same block
     * table, lengths one apart) go in groups of up to GROUP_ROWS, where the AVX-512 group part
     * takes them (D = 64): each 4 tokens' K rows loaded once for all of them. first[i]: group
     * i's first row (first[groups] = B); NULL where every group would be one row. */
    int *first = NULL, groups = B, interleave = 0, whole = 0;
#ifdef GROUPED
    if (D == 64 && G <= 4 && B > 1) {
        first = malloc(sizeof(int) * (B + 1));
        if (first == NULL) {
            free(partial);
            return -2;
        }
        groups = make_groups(block_tables, seq_lens, B, max_blocks, GROUP_ROWS, first);
        /* Few units for the threads (a lone verify step: one group times the kv heads, 3 units
         * on 2 threads): smaller groups, dealt out in turn, so that the threads' shares of rows
         * even out. A row's bits do not depend on its group. Measured, default model's layout,
         * 5 rows at 350 tokens, 2 threads, cold cache: 1.16 -> 1.04 ms a step's 30 layers. */
        const int few = 2 * num_threads;
        if (num_threads > 1 && groups < B && groups * Hkv * splits < few) {
            int widest = 1;
            for (int i = 0; i < groups; i++)
                if (first[i + 1] - first[i] > widest) widest = first[i + 1] - first[i];
            const int parts_each = (few + groups * Hkv * splits - 1) / (groups * Hkv * splits);
            const int cap = (widest + parts_each - 1) / parts_each;
            groups = make_groups(block_tables, seq_lens, B, max_blocks, cap, first);
            interleave = 1;
        }
        if (groups == B) {
            free(first);
            first = NULL;
        }
    }
    whole = first == NULL && paged_decode_whole(B, H, Hkv, D, max_len, num_threads);
#else
    (void)block_tables, (void)max_blocks;
#endif
    /* Every thread's scratch (a part's cache rows, scores, q, acc, one K/V row; a group's for
     * rows_g rows) in one allocation made before the threads start, so a failure returns here
     * and no thread has a flag to share. Each share is padded to 64 bytes: no two threads write
     * one cache line. */
    const int units = whole ? B * splits : groups * Hkv * splits;
    const int rows_g = first ? GROUP_ROWS : whole ? Hkv : 1;
    const int most = chunk < max_len ? chunk : max_len;
    const size_t rows_f = (sizeof(long) / sizeof(float)) * (size_t)most; /* the rows, in floats */
    /* scores, q, acc (and a group's m, l) for rows_g rows; a whole sequence's raw V sums too */
    const size_t share = (rows_f + (size_t)rows_g * G * (most + 2 * D + 2) +
                          (whole ? (size_t)H * D : 0) + D + 15) &
                         ~(size_t)15;
    float *scratch = malloc(sizeof(float) * share * num_threads);
    if (scratch == NULL) {
        free(partial);
        free(first);
        return -2;
    }
    *p = (Plan){num_threads, splits, units, pairs, interleave, whole, rows_g, most, stride, share,
                rows_f, first, partial, scratch};
    return 0;
}

/* Thread tid of nth's share of the attention the plan cut: its units, then (splits > 1) after
 * barrier(arg) its pairs' merge; threads past the plan's count only take the barrier. The
 * caller's barrier follows. */
static void plan_share(const Plan *p, const Job *j, int tid, int nth, void (*barrier)(void *),
                       void *arg) {
    const int G = j->H / j->Hkv, D = j->D, splits = p->splits, units = p->units;
    const int active = nth < p->threads ? nth : p->threads;
    if (tid < active) {
        long *srow = (long *)(p->scratch + p->share * tid);
        float *scores = (float *)srow + p->rows_f;
        float *qf = scores + (size_t)p->rows_g * G * p->most;
        float *acc = qf + (size_t)p->rows_g * G * D;
        float *row = acc + (size_t)p->rows_g * G * (D + 2);
        float ml[128];
        /* dealt in turn (interleave), or in contiguous shares: OpenMP's static schedules */
        int u0 = tid, u1 = units, du = active;
        if (!p->interleave) {
            static_share(units, tid, active, &u0, &u1);
            du = 1;
        }
        for (int unit = u0; unit < u1; unit += du)
            one_unit(j, unit, splits, p->first, p->whole, p->partial, p->stride, scores, qf, acc,
                     ml, row, srow);
        if (splits > 1) barrier(arg);
        if (splits > 1) {
            /* the merge, in part order, each thread's contiguous share of the pairs; in its acc */
            int p0, p1;
            static_share(p->pairs, tid, active, &p0, &p1);
            for (int pair = p0; pair < p1; pair++) {
                const float *first = p->partial + p->stride * (size_t)pair * splits;
                const int real = (j->seq_lens[pair / j->Hkv] + SPLIT_TOKENS - 1) / SPLIT_TOKENS;
                for (int g = 0; g < G; g++) {
                    float mx = -INFINITY;
                    for (int s = 0; s < real; s++) {
                        const float ms = first[p->stride * s + (size_t)G * D + g];
                        mx = ms > mx ? ms : mx;
                    }
                    float sum = 0.f, *ag = acc + g * D;
                    memset(ag, 0, sizeof(float) * D);
                    for (int s = 0; s < real; s++) {
                        const float *ps = first + p->stride * s;
                        const float ms = ps[(size_t)G * D + g];
                        if (ms == -INFINITY) continue;
                        const float w = exp_approx(ms - mx);
                        sum += w * ps[(size_t)G * D + G + g];
                        for (int d = 0; d < D; d++) ag[d] += w * ps[g * D + d];
                    }
                    ml[g] = sum;
                }
                write_out(j, pair / j->Hkv, pair % j->Hkv, acc, ml);
            }
        }
    } else if (splits > 1) {
        barrier(arg);
    }
}

static void omp_barrier(void *arg) {
    (void)arg;
#pragma omp barrier
}

/* -1 for a cache paged_decode_kv does not take with these activations, else 0. */
static int kv_unsupported(int dtype, int kv_dtype, const float *k_scales, const float *v_scales,
                          int bs) {
    if (bs < 1) return -1;
    if (kv_dtype != dtype && kv_dtype != 4 &&
        (kv_dtype < 2 || kv_dtype > 3 || !k_scales || !v_scales))
        return -1;
    return 0;
}

/* Returns 0 on success, -1 for a shape this kernel does not take, -2 when out of memory.
 *
 * Work is split into parts of (sequence, kv head, token range): each sequence's tokens are cut
 * at multiples of SPLIT_TOKENS, flash-decoding style, and the parts' softmax statistics merged
 * in order, in parallel over the pairs. The cut depends on the sequence alone, never on the
 * batch, so a row's result, to the last bit, does not depend on the rows beside it: where the
 * cut followed the batch, a verify step's rows differed from the decode steps they stand for in
 * the last bits, int8 activations turned such a bit into another code, and speculative decoding
 * changed greedy output. 512 tokens (measured, 2 threads: batch 1 at 256 and 2,000 tokens,
 * batch 16 at 256, batch 32 at 1,024, within noise of the batch-dependent cut; 64-token parts
 * cost 5-15% at batch 16-32). A step whose rows all fit one part skips the merge, which gives
 * the same bits (exp(0) is 1). */
int paged_decode_kv(const void *q, long q_stride, const void *k_cache, const void *v_cache,
                    const float *k_scales, const float *v_scales, const int32_t *block_tables,
                    const int32_t *seq_lens, void *out, int B, int H, int Hkv, int D, int bs,
                    int max_blocks, float scale, int dtype, int kv_dtype, int num_threads) {
    if (kv_unsupported(dtype, kv_dtype, k_scales, v_scales, bs)) return -1;
    Plan plan;
    const int rc = plan_make(&plan, block_tables, seq_lens, B, H, Hkv, D, max_blocks,
                             num_threads);
    if (rc) return rc;
    Job job = {q, k_cache, v_cache, block_tables, seq_lens, out, B, H, Hkv, D, bs, max_blocks,
               dtype, q_stride, scale, kv_dtype, k_scales, v_scales};
#pragma omp parallel num_threads(plan.threads)
    {
#ifdef _OPENMP
        plan_share(&plan, &job, omp_get_thread_num(), omp_get_num_threads(), omp_barrier, NULL);
#else
        plan_share(&plan, &job, 0, 1, omp_barrier, NULL);
#endif
    }
    plan_free(&plan);
    return 0;
}

/* For decode_layer.c's team (a step's layers in one parallel region): a plan made once for a
 * step's rows, and each layer's attention run by the team's threads in parts, with the team's
 * barrier between the units and their merge. The same units and merge: the same bits. */

/* A plan for the step (NULL: a shape not taken, or no memory), freed by paged_decode_plan_free. */
void *paged_decode_plan(const int32_t *block_tables, const int32_t *seq_lens, int B, int H,
                        int Hkv, int D, int max_blocks, int num_threads) {
    Plan *p = malloc(sizeof *p);
    if (p == NULL) return NULL;
    if (plan_make(p, block_tables, seq_lens, B, H, Hkv, D, max_blocks, num_threads)) {
        free(p);
        return NULL;
    }
    return p;
}

void paged_decode_plan_free(void *plan) {
    if (plan == NULL) return;
    plan_free(plan);
    free(plan);
}

/* -1 where paged_decode_part cannot take this cache with these activations, else 0. */
int paged_decode_part_unsupported(int dtype, int kv_dtype, const float *k_scales,
                                  const float *v_scales, int bs) {
    return kv_unsupported(dtype, kv_dtype, k_scales, v_scales, bs);
}

/* Thread tid of nth's share of one layer's attention under the plan (made for these rows, heads
 * and head size), barrier(arg) the team's. */
void paged_decode_part(const void *plan, const void *q, long q_stride, const void *k_cache,
                       const void *v_cache, const float *k_scales, const float *v_scales,
                       const int32_t *block_tables, const int32_t *seq_lens, void *out, int B,
                       int H, int Hkv, int D, int bs, int max_blocks, float scale, int dtype,
                       int kv_dtype, int tid, int nth, void (*barrier)(void *), void *arg) {
    const Job job = {q, k_cache, v_cache, block_tables, seq_lens, out, B, H, Hkv, D, bs,
                     max_blocks, dtype, q_stride, scale, kv_dtype, k_scales, v_scales};
    plan_share(plan, &job, tid, nth, barrier, arg);
}

/* The cache in q's dtype (no scales): what the per-op path and decode_layer.c call. */
int paged_decode(const void *q, long q_stride, const void *k_cache, const void *v_cache,
                 const int32_t *block_tables, const int32_t *seq_lens, void *out, int B, int H,
                 int Hkv, int D, int bs, int max_blocks, float scale, int dtype, int num_threads) {
    return paged_decode_kv(q, q_stride, k_cache, v_cache, NULL, NULL, block_tables, seq_lens, out,
                           B, H, Hkv, D, bs, max_blocks, scale, dtype, dtype, num_threads);
}
