/* Batched quantized matmul with int8 activations (W4A8, W8A8) for the CPU: out[M, N] = x[M, K] @ W.T
 * for M from 2 to a few hundred rows (decode batches, small prefills). Compiled on first use by
 * common/kernels/cpu_qgemm.py, which also repacks the weight into the panel layout below; entry
 * points `qgemm_a8` and `qgemm_isa`, and qgemm_a8's parts for decode_layer.c's team (at the end).
 *
 * Activations: each row of x is quantized per block of 32 columns (as llama.cpp's Q8_0):
 *   xs = max|x_j| / 127, xq_j = round(x_j / xs) (nearest even), so x_j ~ xs * xq_j, |xq_j| <= 127.
 * Weights: unsigned codes u with a fixed offset (int4: u = q, off 8; int8: u = q + 128, off 128)
 * and per group (a multiple of 32 columns) scale s and zero z: w = (u - off) s + z. Per block b of
 * 32 columns the integer sum  sum_j (u_j - off) xq_j  is exact in int32 (dpbusd sums u8 x s8
 * products; the offset enters as the accumulator's start, -off * sum_j xq_j); then in float
 *   out += xs_b * s_g * isum_b  (per block)  +  z_g * sum_{b in g} xs_b sum_j xq_j  (per group).
 *
 * Panel layout (16 output columns, lane c = column 16p + c; the pad rows past N have scale 0):
 *   int4: per 8 columns of K, 64 bytes: byte 4c + i = u[k + i] | u[k + 4 + i] << 4, i = 0..3
 *   int8: per 4 columns of K, 64 bytes: byte 4c + i = u[k + i]
 *   scale, zero: float32 [P, G, 16] (sf = 0); or 16-bit, 2.5 (int8: 2.25) bytes a block of 32
 *   weights fewer to stream: sf = 2, bfloat16 scale and zero (a bfloat16 model's, exactly); sf =
 *   1, float16 scale and minimum mn, the zero z = mn + 8 s computed in float32 as it is used (int4
 *   only; one rounding, as the float32 zero it stands for was made: a float32 GGUF Q4_1 or Q8_0
 *   weight's). common/kernels/cpu_qgemm.py packs 16-bit scales only where they give back every
 *   scale and zero exactly, so every layout gives the same bits.
 * so one 512-bit load holds 4 (int4: 8) consecutive codes of 16 columns, and a broadcast of 4
 * bytes of one x row feeds a dpbusd into that row's 16 column sums: no horizontal sums, and each
 * unpacked weight vector is used by MR rows of x (register blocking). OpenMP over panels.
 * ISA sections: AVX-512 VNNI (6 rows x 32 columns: two panels per x broadcast; the last
 * panel of an odd count, and a partial one, 8 rows x 16 columns), AVX-VNNI / AVX2 (4 rows x 8
 * columns, half a panel; AVX2 sums u8 x s8 pairs with maddubs, int8 weights through |w| and
 * sign(x, w) so the int16 pair sums cannot saturate), portable C.
 *
 * Layouts: x [M, K] float32 (xdtype 0) or bfloat16 (1) with row stride; out [M, N] in x's dtype,
 * contiguous. Non-finite x gives a NaN row.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "vecmath.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define QB 32    /* activation block (columns of K per x scale) */
#define PANEL 16 /* output columns per panel */
#define QUANTIZE_PARALLEL_MIN 4096 /* values of x below which one thread quantizes them */

/* activations after quantization: xq [M, K], per block xs [M, KB] and the offset's start
 * xo = -off * sum xq [M, KB], per weight group xsg = sum_b xs_b sum xq_b [M, G] (zero points) */
typedef struct {
    int8_t *xq;
    float *xs;
    int32_t *xo;
    float *xsg;
    int K, KB, G;
} acts;

static inline int32_t load4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline float x_at(const void *x, long i, int xdtype) {
    return xdtype == 0 ? ((const float *)x)[i] : bf16_to_f32(((const uint16_t *)x)[i]);
}

/* element i of a panel scale (or zero) array: float32 (sf 0), or 16-bit */
static inline const void *scale_at(const void *p, long i, int sf) {
    return (const char *)p + i * (sf ? 2 : 4);
}

/* one block of 32 x values (float32) -> xq, returns the scale; amax 0 gives scale 0 and codes 0,
 * a non-finite amax a NaN scale */
static inline float quantize_block(const float *v, int8_t *q, int *qsum) {
    float amax = 0.0f;
    int finite = 1;
#if defined(__AVX2__)
    {
        const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(FLT_MAX);
        __m256 m = _mm256_setzero_ps();
        int bad = 0;
        for (int j = 0; j < QB; j += 8) {
            const __m256 t = _mm256_andnot_ps(sign, _mm256_loadu_ps(v + j));
            bad |= _mm256_movemask_ps(_mm256_cmp_ps(t, big, _CMP_NLE_UQ));
            m = _mm256_max_ps(m, t);
        }
        finite = !bad;
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        amax = _mm_cvtss_f32(h);
    }
#else
    for (int j = 0; j < QB; j++) {
        const float t = fabsf(v[j]);
        finite &= t <= FLT_MAX; /* false for inf and NaN */
        amax = t > amax ? t : amax;
    }
#endif
    *qsum = 0;
    if (!finite || amax == 0.0f) {
        memset(q, 0, QB);
        return finite ? 0.0f : NAN;
    }
    const float xs = amax / 127.0f;
#if defined(__AVX2__)
    const __m256 d = _mm256_set1_ps(xs);
    __m256i sum = _mm256_setzero_si256();
    for (int j = 0; j < QB; j += 8) {
        const __m256i t = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(v + j), d));
        sum = _mm256_add_epi32(sum, t);
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        _mm_storel_epi64((__m128i *)(q + j), _mm_packs_epi16(w, w));
    }
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
    *qsum = _mm_cvtsi128_si32(h);
#else
    int s = 0;
    for (int j = 0; j < QB; j++) {
        int t = (int)rintf(v[j] / xs); /* the current rounding mode: nearest even */
        q[j] = (int8_t)t;
        s += t;
    }
    *qsum = s;
#endif
    return xs;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* quantize_block on a block held in two registers (the same results): loading it from a
 * buffer the caller just filled in narrower stores would stall on store forwarding */
static inline float quantize_block512(__m512 v0, __m512 v1, int8_t *q, int *qsum) {
    const __m512 sign = _mm512_set1_ps(-0.0f), big = _mm512_set1_ps(FLT_MAX);
    const __m512 a0 = _mm512_andnot_ps(sign, v0), a1 = _mm512_andnot_ps(sign, v1);
    *qsum = 0;
    if (_mm512_cmp_ps_mask(a0, big, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(a1, big, _CMP_NLE_UQ)) {
        memset(q, 0, QB); /* inf or NaN */
        return NAN;
    }
    /* no NaN here: the largest |x|, as quantize_block's loop finds it */
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
    if (amax == 0.0f) {
        memset(q, 0, QB);
        return 0.0f;
    }
    const float xs = amax / 127.0f;
    const __m512 d = _mm512_set1_ps(xs);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_div_ps(v0, d));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_div_ps(v1, d));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(q1));
    *qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    return xs;
}

/* 16 values of x at element i as float32 */
static inline __m512 load16(const void *x, long i, int xdtype) {
    if (xdtype == 0) return _mm512_loadu_ps((const float *)x + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

/* row m of x quantized into a (its codes, block scales, offsets, group sums) */
static void quantize_row(const void *x, long stride, int xdtype, int m, int gs, int off,
                         acts *a) {
    const int K = a->K, KB = a->KB, bpg = gs / QB;
    float gsum = 0.0f;
    for (int b = 0; b < KB; b++) {
        const long src = (long)m * stride + (long)b * QB;
        int qsum;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        const float xs = quantize_block512(load16(x, src, xdtype), load16(x, src + 16, xdtype),
                                           a->xq + (long)m * K + (long)b * QB, &qsum);
#else
        float v[QB];
        if (xdtype == 0) {
            memcpy(v, (const float *)x + src, sizeof v);
        } else {
#if defined(__AVX2__)
            for (int j = 0; j < QB; j += 8) { /* bfloat16: the high half of a float32 */
                const __m256i h = _mm256_cvtepu16_epi32(
                    _mm_loadu_si128((const __m128i *)((const uint16_t *)x + src + j)));
                _mm256_storeu_ps(v + j, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
            }
#else
            for (int j = 0; j < QB; j++) v[j] = x_at(x, src + j, 1);
#endif
        }
        const float xs = quantize_block(v, a->xq + (long)m * K + (long)b * QB, &qsum);
#endif
        a->xs[(long)m * KB + b] = xs;
        a->xo[(long)m * KB + b] = -off * qsum;
        gsum += xs * (float)qsum;
        if ((b + 1) % bpg == 0) {
            a->xsg[(long)m * a->G + b / bpg] = gsum;
            gsum = 0.0f;
        }
    }
}

static void quantize_x(const void *x, long stride, int xdtype, int M, int gs, int off, acts *a,
                       int nthreads) {
    /* a few rows take well under a microsecond: waking the other threads costs more (and so
     * does an if(0) region) */
    if ((long)M * a->K < QUANTIZE_PARALLEL_MIN || nthreads < 2) {
        for (int m = 0; m < M; m++) quantize_row(x, stride, xdtype, m, gs, off, a);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int m = 0; m < M; m++) quantize_row(x, stride, xdtype, m, gs, off, a);
}

/* one row's nc results (columns n0..n0+nc) from f, in x's dtype */
static inline void store_row(const float *f, int nc, void *out, long off, int xdtype) {
    if (xdtype == 0)
        memcpy((float *)out + off, f, sizeof(float) * nc);
    else
        for (int c = 0; c < nc; c++) ((uint16_t *)out)[off + c] = f32_to_bf16(f[c]);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define ISA 3
#define MR 8
#define MR2 6 /* rows of the two-panel tile: 24 accumulators */
/* from this many rows on, panels go two at a time. Measured on the default model's four
 * projection shapes, pairs against one panel at a time: an AVX-512 VNNI Intel host (2 threads),
 * when the last M % 6 rows still went one panel at a time: 1.1-1.25x at 64 and 256 rows,
 * 0.85-1.05x at 8 and 16; an AMD EPYC (Zen 5) host (1 thread) with those rows in a smaller pair
 * tile as now: 1.03-1.1x at 1-2 rows, 1.1-1.5x at 3-16 (0.93x once at 5), 1.02-1.1x at 32-64.
 * Not yet chosen by the tune: one host's measurement. */
#define PAIR_MIN_ROWS 1
/* 16 scales at element i in format sf; 16 zeros (sf 1: from the minimums and scales) */
static inline __m512 scales16(const void *sp, long i, int sf) {
    if (sf == 0) return _mm512_loadu_ps((const float *)sp + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)sp + i));
    return sf == 1 ? _mm512_cvtph_ps(h)
                   : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 zeros16(const void *zp, const void *sp, long i, int sf) {
    return sf == 1 ? _mm512_fmadd_ps(_mm512_set1_ps(8.f), scales16(sp, i, 1), scales16(zp, i, 1))
                   : scales16(zp, i, sf);
}
/* rows m0..m0+mr of x times panel p; mr is a constant after inlining, so the 2 * mr
 * accumulators stay in registers */
static inline __attribute__((always_inline)) void tile(int mr, const acts *a, int m0, int bits,
                                                       int bpg, const uint8_t *wp,
                                                       const void *sp, const void *zp, int sf,
                                                       void *out, long N, long n0, int nc,
                                                       int xdtype) {
    const int K = a->K, KB = a->KB;
    const int8_t *xq = a->xq + (long)m0 * K;
    const float *xs = a->xs + (long)m0 * KB, *xsg = a->xsg + (long)m0 * a->G;
    const int32_t *xo = a->xo + (long)m0 * KB;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 f[MR];
    for (int m = 0; m < mr; m++) f[m] = _mm512_setzero_ps();
    for (int b = 0; b < KB; b++) {
        __m512i acc[MR];
        for (int m = 0; m < mr; m++) acc[m] = _mm512_set1_epi32(xo[(long)m * KB + b]);
        const int8_t *xb = xq + (long)b * QB;
        if (bits == 4) {
            const uint8_t *w = wp + (long)b * 256;
            for (int s = 0; s < 4; s++) {
                const __m512i v = _mm512_loadu_si512(w + 64 * s);
                const __m512i lo = _mm512_and_si512(v, low4);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                for (int m = 0; m < mr; m++) {
                    const int8_t *xr = xb + (long)m * K + 8 * s;
                    acc[m] = _mm512_dpbusd_epi32(acc[m], lo, _mm512_set1_epi32(load4(xr)));
                    acc[m] = _mm512_dpbusd_epi32(acc[m], hi, _mm512_set1_epi32(load4(xr + 4)));
                }
            }
        } else {
            const uint8_t *w = wp + (long)b * 512;
            for (int s = 0; s < 8; s++) {
                const __m512i v = _mm512_loadu_si512(w + 64 * s);
                for (int m = 0; m < mr; m++)
                    acc[m] = _mm512_dpbusd_epi32(
                        acc[m], v, _mm512_set1_epi32(load4(xb + (long)m * K + 4 * s)));
            }
        }
        const __m512 sv = scales16(sp, (long)(b / bpg) * PANEL, sf);
        for (int m = 0; m < mr; m++)
            f[m] = _mm512_fmadd_ps(
                _mm512_mul_ps(_mm512_cvtepi32_ps(acc[m]), _mm512_set1_ps(xs[(long)m * KB + b])),
                sv, f[m]);
        if (zp && (b + 1) % bpg == 0) {
            const int g = b / bpg;
            const __m512 zv = zeros16(zp, sp, (long)g * PANEL, sf);
            for (int m = 0; m < mr; m++)
                f[m] = _mm512_fmadd_ps(_mm512_set1_ps(xsg[(long)m * a->G + g]), zv, f[m]);
        }
    }
    for (int m = 0; m < mr; m++) {
        float t[PANEL];
        _mm512_storeu_ps(t, f[m]);
        store_row(t, nc, out, (long)(m0 + m) * N + n0, xdtype);
    }
}

/* rows m0..m0+mr of x times two adjacent panels (32 columns): each broadcast of 4 x bytes feeds
 * two dpbusd and each unpacked weight vector mr of them, against one and eight in `tile`
 * (broadcasts, not dpbusd, bounded that one at many rows). pw: the bytes of one panel's codes,
 * ps: the floats of one panel's scales (and zeros). */
static inline __attribute__((always_inline)) void tile2(int mr, const acts *a, int m0, int bits,
                                                        int bpg, const uint8_t *wp, long pw,
                                                        const void *sp, const void *zp,
                                                        int sf, long ps, void *out, long N,
                                                        long n0, int xdtype, int pf_next) {
    const int K = a->K, KB = a->KB;
    const int8_t *xq = a->xq + (long)m0 * K;
    const float *xs = a->xs + (long)m0 * KB, *xsg = a->xsg + (long)m0 * a->G;
    const int32_t *xo = a->xo + (long)m0 * KB;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 f[MR2][2];
    for (int m = 0; m < mr; m++) f[m][0] = f[m][1] = _mm512_setzero_ps();
    /* the next pair's codes, scales and zeros (the panels after these two, as the threads'
     * static shares run through them in order), asked for a block at a time */
    const long cb = bits == 4 ? 256 : 512; /* code bytes of a block */
    const uint8_t *next = wp + 2 * pw;
    const char *next_s = scale_at(sp, 2 * ps, sf), *next_z = zp ? scale_at(zp, 2 * ps, sf) : 0;
    const long ps_bytes = (char *)scale_at(sp, ps, sf) - (char *)sp;
    /* pf_next 1: into L1 (prefetcht0), 2: into L2 (prefetcht2); a constant in the loop */
#define PF(p) (pf_next == 2 ? _mm_prefetch((const char *)(p), _MM_HINT_T2)                       \
                            : _mm_prefetch((const char *)(p), _MM_HINT_T0))
    for (int b = 0; b < KB; b++) {
        if (pf_next) {
            for (long c = 0; c < cb; c += 64) {
                PF(next + b * cb + c);
                PF(next + pw + b * cb + c);
            }
            if ((b + 1) % bpg == 0) { /* a group's 16 scales (zeros): one line or half */
                const long g = (char *)scale_at(sp, (long)(b / bpg) * PANEL, sf) - (char *)sp;
                PF(next_s + g);
                PF(next_s + ps_bytes + g);
                if (zp) {
                    PF(next_z + g);
                    PF(next_z + ps_bytes + g);
                }
            }
        }
        __m512i acc[MR2][2];
        for (int m = 0; m < mr; m++)
            acc[m][0] = acc[m][1] = _mm512_set1_epi32(xo[(long)m * KB + b]);
        const int8_t *xb = xq + (long)b * QB;
        if (bits == 4) {
            const uint8_t *w0 = wp + (long)b * 256, *w1 = w0 + pw;
            for (int s = 0; s < 4; s++) {
                const __m512i v0 = _mm512_loadu_si512(w0 + 64 * s);
                const __m512i v1 = _mm512_loadu_si512(w1 + 64 * s);
                const __m512i lo0 = _mm512_and_si512(v0, low4), lo1 = _mm512_and_si512(v1, low4);
                const __m512i hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low4);
                const __m512i hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low4);
                for (int m = 0; m < mr; m++) {
                    const int8_t *xr = xb + (long)m * K + 8 * s;
                    const __m512i xl = _mm512_set1_epi32(load4(xr));
                    const __m512i xh = _mm512_set1_epi32(load4(xr + 4));
                    acc[m][0] = _mm512_dpbusd_epi32(acc[m][0], lo0, xl);
                    acc[m][1] = _mm512_dpbusd_epi32(acc[m][1], lo1, xl);
                    acc[m][0] = _mm512_dpbusd_epi32(acc[m][0], hi0, xh);
                    acc[m][1] = _mm512_dpbusd_epi32(acc[m][1], hi1, xh);
                }
            }
        } else {
            const uint8_t *w0 = wp + (long)b * 512, *w1 = w0 + pw;
            for (int s = 0; s < 8; s++) {
                const __m512i v0 = _mm512_loadu_si512(w0 + 64 * s);
                const __m512i v1 = _mm512_loadu_si512(w1 + 64 * s);
                for (int m = 0; m < mr; m++) {
                    const __m512i xv = _mm512_set1_epi32(load4(xb + (long)m * K + 4 * s));
                    acc[m][0] = _mm512_dpbusd_epi32(acc[m][0], v0, xv);
                    acc[m][1] = _mm512_dpbusd_epi32(acc[m][1], v1, xv);
                }
            }
        }
        const __m512 sv0 = scales16(sp, (long)(b / bpg) * PANEL, sf);
        const __m512 sv1 = scales16(sp, ps + (long)(b / bpg) * PANEL, sf);
        for (int m = 0; m < mr; m++) {
            const __m512 x = _mm512_set1_ps(xs[(long)m * KB + b]);
            f[m][0] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc[m][0]), x), sv0,
                                      f[m][0]);
            f[m][1] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc[m][1]), x), sv1,
                                      f[m][1]);
        }
        if (zp && (b + 1) % bpg == 0) {
            const int g = b / bpg;
            const __m512 zv0 = zeros16(zp, sp, (long)g * PANEL, sf);
            const __m512 zv1 = zeros16(zp, sp, ps + (long)g * PANEL, sf);
            for (int m = 0; m < mr; m++) {
                const __m512 t = _mm512_set1_ps(xsg[(long)m * a->G + g]);
                f[m][0] = _mm512_fmadd_ps(t, zv0, f[m][0]);
                f[m][1] = _mm512_fmadd_ps(t, zv1, f[m][1]);
            }
        }
    }
    for (int m = 0; m < mr; m++) { /* two whole panels: all 32 columns lie inside N */
        float t[2 * PANEL];
        _mm512_storeu_ps(t, f[m][0]);
        _mm512_storeu_ps(t + PANEL, f[m][1]);
        store_row(t, 2 * PANEL, out, (long)(m0 + m) * N + n0, xdtype);
    }
#undef PF
}

static void panel(const acts *a, int M, int bits, int bpg, const uint8_t *wp, const void *sp,
                  const void *zp, int sf, void *out, long N, long n0, int nc, int xdtype) {
    int m0 = 0;
#define TILE(r) tile(r, a, m0, bits, bpg, wp, sp, zp, sf, out, N, n0, nc, xdtype)
    for (; m0 + MR <= M; m0 += MR) TILE(MR);
    switch (M - m0) { /* constant row counts for the tail */
    case 7: TILE(7); break;
    case 6: TILE(6); break;
    case 5: TILE(5); break;
    case 4: TILE(4); break;
    case 3: TILE(3); break;
    case 2: TILE(2); break;
    case 1: TILE(1); break;
    default: break;
    }
#undef TILE
}

/* two whole adjacent panels (columns n0..n0+32) over all M rows, MR2 rows at a time, the last
 * M % MR2 rows in one smaller two-panel tile (per row the same sums as tile's: the same bits) */
static void panel_pair(const acts *a, int M, int bits, int bpg, const uint8_t *wp, long pw,
                       const void *sp, const void *zp, int sf, long ps, void *out, long N,
                       long n0, int xdtype, int pf_next) {
    int m0 = 0;
#define TILE2(r)                                                                                 \
    tile2(r, a, m0, bits, bpg, wp, pw, sp, zp, sf, ps, out, N, n0, xdtype, m0 ? 0 : pf_next)
    for (; m0 + MR2 <= M; m0 += MR2) TILE2(MR2);
    switch (M - m0) { /* constant row counts for the tail */
    case 5: TILE2(5); break;
    case 4: TILE2(4); break;
    case 3: TILE2(3); break;
    case 2: TILE2(2); break;
    case 1: TILE2(1); break;
    default: break;
    }
#undef TILE2
}

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
/* AMX (Sapphire Rapids and later), from AMX_MIN_ROWS rows on: whole tiles of 16 rows of x times
 * one panel. The tile unit makes each block's 16 x 16 int32 sums (tdpbssd: signed x codes times
 * the weight codes made signed, u - off, so the offset needs no term), which are stored to
 * memory; the float steps of `tile` above then scale them row by row, in the same order, so the
 * results have the same bits as the AVX-512 VNNI tiles' (the int32 block sum is exact either
 * way). The rows past the last whole tile go through the VNNI tiles. Why it gains little more
 * than 1.1-1.25x on group-32 weights: each block of 32 needs its own product (half a tile's
 * depth), a store and 16 rows of float steps, and the tile unit shares ports with the float
 * steps, so their times add up (measured by parts, 256 rows: tile work 0.67 ms, float steps
 * 0.42 ms, both 1.48 ms; a tile product plus its store alone ~8 ns a block, the float steps of
 * a block alone ~6.5 ns, together ~15-17 ns however far ahead the product is issued). Linux
 * hands out the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, once per process,
 * at load): refused (an older kernel, a sandbox), the library runs its VNNI section alone
 * (qgemm_isa 3). */
#include "amx.h"
#define AMX_ROWS 16
/* fewer rows stay on the VNNI tiles. Measured on the default model's four projections (Q4_1,
 * bfloat16 x, 2 threads, an AVX-512 + AMX Xeon), time against the VNNI tiles': 16 rows 1.00x,
 * 32 0.93x, 48 0.92x, 64 0.88x, 128 0.80-0.92x, 256 0.82-0.85x */
#define AMX_MIN_ROWS 32
/* tmm0, tmm1: block sums C (16 rows x 16 int32); tmm2, tmm3: x codes A (16 rows x 32 bytes);
 * tmm4, tmm5: weight codes B (8 rows of 4 K x 16 columns); two of each, used by turns, so that
 * one block's loads and product need not wait for the previous block's */
static void amx_configure(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 2; t++) {
        c.rows[t] = AMX_ROWS, c.colsb[t] = 64;
        c.rows[2 + t] = AMX_ROWS, c.colsb[2 + t] = QB;
        c.rows[4 + t] = QB / 4, c.colsb[4 + t] = 64;
    }
    _tile_loadconfig(&c);
}

/* a panel's codes -> tile rows of signed codes u - off, 512 bytes a block: int4 (4 x 64 bytes a
 * block, low and high nibbles) row 2s the low nibbles of chunk s (K 8s..8s+3), row 2s + 1 its
 * high ones; int8 (8 x 64 bytes a block, already rows) u - 128 */
static void amx_unpack(const uint8_t *wp, int KB, int bits, int8_t *dst) {
    if (bits == 4) {
        const __m512i low4 = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
        for (long s = 0; s < (long)KB * 4; s++) {
            const __m512i v = _mm512_loadu_si512(wp + 64 * s);
            const __m512i lo = _mm512_and_si512(v, low4);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            _mm512_store_si512(dst + 128 * s, _mm512_sub_epi8(lo, eight));
            _mm512_store_si512(dst + 128 * s + 64, _mm512_sub_epi8(hi, eight));
        }
    } else {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        for (long s = 0; s < (long)KB * 8; s++)
            _mm512_store_si512(dst + 64 * s,
                               _mm512_xor_si512(_mm512_loadu_si512(wp + 64 * s), flip));
    }
}

/* block b's products of the tile of rows whose codes start at xq (tile-major: 512 bytes a
 * block) into tile c; AMX_STORE_SUMS(c) then writes them to cb[c]. A store waits for its
 * product (tens of cycles) and holds up the instructions after it, so a block's product is
 * issued before the float steps of the block before it and stored after them (measured: 1.09x
 * at 256 rows against storing it at once; issuing it two blocks ahead gained nothing more) */
#define AMX_BLOCK(c, ta, tb, b)                                                                  \
    do {                                                                                         \
        _tile_loadd(ta, xq + (long)(b) * AMX_ROWS * QB, QB);                                      \
        _tile_loadd(tb, wb + (long)(b) * 512, 64);                                               \
        _tile_zero(c);                                                                           \
        _tile_dpbssd(c, ta, tb);                                                                 \
    } while (0)
#define AMX_STORE_SUMS(c)                                                                        \
    do {                                                                                         \
        _tile_stored(c, cb[c], 64);                                                              \
        __asm__ volatile("" ::: "memory"); /* GCC's tile intrinsics do not say they write */     \
    } while (0)

/* rows 0..rows-1 (a multiple of 16) of x times one panel: wb its signed codes as tile rows
 * (amx_unpack), sp/zp its scales and zeros; results to columns n0..n0+nc. t: the rows' codes and
 * per-block (per-group) scalars regrouped by tile (`amx_regroup`): a tile's codes for a block
 * are 512 contiguous bytes, its 16 scalars side by side */
static void amx_panel(const acts *t, int rows, int bpg, const int8_t *wb, const void *sp,
                      const void *zp, int sf, void *out, long N, long n0, int nc, int xdtype) {
    const int K = t->K, KB = t->KB, G = t->G;
    int32_t cb[2][AMX_ROWS * PANEL] __attribute__((aligned(64)));
    for (int m0 = 0; m0 < rows; m0 += AMX_ROWS) {
        const int8_t *xq = t->xq + (long)m0 * K;
        const float *xs = t->xs + (long)m0 * KB, *xsg = t->xsg + (long)m0 * G;
        /* the 16 rows' sums in named registers: an array would live in memory, written back
         * around every tile instruction (asm statements that touch memory, to the compiler) */
#define AMX_ROW_LIST(X)                                                                          \
    X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
#define AMX_DECL(m) __m512 f##m = _mm512_setzero_ps();
#define AMX_ROW(m)                                                                               \
    f##m = _mm512_fmadd_ps(                                                                      \
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + PANEL * (m))),                    \
                      _mm512_set1_ps(xsb[m])),                                                   \
        sv, f##m);
#define AMX_ZERO(m) f##m = _mm512_fmadd_ps(_mm512_set1_ps(xsgg[m]), zv, f##m);
#define AMX_STORE(m)                                                                             \
    _mm512_storeu_ps(o, f##m);                                                                   \
    store_row(o, nc, out, (long)(m0 + (m)) * N + n0, xdtype);
/* block b's float steps, its sums in buffer i */
#define AMX_SCALE(i, b)                                                                          \
    do {                                                                                         \
        const int32_t *c = cb[i];                                                                \
        const float *xsb = xs + (long)(b) * AMX_ROWS;                                            \
        const __m512 sv = scales16(sp, (long)((b) / bpg) * PANEL, sf);                           \
        AMX_ROW_LIST(AMX_ROW)                                                                    \
        if (zp && ((b) + 1) % bpg == 0) {                                                        \
            const __m512 zv = zeros16(zp, sp, (long)((b) / bpg) * PANEL, sf);                    \
            const float *xsgg = xsg + (long)((b) / bpg) * AMX_ROWS;                              \
            AMX_ROW_LIST(AMX_ZERO)                                                               \
        }                                                                                        \
    } while (0)
        AMX_ROW_LIST(AMX_DECL)
        /* block b's sums in tile and buffer b % 2 */
        AMX_BLOCK(0, 2, 4, 0);
        AMX_STORE_SUMS(0);
        for (int b = 0; b < KB; b += 2) {
            if (b + 1 < KB) AMX_BLOCK(1, 3, 5, b + 1);
            AMX_SCALE(0, b);
            if (b + 1 < KB) {
                AMX_STORE_SUMS(1);
                if (b + 2 < KB) AMX_BLOCK(0, 2, 4, b + 2);
                AMX_SCALE(1, b + 1);
                if (b + 2 < KB) AMX_STORE_SUMS(0);
            }
        }
        float o[PANEL];
        AMX_ROW_LIST(AMX_STORE)
#undef AMX_SCALE
#undef AMX_STORE
#undef AMX_ZERO
#undef AMX_ROW
#undef AMX_DECL
#undef AMX_ROW_LIST
    }
}
#undef AMX_BLOCK
#undef AMX_STORE_SUMS

/* rows [0, rows) (a multiple of 16) regrouped for amx_panel, per tile of 16 rows: per block
 * the 16 rows' 32 codes one after another (512 bytes), and the 16 rows' values of each scalar
 * side by side; into t's xq, xs and xsg (a's sizes) */
static void amx_regroup(const acts *a, const acts *t, int rows) {
    const int K = a->K, KB = a->KB, G = a->G;
    for (int m0 = 0; m0 < rows; m0 += AMX_ROWS)
        for (int m = 0; m < AMX_ROWS; m++) {
            for (int b = 0; b < KB; b++) {
                memcpy(t->xq + (long)m0 * K + ((long)b * AMX_ROWS + m) * QB,
                       a->xq + (long)(m0 + m) * K + (long)b * QB, QB);
                t->xs[(long)m0 * KB + (long)b * AMX_ROWS + m] = a->xs[(long)(m0 + m) * KB + b];
            }
            for (int g = 0; g < G; g++)
                t->xsg[(long)m0 * G + (long)g * AMX_ROWS + m] = a->xsg[(long)(m0 + m) * G + g];
        }
}
#endif

#elif defined(__AVX2__)
#if defined(__AVXVNNI__)
#define ISA 2
#else
#define ISA 1
#endif
#define MR 4
#define HALF 8 /* columns per pass: half a panel */

/* acc + the 8 lanes' sums of 4 products u8 (w) x s8 (x) */
static inline __m256i dot4(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
    /* int4 codes (<= 15) times |x| <= 127: the int16 pair sums stay far from saturation */
    const __m256i p = _mm256_maddubs_epi16(w, x);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
}

/* 8 scales at element i in format sf; 8 zeros (sf 1: from the minimums and scales) */
static inline __m256 scales8(const void *sp, long i, int sf) {
    if (sf == 0) return _mm256_loadu_ps((const float *)sp + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)sp + i));
    return sf == 1 ? _mm256_cvtph_ps(h)
                   : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline __m256 zeros8(const void *zp, const void *sp, long i, int sf) {
    return sf == 1 ? _mm256_fmadd_ps(_mm256_set1_ps(8.f), scales8(sp, i, 1), scales8(zp, i, 1))
                   : scales8(zp, i, sf);
}

/* rows m0..m0+mr of x times columns h*8..h*8+8 of panel p (h: which half of each 64 bytes) */
static inline __attribute__((always_inline)) void tile(int mr, const acts *a, int m0, int bits,
                                                       int bpg, const uint8_t *wp,
                                                       const void *sp, const void *zp, int sf,
                                                       int h, void *out, long N, long n0, int nc,
                                                       int xdtype) {
    const int K = a->K, KB = a->KB;
    const int8_t *xq = a->xq + (long)m0 * K;
    const float *xs = a->xs + (long)m0 * KB, *xsg = a->xsg + (long)m0 * a->G;
    const int32_t *xo = a->xo + (long)m0 * KB;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 f[MR];
    for (int m = 0; m < mr; m++) f[m] = _mm256_setzero_ps();
    for (int b = 0; b < KB; b++) {
        __m256i acc[MR];
        const int8_t *xb = xq + (long)b * QB;
        if (bits == 4) {
            for (int m = 0; m < mr; m++) acc[m] = _mm256_set1_epi32(xo[(long)m * KB + b]);
            const uint8_t *w = wp + (long)b * 256 + 32 * h;
            for (int s = 0; s < 4; s++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 64 * s));
                const __m256i lo = _mm256_and_si256(v, low4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                for (int m = 0; m < mr; m++) {
                    const int8_t *xr = xb + (long)m * K + 8 * s;
                    acc[m] = dot4(acc[m], lo, _mm256_set1_epi32(load4(xr)));
                    acc[m] = dot4(acc[m], hi, _mm256_set1_epi32(load4(xr + 4)));
                }
            }
        } else {
            const uint8_t *w = wp + (long)b * 512 + 32 * h;
#if defined(__AVXVNNI__)
            for (int m = 0; m < mr; m++) acc[m] = _mm256_set1_epi32(xo[(long)m * KB + b]);
            for (int s = 0; s < 8; s++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 64 * s));
                for (int m = 0; m < mr; m++)
                    acc[m] = dot4(acc[m], v, _mm256_set1_epi32(load4(xb + (long)m * K + 4 * s)));
            }
#else
            /* signed codes q = u ^ 0x80; |q| x sign(x, q) sums q x directly (no offset), pairs
             * at most 2 * 128 * 127 < 2^15 */
            for (int m = 0; m < mr; m++) acc[m] = _mm256_setzero_si256();
            const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
            for (int s = 0; s < 8; s++) {
                const __m256i q =
                    _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 64 * s)), flip);
                const __m256i aq = _mm256_abs_epi8(q);
                for (int m = 0; m < mr; m++) {
                    const __m256i xv = _mm256_set1_epi32(load4(xb + (long)m * K + 4 * s));
                    const __m256i p = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(xv, q));
                    acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(p, ones));
                }
            }
#endif
        }
        const __m256 sv = scales8(sp, (long)(b / bpg) * PANEL + HALF * h, sf);
        for (int m = 0; m < mr; m++)
            f[m] = _mm256_fmadd_ps(
                _mm256_mul_ps(_mm256_cvtepi32_ps(acc[m]), _mm256_set1_ps(xs[(long)m * KB + b])),
                sv, f[m]);
        if (zp && (b + 1) % bpg == 0) {
            const int g = b / bpg;
            const __m256 zv = zeros8(zp, sp, (long)g * PANEL + HALF * h, sf);
            for (int m = 0; m < mr; m++)
                f[m] = _mm256_fmadd_ps(_mm256_set1_ps(xsg[(long)m * a->G + g]), zv, f[m]);
        }
    }
    const int hc = nc - HALF * h; /* valid columns in this half */
    if (hc <= 0) return;
    for (int m = 0; m < mr; m++) {
        float t[HALF];
        _mm256_storeu_ps(t, f[m]);
        store_row(t, hc < HALF ? hc : HALF, out, (long)(m0 + m) * N + n0 + HALF * h, xdtype);
    }
}

static void panel(const acts *a, int M, int bits, int bpg, const uint8_t *wp, const void *sp,
                  const void *zp, int sf, void *out, long N, long n0, int nc, int xdtype) {
#define TILE(r) tile(r, a, m0, bits, bpg, wp, sp, zp, sf, h, out, N, n0, nc, xdtype)
    for (int h = 0; h < 2 && HALF * h < nc; h++) {
        int m0 = 0;
        for (; m0 + MR <= M; m0 += MR) TILE(MR);
        switch (M - m0) {
        case 3: TILE(3); break;
        case 2: TILE(2); break;
        case 1: TILE(1); break;
        default: break;
        }
    }
#undef TILE
}

#else
#define ISA 0
/* portable: one row and panel at a time, the same integer sums and float steps */
static inline float scale1(const void *sp, long i, int sf) {
    const uint16_t h = sf ? ((const uint16_t *)sp)[i] : 0;
    return sf == 0 ? ((const float *)sp)[i] : sf == 1 ? f16_to_f32(h) : bf16_to_f32(h);
}

static void panel(const acts *a, int M, int bits, int bpg, const uint8_t *wp, const void *sp,
                  const void *zp, int sf, void *out, long N, long n0, int nc, int xdtype) {
    const int K = a->K, KB = a->KB;
    for (int m = 0; m < M; m++) {
        float f[PANEL] = {0};
        for (int b = 0; b < KB; b++) {
            const int8_t *xb = a->xq + (long)m * K + (long)b * QB;
            const float xs = a->xs[(long)m * KB + b];
            const long s = (long)(b / bpg) * PANEL;
            for (int c = 0; c < PANEL; c++) {
                int32_t acc = a->xo[(long)m * KB + b];
                if (bits == 4) {
                    const uint8_t *w = wp + (long)b * 256 + 4 * c;
                    for (int t = 0; t < 4; t++)
                        for (int i = 0; i < 4; i++) {
                            const uint8_t u = w[64 * t + i];
                            acc += (u & 15) * xb[8 * t + i] + (u >> 4) * xb[8 * t + 4 + i];
                        }
                } else {
                    const uint8_t *w = wp + (long)b * 512 + 4 * c;
                    for (int t = 0; t < 8; t++)
                        for (int i = 0; i < 4; i++) acc += w[64 * t + i] * xb[4 * t + i];
                }
                f[c] += (float)acc * xs * scale1(sp, s + c, sf);
            }
            if (zp && (b + 1) % bpg == 0) {
                const int g = b / bpg;
                for (int c = 0; c < PANEL; c++) {
                    const long i = (long)g * PANEL + c;
                    const float z = sf == 1 ? scale1(zp, i, 1) + 8.f * scale1(sp, i, 1)
                                            : scale1(zp, i, sf);
                    f[c] += a->xsg[(long)m * a->G + g] * z;
                }
            }
        }
        store_row(f, nc, out, (long)m * N + n0, xdtype);
    }
}
#endif

/* Where a thread's next pair of panels is prefetched to while it computes this one: 1 = L1
 * (prefetcht0), 2 = L2 (prefetcht2). Which streams faster depends on the CPU (2-core AMD EPYC Zen
 * 4, the default model's 121 projections at 1 row from DRAM: L2 3.4-3.7 ms, L1 4.4-4.7), so
 * common.kernels.prefetch measures both at an engine's start and sets the faster. Kept, unused,
 * in the sections without pair tiles. */
static int pair_prefetch = 1;

/* Returns 0, or 1 for a level other than 1 or 2. */
int qgemm_set_prefetch(int level) {
    if (level != 1 && level != 2) return 1;
    pair_prefetch = level;
    return 0;
}

/* The level in force. */
int qgemm_prefetch(void) { return pair_prefetch; }

/* Rows of x per pass over a thread's panels (0: chosen from the L2 cache's size). Each panel's
 * tile walks all the rows it is given, so past a few hundred rows (a prefill) their int8 codes
 * no longer stay in L2 from one panel to the next and are read from L3 or memory again for
 * every panel: measured on a 2-core AMD EPYC (Zen 4, 1 MiB L2), the default model's fused
 * gate/up at 8,192 rows ran at 304 GOP/s against 562 at 192. Passes of `row_block` rows keep a
 * pass's codes in L2 and each thread's panels (the same ones in every pass: one static
 * schedule) in L2 beside them. The per-row sums are the same whatever the passes: the same
 * bits. */
static int row_block_set = 0;

/* Returns 0, or 1 for a negative count. */
int qgemm_set_row_block(int rows) {
    if (rows < 0) return 1;
    row_block_set = rows;
    return 0;
}

/* L2's size in bytes (sysconf's; 1 MiB where it does not say), asked once: qgemm_a8 runs ~120
 * times a decode step, and a sysconf may execute cpuid, which a VM traps */
static long l2_bytes(void) {
    static long l2 = 0; /* a race writes the same value */
    if (l2 == 0) {
        long size = 0;
#ifdef _SC_LEVEL2_CACHE_SIZE
        size = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
        l2 = size > 0 ? size : 1L << 20;
    }
    return l2;
}

/* The rows of one pass for x of K columns: as set, or the rows whose codes and scalars fill a
 * quarter of L2, at least 48. */
int qgemm_row_block(int K) {
    if (row_block_set) return row_block_set;
    const long l2 = l2_bytes();
    const long per_row = K + (long)sizeof(float) * (3 * (K / QB)); /* xq, xs, xo, xsg */
    const long rows = l2 / 4 / per_row;
    return rows < 48 ? 48 : rows > (1 << 20) ? 1 << 20 : (int)rows;
}

/* Which section this build runs: 4 AMX (with AVX-512 VNNI for the rows past whole tiles), 3
 * AVX-512 VNNI, 2 AVX-VNNI, 1 AVX2, 0 portable. */
int qgemm_isa(void) {
#ifdef AMX_ROWS
    if (amx_ok) return 4;
#endif
    return ISA;
}

/* How many of M rows this build's qgemm_a8 runs through AMX tiles (0 without AMX). */
int qgemm_amx_rows(int M) {
#ifdef AMX_ROWS
    if (amx_ok && M >= AMX_MIN_ROWS) return M - M % AMX_ROWS;
#endif
    return 0;
}

/* One call's shapes, weight, output and quantized activations: what its threads share. */
typedef struct {
    acts a; /* all M rows */
    int M, K, N, bits, gs, sf, xdtype;
    int Mw; /* rows [0, Mw) by whole AMX tiles (0 without AMX), [Mw, M) by the vector tiles */
    const uint8_t *codes;
    const void *scale, *zero;
    void *out;
#ifdef AMX_ROWS
    acts t;          /* the AMX rows' codes and scalars regrouped by tile */
    int8_t *scratch; /* per thread: a panel's signed codes as tile rows */
    size_t own;      /* bytes of scratch per thread */
#endif
} a8call;

/* 1 for shapes qgemm_a8 does not take (K or gs not a multiple of 32, float16 minimums with an
 * int8 zero, an unknown sf), else 0. */
static int a8_unsupported(int M, int K, int N, int bits, int gs, int sf, const void *zero) {
    return M < 0 || K <= 0 || N < 0 || gs <= 0 || K % QB || gs % QB || K % gs ||
           (bits != 4 && bits != 8) || (sf == 1 && zero && bits != 4) || sf < 0 || sf > 2;
}

/* The bytes of the quantized activations of M rows of K columns (groups of gs). */
static size_t acts_bytes(int M, int K, int gs) {
    return (size_t)M * K + sizeof(float) * (size_t)M * (2 * (K / QB) + K / gs);
}

/* The quantized activations' arrays for M rows, laid out in buf (acts_bytes of it). */
static acts acts_in(void *buf, int M, int K, int gs) {
    acts a = {.K = K, .KB = K / QB, .G = K / gs};
    a.xs = (float *)buf;
    a.xo = (int32_t *)(a.xs + (size_t)M * a.KB);
    a.xsg = (float *)(a.xo + (size_t)M * a.KB);
    a.xq = (int8_t *)(a.xsg + (size_t)M * a.G);
    return a;
}

/* Thread tid of nth's share of a call: its units (panels, or pairs of them) over every pass of
 * rows, the same units in each; no barrier. *col0, *col1 (where not NULL): the output columns
 * its units wrote. */
static void a8_share(const a8call *c, int tid, int nth, long *col0, long *col1) {
    const acts a = c->a;
    const int M = c->M, K = c->K, N = c->N, bits = c->bits, sf = c->sf, xdtype = c->xdtype;
    const int Mw = c->Mw, Mr = M - Mw;
    const int P = (N + PANEL - 1) / PANEL, G = a.G, bpg = c->gs / QB;
    const long panel_bytes = (long)K * PANEL * bits / 8;
    const uint8_t *codes = c->codes;
    const void *scale = c->scale, *zero = c->zero;
    const int rb = qgemm_row_block(K);
    acts r = a; /* the rows past the whole tiles */
    r.xq += (long)Mw * K, r.xs += (long)Mw * a.KB, r.xo += (long)Mw * a.KB;
    r.xsg += (long)Mw * G;
    void *out_r = (char *)c->out + (size_t)Mw * N * (xdtype == 0 ? 4 : 2);
#ifdef PAIR_MIN_ROWS
    /* whole panels two at a time (the last, or a partial one, alone) */
    const int step = Mr >= PAIR_MIN_ROWS ? 2 : 1, units = (P + step - 1) / step;
#else
    const int step = 1, units = P;
#endif
    int u0, u1;
    static_share(units, tid, nth, &u0, &u1);
    if (col0) *col0 = (long)u0 * step * PANEL < N ? (long)u0 * step * PANEL : N;
    if (col1) *col1 = (long)u1 * step * PANEL < N ? (long)u1 * step * PANEL : N;
#ifdef AMX_ROWS
    int8_t *wb_own = c->scratch ? c->scratch + tid * c->own : NULL;
    if (Mw) amx_configure();
#endif
    /* rows [Mw, M) in passes of rb (the AMX rows in the first); each thread has the same units
     * in every pass, and no two write the same outputs */
    for (int c0 = 0; c0 == 0 || c0 < Mr; c0 += rb) {
        const int mc = Mr - c0 < rb ? Mr - c0 : rb;
        acts rc = r;
        rc.xq += (long)c0 * K, rc.xs += (long)c0 * a.KB, rc.xo += (long)c0 * a.KB;
        rc.xsg += (long)c0 * G;
        void *out_c = (char *)out_r + (size_t)c0 * N * (xdtype == 0 ? 4 : 2);
        for (int u = u0; u < u1; u++) {
            const int p = u * step;
#ifdef AMX_ROWS
            for (int q = p; Mw && !c0 && q < p + step && q < P; q++) {
                const long nq = (long)q * PANEL;
                amx_unpack(codes + q * panel_bytes, a.KB, bits, wb_own);
                amx_panel(&c->t, Mw, bpg, wb_own, scale_at(scale, nq * G, sf),
                          zero ? scale_at(zero, nq * G, sf) : NULL, sf, c->out, N, nq,
                          N - nq < PANEL ? (int)(N - nq) : PANEL, xdtype);
            }
#endif
            if (!mc) continue;
#ifdef PAIR_MIN_ROWS
            const long n0 = (long)p * PANEL;
            if (step == 2 && N - n0 >= 2 * PANEL) {
                /* the pair after this one (this thread's next unit: the static schedule gives
                 * each thread consecutive ones) is asked for while this one computes: at 2-16
                 * rows a pair's sums take about as long as streaming its weight, and without
                 * the prefetch the two added up (measured, default model, 2 threads, 256 tokens
                 * of context: a 5-row verify step 5.9-6.9 -> 4.9-6.1 ms, an 8-row one 8.4-9.8
                 * -> 6.1-6.3, a batch-16 decode step 13.4-14.8 -> 11.2-11.9; batch 1 and 64
                 * within noise); into L1 or L2 as qgemm_set_prefetch said */
                const int pf_next = N - n0 >= 4 * PANEL ? pair_prefetch : 0;
                panel_pair(&rc, mc, bits, bpg, codes + p * panel_bytes, panel_bytes,
                           scale_at(scale, (long)p * G * PANEL, sf),
                           zero ? scale_at(zero, (long)p * G * PANEL, sf) : NULL, sf,
                           (long)G * PANEL, out_c, N, n0, xdtype, pf_next);
                continue;
            }
#endif
            for (int q = p; q < p + step && q < P; q++) {
                const long nq = (long)q * PANEL;
                const int nc = N - nq < PANEL ? (int)(N - nq) : PANEL;
                panel(&rc, mc, bits, bpg, codes + q * panel_bytes,
                      scale_at(scale, (long)q * G * PANEL, sf),
                      zero ? scale_at(zero, (long)q * G * PANEL, sf) : NULL, sf, out_c, N, nq,
                      nc, xdtype);
            }
        }
    }
#ifdef AMX_ROWS
    if (Mw) _tile_release();
#endif
}

/* x_in [M, K] (row stride x_stride) times the packed weight (codes, scale, zero or NULL as in the
 * header; sf: their format there) -> out_ [M, N]. 1: shapes not supported (a8_unsupported), 2:
 * no memory. */
int qgemm_a8(const void *x_in, long x_stride, int xdtype, int M, int K, int N, int bits, int gs,
             const uint8_t *codes, const void *scale, const void *zero, int sf, void *out,
             int nthreads) {
    if (a8_unsupported(M, K, N, bits, gs, sf, zero)) return 1;
    if (M == 0 || N == 0) return 0;
    char *buf = malloc(acts_bytes(M, K, gs));
    if (!buf) return 2;
    a8call c = {.a = acts_in(buf, M, K, gs), .M = M, .K = K, .N = N, .bits = bits, .gs = gs,
                .sf = sf, .xdtype = xdtype, .Mw = qgemm_amx_rows(M), .codes = codes,
                .scale = scale, .zero = zero, .out = out};
    quantize_x(x_in, x_stride, xdtype, M, gs, bits == 4 ? 8 : 128, &c.a, nthreads);
#ifdef AMX_ROWS
    char *regrouped = NULL;
    c.scratch = NULL, c.own = (size_t)K * PANEL, c.t = c.a;
    if (c.Mw) {
        const int Mw = c.Mw;
        regrouped =
            aligned_alloc(64, (size_t)Mw * K + sizeof(float) * (size_t)Mw * (c.a.KB + c.a.G));
        c.scratch = aligned_alloc(64, (size_t)nthreads * c.own);
        if (!regrouped || !c.scratch) {
            free(regrouped), free(c.scratch), free(buf);
            return 2;
        }
        c.t.xq = (int8_t *)regrouped;
        c.t.xs = (float *)(regrouped + (size_t)Mw * K);
        c.t.xsg = c.t.xs + (size_t)Mw * c.a.KB;
        amx_regroup(&c.a, &c.t, Mw);
    }
#endif
#pragma omp parallel num_threads(nthreads)
    {
#ifdef _OPENMP
        a8_share(&c, omp_get_thread_num(), omp_get_num_threads(), NULL, NULL);
#else
        a8_share(&c, 0, 1, NULL, NULL);
#endif
    }
#ifdef AMX_ROWS
    free(c.scratch), free(regrouped);
#endif
    free(buf);
    return 0;
}

/* For decode_layer.c's threads, which run a whole step in one parallel region (its "team"):
 * qgemm_a8 in parts, with no region of its own and no barrier. The vector tiles only (no AMX
 * rows: the team runs where qgemm_amx_rows is 0); the same sums, so the same bits. */

/* 1 where qgemm_a8 cannot take these shapes with M rows through the vector tiles alone,
 * else 0. */
int qgemm_a8_team_unsupported(int M, int K, int N, int bits, int gs, int sf, const void *zero) {
    return a8_unsupported(M, K, N, bits, gs, sf, zero) || qgemm_amx_rows(M) != 0;
}

/* Bytes of the buffer that M rows of K columns quantize into (groups of gs). */
long qgemm_a8_bytes(int M, int K, int gs) { return (long)acts_bytes(M, K, gs); }

/* Rows [m0, m1) of x_in [M, K] quantized into buf (qgemm_a8_bytes of it, laid out for M rows),
 * on the calling thread. */
void qgemm_a8_quantize(const void *x_in, long x_stride, int xdtype, int M, int K, int bits,
                       int gs, void *buf, int m0, int m1) {
    acts a = acts_in(buf, M, K, gs);
    for (int m = m0; m < m1; m++)
        quantize_row(x_in, x_stride, xdtype, m, gs, bits == 4 ? 8 : 128, &a);
}

/* Thread tid of nth's panels of out [M, N] = (buf's quantized x) @ W.T, as qgemm_a8's thread
 * tid would compute them; *col0, *col1: the columns it wrote. The caller's barrier follows. */
void qgemm_a8_part(const void *buf, int xdtype, int M, int K, int N, int bits, int gs,
                   const uint8_t *codes, const void *scale, const void *zero, int sf, void *out,
                   int tid, int nth, long *col0, long *col1) {
    const a8call c = {.a = acts_in((void *)buf, M, K, gs), .M = M, .K = K, .N = N, .bits = bits,
                      .gs = gs, .sf = sf, .xdtype = xdtype, .Mw = 0, .codes = codes,
                      .scale = scale, .zero = zero, .out = out};
    a8_share(&c, tid, nth, col0, col1);
}
