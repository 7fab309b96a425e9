/* Weight-only quantized matmul for the CPU path: out[M, N] = x[M, K] @ W.T with W stored as int4
 * (group-wise scale and zero) or int8 (group-wise or per-channel scale), the format of
 * common/model/quant.py. float32 accumulation, OpenMP over output columns. Compiled on first use
 * by common/kernels/cpu_quant.py; entry point `quant_matmul` (at the end).
 *
 * For a group g of row n with codes q_j, scale s and zero z:
 *   int4: sum_j x_j * ((q_j - 8) s + z) = s * sum_j x_j q_j + (z - 8 s) * sum_j x_j
 *   int8: sum_j x_j * (q_j s + z)       = s * sum_j x_j q_j + z * sum_j x_j
 * M = 1 (single-stream decode, the latency case) uses that form: a plain dot per group, the scale
 * applied once per group, the zero point through the group's sum of x: gemv4 (int4, groups of 32
 * or a multiple of 64: two output columns per pass, 64 weights per load, see there) and gemv8
 * (int8), with their own copy of x; other int4 groups take column1_avx2. M > 1 dequantizes each
 * group in registers once (w = q s + zc) and multiplies it into 8 (or 4, 2) rows of x at a time.
 * The entry point first copies x to float32, reordering each int4 group as [even columns | odd
 * columns] to match the packed bytes (low nibble = column 2j, high nibble = column 2j+1), and
 * computes the per-group sums; without AVX2 a portable loop computes the same.
 *
 * Layouts: x [M, K] float32/bfloat16 with row stride; qweight uint8 [N, K/2] or int8 [N, K];
 * scale, zero [N, G] float32 (sdtype 0) or bfloat16 (sdtype 1), zero may be NULL; out [M, N] in
 * x's dtype.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vecmath.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define MAX_M 16 /* rows per pass of the portable (non-AVX2) loop */

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

#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One output column n for rows m0..m0+mc (mc <= 8): each group's weights are dequantized in
 * registers (w = q*s + zc, zc = z - 8s for int4) and multiplied into every row's accumulator. */
static inline __attribute__((always_inline)) void column_avx2(const float *x, int m0, int mc, int K, int G, int gs, int bits,
                        const uint8_t *qrow, const void *scale, const void *zero, int sdtype,
                        long sidx, float *out, long N, int n) {
    __m256 acc[8];
    for (int m = 0; m < mc; m++) acc[m] = _mm256_setzero_ps();
    const __m128i low4 = _mm_set1_epi8(0x0F);
    for (int g = 0; g < G; g++) {
        const float s = load_s(scale, sidx + g, sdtype);
        const float z = zero ? load_s(zero, sidx + g, sdtype) : 0.0f;
        const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(bits == 4 ? z - 8.0f * s : z);
        const long xoff = (long)g * gs;
        if (bits == 4) {
            const uint8_t *q = qrow + (long)g * (gs / 2);
            const int half = gs / 2;
            for (int h = 0; h < half; h += 16) {
                __m128i b = _mm_loadu_si128((const __m128i *)(q + h));
                __m128i lo = _mm_and_si128(b, low4);
                __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
                __m256 w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), vs, vz);
                __m256 w1 = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), vs, vz);
                __m256 w2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), vs, vz);
                __m256 w3 = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), vs, vz);
                for (int m = 0; m < mc; m++) {
                    const float *xe = x + (long)(m0 + m) * K + xoff + h;
                    const float *xo = xe + half;
                    __m256 a = acc[m];
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(xe), w0, a);
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(xe + 8), w1, a);
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(xo), w2, a);
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(xo + 8), w3, a);
                    acc[m] = a;
                }
            }
        } else {
            const int8_t *q = (const int8_t *)qrow + xoff;
            for (int j = 0; j < gs; j += 8) {
                __m128i b = _mm_loadl_epi64((const __m128i *)(q + j));
                __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), vs, vz);
                for (int m = 0; m < mc; m++)
                    acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (long)(m0 + m) * K + xoff + j), w,
                                             acc[m]);
            }
        }
    }
    for (int m = 0; m < mc; m++) out[(long)(m0 + m) * N + n] = hsum(acc[m]);
}

/* M = 1: per group, t = sum_j x_j q_j (two independent chains), then acc += s * t and the
 * zero point's share zc * sum_j x_j as a scalar: 5 float ops per 32 weights instead of 8. */
static float column1_avx2(const float *x, const float *xsum, int G, int gs, int bits,
                          const uint8_t *qrow, const void *scale, const void *zero, int sdtype,
                          long sidx) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    float zterm = 0.0f;
    const __m128i low4 = _mm_set1_epi8(0x0F);
    for (int g = 0; g < G; g++) {
        const float s = load_s(scale, sidx + g, sdtype);
        const float z = zero ? load_s(zero, sidx + g, sdtype) : 0.0f;
        zterm += (bits == 4 ? z - 8.0f * s : z) * xsum[g];
        const __m256 vs = _mm256_set1_ps(s);
        const float *xg = x + (long)g * gs;
        __m256 t0 = _mm256_setzero_ps(), t1 = t0;
        if (bits == 4) {
            const uint8_t *q = qrow + (long)g * (gs / 2);
            const int half = gs / 2;
            for (int h = 0; h < half; h += 16) {
                __m128i b = _mm_loadu_si128((const __m128i *)(q + h));
                __m128i lo = _mm_and_si128(b, low4);
                __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
                __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
                __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
                __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
                __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
                t0 = _mm256_fmadd_ps(_mm256_loadu_ps(xg + h), w0, t0);
                t1 = _mm256_fmadd_ps(_mm256_loadu_ps(xg + half + h), w2, t1);
                t0 = _mm256_fmadd_ps(_mm256_loadu_ps(xg + h + 8), w1, t0);
                t1 = _mm256_fmadd_ps(_mm256_loadu_ps(xg + half + h + 8), w3, t1);
            }
        } else {
            const int8_t *q = (const int8_t *)qrow + (long)g * gs;
            int j = 0;
            for (; j + 16 <= gs; j += 16) {
                __m256 w0 = _mm256_cvtepi32_ps(
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + j))));
                __m256 w1 = _mm256_cvtepi32_ps(
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + j + 8))));
                t0 = _mm256_fmadd_ps(_mm256_loadu_ps(xg + j), w0, t0);
                t1 = _mm256_fmadd_ps(_mm256_loadu_ps(xg + j + 8), w1, t1);
            }
            for (; j < gs; j += 8) {
                __m256 w = _mm256_cvtepi32_ps(
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + j))));
                t0 = _mm256_fmadd_ps(_mm256_loadu_ps(xg + j), w, t0);
            }
        }
        a0 = _mm256_fmadd_ps(t0, vs, a0);
        a1 = _mm256_fmadd_ps(t1, vs, a1);
    }
    return hsum(_mm256_add_ps(a0, a1)) + zterm;
}

/* ---- M = 1, int4, group 32 or a multiple of 64: several output columns per pass ----
 * The packed row is read 32 bytes (64 weights, a "chunk") at a time as 8 dwords; dword i holds
 * columns 64c + 8i + k, k = 0..7, as nibble k. Nibble k is isolated in place with one AND
 * (v & 0xF << 4k, converted to float: q * 2^4k exactly; k = 7 is shifted down instead, as its
 * top bit would make the int32 negative), and x is pre-scaled by 2^-4k to match, so the product
 * is x*q rounded once as before. Lane i then holds the partial dot of 8 columns of one group
 * (group 32: lanes 0-3 the chunk's first group, 4-7 its second), started at -8 * (those 8
 * columns' sum of x) so it is sum x (q - 8); the lane's scale is applied with one vector FMA per
 * chunk. The zero point's share, sum_g z_g * sum_{j in g} x_j, is a vector dot over groups.
 * GEMV4_ROWS columns run together, each over GEMV4_CHAINS accumulators (independent FMA chains;
 * x is loaded once for all rows), prefetching GEMV4_PF blocks ahead (K = 1536 rows streamed at
 * 2/3 the speed without it). 3 vector ops per 8 weights (and, cvt, fma): about 10 cycles per 64
 * weights and row here, ~2x the old loop; rows/chains 2x2, 3x2, 4x1 measured within noise.
 * Pre-scaling x by 2^-24 loses precision only for |x| < 2^-102 (subnormal after scaling).
 * xp per chunk: 8 vectors x[64c + 8i + k] * 2^-4k (k = 0..7), then -8 * lane sums: 72 floats. */
#define XP_CHUNK 72

static inline __m256 scale_vec(const void *scale, long base, int c, int gs, int sdtype) {
    if (gs == 32) {
        /* lanes 0-3: group 2c, lanes 4-7: group 2c + 1 */
        if (sdtype == 0) {
            int64_t u;
            memcpy(&u, (const float *)scale + base + 2 * c, 8);
            return _mm256_permutevar_ps(_mm256_castsi256_ps(_mm256_set1_epi64x(u)),
                                        _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
        }
        int32_t u;
        memcpy(&u, (const uint16_t *)scale + base + 2 * c, 4);
        __m256i p = _mm256_set1_epi32(u);
        return _mm256_castsi256_ps(_mm256_shuffle_epi8(
            p, _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 0, 1, -1, -1, 0, 1, -1, -1, 0, 1, -1, -1, 2,
                                3, -1, -1, 2, 3, -1, -1, 2, 3, -1, -1, 2, 3)));
    }
    return _mm256_set1_ps(load_s(scale, base + (long)c * 64 / gs, sdtype));
}

/* the last half chunk (group 32 with an odd group count): lanes 4-7 are zero */
static inline __m256 scale_vec_half(const void *scale, long base, int c, int sdtype) {
    __m128 s = _mm_set1_ps(load_s(scale, base + 2 * c, sdtype));
    return _mm256_zextps128_ps256(s);
}

/* sum_g z_g * xsum_g over one row's G groups */
static inline float zdot(const void *zero, long base, const float *xsum, int G, int sdtype) {
    __m256 a = _mm256_setzero_ps();
    int g = 0;
    if (sdtype == 0) {
        for (; g + 8 <= G; g += 8)
            a = _mm256_fmadd_ps(_mm256_loadu_ps((const float *)zero + base + g),
                                _mm256_loadu_ps(xsum + g), a);
    } else {
        for (; g + 8 <= G; g += 8) {
            __m256i h = _mm256_cvtepu16_epi32(
                _mm_loadu_si128((const __m128i *)((const uint16_t *)zero + base + g)));
            a = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(h, 16)),
                                _mm256_loadu_ps(xsum + g), a);
        }
    }
    float r = hsum(a);
    for (; g < G; g++) r += load_s(zero, base + g, sdtype) * xsum[g];
    return r;
}

#ifndef GEMV4_CHAINS
#define GEMV4_CHAINS 2
#endif
#ifndef GEMV4_PF
#define GEMV4_PF 2
#endif
/* gemv4i's prefetch distance in blocks of GEMV4_ROWS rows: 6 measured 0-10% ahead of 2 at the
 * default model's shapes, within noise of 4-16; gemv8i's in bytes along its one row */
#ifndef GEMV4I_PF
#define GEMV4I_PF 6
#endif
#define GEMV8I_AHEAD 4096
#ifndef GEMV4_ROWS
#define GEMV4_ROWS 2
#endif

/* one chunk of R rows: t[r] = lane partials of row r, started from init */
static inline __attribute__((always_inline)) void gemv4_chunk(const __m256i *v, const float *xc,
                                                              int R, __m256 *t) {
    __m256 u[GEMV4_CHAINS][GEMV4_ROWS];
    const __m256 init = _mm256_loadu_ps(xc + 64);
    for (int r = 0; r < R; r++) {
        u[0][r] = init;
        for (int h = 1; h < GEMV4_CHAINS; h++) u[h][r] = _mm256_setzero_ps();
    }
    __m256i mask = _mm256_set1_epi32(0xF);
    for (int k = 0; k < 8; k++) {
        __m256 xk = _mm256_loadu_ps(xc + 8 * k);
        __asm__("" : "+x"(xk));
        for (int r = 0; r < R; r++) {
            const __m256i q = k < 7 ? _mm256_and_si256(v[r], mask) : _mm256_srli_epi32(v[r], 28);
            u[k % GEMV4_CHAINS][r] =
                _mm256_fmadd_ps(xk, _mm256_cvtepi32_ps(q), u[k % GEMV4_CHAINS][r]);
        }
        mask = _mm256_slli_epi32(mask, 4);
    }
    for (int r = 0; r < R; r++) {
        __m256 a = u[0][r];
        for (int h = 1; h < GEMV4_CHAINS; h++) a = _mm256_add_ps(a, u[h][r]);
        t[r] = a;
    }
}

static inline __attribute__((always_inline)) void gemv4_rows(
    const float *xp, const float *xsum, int K, int G, int gs, const uint8_t *q0, long row_bytes,
    const void *scale, const void *zero, int sdtype, long n, int R, float *out) {
    const int C = K / 64;
    __m256 acc[GEMV4_ROWS], t[GEMV4_ROWS];
    __m256i v[GEMV4_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const long ahead = (long)GEMV4_PF * GEMV4_ROWS * row_bytes;
    for (int c = 0; c < C; c++) {
        if (GEMV4_PF && !(c & 1))
            for (int r = 0; r < R; r++)
                _mm_prefetch((const char *)(q0 + r * row_bytes + (long)c * 32 + ahead),
                             _MM_HINT_T0);
        for (int r = 0; r < R; r++)
            v[r] = _mm256_loadu_si256((const __m256i *)(q0 + r * row_bytes + (long)c * 32));
        gemv4_chunk(v, xp + (long)c * XP_CHUNK, R, t);
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(t[r], scale_vec(scale, (n + r) * G, c, gs, sdtype), acc[r]);
    }
    if (K % 64) { /* group 32, odd group count: the last group fills lanes 0-3 */
        for (int r = 0; r < R; r++)
            v[r] = _mm256_zextsi128_si256(
                _mm_loadu_si128((const __m128i *)(q0 + r * row_bytes + (long)C * 32)));
        gemv4_chunk(v, xp + (long)C * XP_CHUNK, R, t);
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(t[r], scale_vec_half(scale, (n + r) * G, C, sdtype), acc[r]);
    }
    for (int r = 0; r < R; r++) {
        float o = hsum(acc[r]);
        if (zero) o += zdot(zero, (n + r) * G, xsum, G, sdtype);
        out[n + r] = o;
    }
}

/* blocks [b0, b1) of GEMV4_ROWS columns, then (last == 1) the N % GEMV4_ROWS left over; inlined
 * with constant gs (32 or not) and sdtype so each copy's loops carry no format branches */
static inline __attribute__((always_inline)) void gemv4_range(
    const float *xp, const float *xsum, int K, int N, int gs, const uint8_t *qweight,
    const void *scale, const void *zero, int sdtype, float *out, int b0, int b1, int last) {
    const int G = K / gs;
    const long row_bytes = K / 2;
    for (int b = b0; b < b1; b++) {
        const long n = (long)b * GEMV4_ROWS;
        gemv4_rows(xp, xsum, K, G, gs, qweight + n * row_bytes, row_bytes, scale, zero, sdtype,
                   n, GEMV4_ROWS, out);
    }
    if (last)
        for (long n = (long)(N / GEMV4_ROWS) * GEMV4_ROWS; n < N; n++)
            gemv4_rows(xp, xsum, K, G, gs, qweight + n * row_bytes, row_bytes, scale, zero,
                       sdtype, n, 1, out);
}

static void store_bf16(const float *src, uint16_t *dst, long n0, long n1);

/* This thread's share of NB blocks, [b0, b1); last: it also takes the columns past the blocks. */
static inline void thread_blocks(int NB, int *b0, int *b1, int *last) {
    int nt = 1, id = 0;
#ifdef _OPENMP
    nt = omp_get_num_threads();
    id = omp_get_thread_num();
#endif
    *b0 = (int)((long)NB * id / nt);
    *b1 = (int)((long)NB * (id + 1) / nt);
    *last = id == nt - 1;
}

/* out (float32 scratch) columns [n0, n1) -> out_ in xdtype */
static inline void write_columns(const float *out, void *out_, int xdtype, long n0, long n1) {
    if (xdtype == 0)
        memcpy((float *)out_ + n0, out + n0, sizeof(float) * (n1 - n0));
    else
        store_bf16(out, (uint16_t *)out_, n0, n1);
}

/* out (float32 scratch [N]) -> out_ in xdtype, each thread its own columns */
static void gemv4(const float *xp, const float *xsum, int K, int N, int gs, const uint8_t *qweight,
                  const void *scale, const void *zero, int sdtype, float *out, void *out_,
                  int xdtype, int nthreads) {
    const int NB = N / GEMV4_ROWS;
    if (nthreads > NB) nthreads = NB > 0 ? NB : 1;
    /* the OpenMP region is outlined before inlining, so the format is dispatched inside it */
#pragma omp parallel num_threads(nthreads)
    {
        int b0, b1, last;
        thread_blocks(NB, &b0, &b1, &last);
        if (gs == 32 && sdtype == 0)
            gemv4_range(xp, xsum, K, N, 32, qweight, scale, zero, 0, out, b0, b1, last);
        else if (gs == 32)
            gemv4_range(xp, xsum, K, N, 32, qweight, scale, zero, 1, out, b0, b1, last);
        else if (sdtype == 0)
            gemv4_range(xp, xsum, K, N, gs, qweight, scale, zero, 0, out, b0, b1, last);
        else
            gemv4_range(xp, xsum, K, N, gs, qweight, scale, zero, 1, out, b0, b1, last);
        write_columns(out, out_, xdtype, (long)b0 * GEMV4_ROWS, last ? N : (long)b1 * GEMV4_ROWS);
    }
}

/* ---- M = 1, int4, bfloat16 activations: x as 16-bit fixed point, products summed in int32 ----
 * The float kernel above is bound by its and/convert/FMA per 8 weights. With bfloat16 x, each
 * 32 columns of x are written as int16 times a power of two, sx = 2^(e - 15) with 2^e above the
 * block's largest |x|. A bfloat16 has 8 significant bits, so every x within 2^7 of the block's
 * largest is exact; smaller ones are rounded to a multiple of sx (off by at most 2^-15 of the
 * largest, 64x below bfloat16's own rounding of it, 2^-9). Products and sums are exact in int32
 * and converted exactly (|lane sum| < 8 * 15 * 2^15 < 2^24), so for blocks of ordinary range the
 * result is the float kernel's up to the order of the float additions. A chunk (64 weights) is
 * 4 shift/and, 4 vpmaddwd (int16 pairs into int32) and 3 adds per row, with one convert and two
 * FMAs: t = sx * isum - 8 * lane sum of x, acc += scale * t. Lanes map to groups as in gemv4.
 * 15-20% faster than gemv4 at the default model's shapes; float32 activations keep the float
 * kernel (they have 24 significant bits).
 * xq per chunk: 4 vectors of 16 int16, X_k[i] = x16[64c + 4i + k] (nibble k of 16-bit lane i);
 * xs per chunk: sx lanes (block 2c x4, block 2c + 1 x4), then -8 * lane sums of x. */
#define XQ_CHUNK 64
#define XS_CHUNK 16

/* 32 values of x as int16 q times the returned power of two sx = 2^(e - 15), 2^e above the
 * largest |x|: |q| < 2^15 (the floor on e keeps 1/sx finite; only blocks under 2^-113 get it).
 * inf or NaN in x (the sum carries a NaN the max skips) makes sx, and so the output, not finite. */
static float x16_block(const float *v, int16_t *q) {
    float m = 0.0f, s = 0.0f;
    for (int j = 0; j < 32; j++) {
        const float a = fabsf(v[j]);
        m = a > m ? a : m;
        s += v[j];
    }
    int e = 0;
    if (m > 0.0f && m <= FLT_MAX) frexpf(m, &e);
    if (e < -112) e = -112;
    const float inv = m > 0.0f && m <= FLT_MAX ? ldexpf(1.0f, 15 - e) : 0.0f;
    for (int j = 0; j < 32; j++) {
        float r = nearbyintf(v[j] * inv);
        r = r > 32767.0f ? 32767.0f : (r < -32767.0f ? -32767.0f : r);
        q[j] = (int16_t)(r == r ? r : 0.0f);
    }
    return (m <= FLT_MAX ? ldexpf(1.0f, e - 15) : NAN) + 0.0f * s;
}

static void gemv4i_prep_x(const float *x, int K, int16_t *xq, float *xs) {
    const int CT = (K + 63) / 64;
    for (int c = 0; c < CT; c++) {
        float v[64];
        int16_t q[64];
        for (int j = 0; j < 64; j++) v[j] = 64 * c + j < K ? x[64 * c + j] : 0.0f;
        for (int b = 0; b < 2; b++) {
            const float sx = x16_block(v + 32 * b, q + 32 * b);
            for (int l = 0; l < 4; l++) xs[(long)c * XS_CHUNK + 4 * b + l] = sx;
        }
        for (int i = 0; i < 16; i++)
            for (int k = 0; k < 4; k++) xq[(long)c * XQ_CHUNK + 16 * k + i] = q[4 * i + k];
        for (int l = 0; l < 8; l++) {
            float s = 0.0f;
            for (int j = 0; j < 8; j++) s += v[8 * l + j];
            xs[(long)c * XS_CHUNK + 8 + l] = -8.0f * s;
        }
    }
}

/* lane i (int32) of the result: sum over the 8 nibbles of dword i of q * x16 */
static inline __attribute__((always_inline)) __m256i nibble_dot(__m256i v, const int16_t *X) {
    const __m256i m = _mm256_set1_epi16(0xF);
    const __m256i *x = (const __m256i *)X;
    __m256i p = _mm256_madd_epi16(_mm256_and_si256(v, m), _mm256_loadu_si256(x));
    p = _mm256_add_epi32(p, _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), m),
                                              _mm256_loadu_si256(x + 1)));
    p = _mm256_add_epi32(p, _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 8), m),
                                              _mm256_loadu_si256(x + 2)));
    return _mm256_add_epi32(
        p, _mm256_madd_epi16(_mm256_srli_epi16(v, 12), _mm256_loadu_si256(x + 3)));
}

static inline __attribute__((always_inline)) void gemv4i_rows(
    const int16_t *xq, const float *xs, const float *xsum, int K, int G, int gs,
    const uint8_t *q0, long row_bytes, const void *scale, const void *zero, int sdtype, long n,
    int R, float *out) {
    const int C = K / 64;
    __m256 acc[GEMV4_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const long ahead = (long)GEMV4I_PF * GEMV4_ROWS * row_bytes;
    for (int c = 0; c < C; c++) {
        if (!(c & 1))
            for (int r = 0; r < R; r++)
                _mm_prefetch((const char *)(q0 + r * row_bytes + (long)c * 32 + ahead),
                             _MM_HINT_T0);
        const float *xc = xs + (long)c * XS_CHUNK;
        const __m256 sx = _mm256_loadu_ps(xc), m8 = _mm256_loadu_ps(xc + 8);
        for (int r = 0; r < R; r++) {
            const __m256i v =
                _mm256_loadu_si256((const __m256i *)(q0 + r * row_bytes + (long)c * 32));
            const __m256 t = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(nibble_dot(v, xq + (long)c * XQ_CHUNK)), sx, m8);
            acc[r] = _mm256_fmadd_ps(t, scale_vec(scale, (n + r) * G, c, gs, sdtype), acc[r]);
        }
    }
    if (K % 64) { /* group 32, odd group count: the last group fills lanes 0-3 */
        const float *xc = xs + (long)C * XS_CHUNK;
        const __m256 sx = _mm256_loadu_ps(xc), m8 = _mm256_loadu_ps(xc + 8);
        for (int r = 0; r < R; r++) {
            const __m256i v = _mm256_zextsi128_si256(
                _mm_loadu_si128((const __m128i *)(q0 + r * row_bytes + (long)C * 32)));
            const __m256 t = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(nibble_dot(v, xq + (long)C * XQ_CHUNK)), sx, m8);
            acc[r] = _mm256_fmadd_ps(t, scale_vec_half(scale, (n + r) * G, C, sdtype), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float o = hsum(acc[r]);
        if (zero) o += zdot(zero, (n + r) * G, xsum, G, sdtype);
        out[n + r] = o;
    }
}

static inline __attribute__((always_inline)) void gemv4i_range(
    const int16_t *xq, const float *xs, const float *xsum, int K, int N, int gs,
    const uint8_t *qweight, const void *scale, const void *zero, int sdtype, float *out, int b0,
    int b1, int last) {
    const int G = K / gs;
    const long row_bytes = K / 2;
    for (int b = b0; b < b1; b++) {
        const long n = (long)b * GEMV4_ROWS;
        gemv4i_rows(xq, xs, xsum, K, G, gs, qweight + n * row_bytes, row_bytes, scale, zero,
                    sdtype, n, GEMV4_ROWS, out);
    }
    if (last)
        for (long n = (long)(N / GEMV4_ROWS) * GEMV4_ROWS; n < N; n++)
            gemv4i_rows(xq, xs, xsum, K, G, gs, qweight + n * row_bytes, row_bytes, scale, zero,
                        sdtype, n, 1, out);
}

static void gemv4i(const int16_t *xq, const float *xs, const float *xsum, int K, int N, int gs,
                   const uint8_t *qweight, const void *scale, const void *zero, int sdtype,
                   float *out, void *out_, int nthreads) {
    const int NB = N / GEMV4_ROWS;
    if (nthreads > NB) nthreads = NB > 0 ? NB : 1;
#pragma omp parallel num_threads(nthreads)
    {
        int b0, b1, last;
        thread_blocks(NB, &b0, &b1, &last);
        if (gs == 32 && sdtype == 0)
            gemv4i_range(xq, xs, xsum, K, N, 32, qweight, scale, zero, 0, out, b0, b1, last);
        else if (gs == 32)
            gemv4i_range(xq, xs, xsum, K, N, 32, qweight, scale, zero, 1, out, b0, b1, last);
        else if (sdtype == 0)
            gemv4i_range(xq, xs, xsum, K, N, gs, qweight, scale, zero, 0, out, b0, b1, last);
        else
            gemv4i_range(xq, xs, xsum, K, N, gs, qweight, scale, zero, 1, out, b0, b1, last);
        write_columns(out, out_, 1, (long)b0 * GEMV4_ROWS, last ? N : (long)b1 * GEMV4_ROWS);
    }
}

/* ---- M = 1, int8 (groups a multiple of 8): GEMV4_ROWS columns per pass, as gemv4 ----
 * Per group and row: t = sum_j x_j q_j over two FMA chains (8 codes sign-extended and converted
 * per vector), then acc += s * t as a broadcast FMA; the zero point (if any) through zdot. */
static inline __attribute__((always_inline)) void gemv8_rows(
    const float *x, const float *xsum, int K, int G, int gs, const int8_t *q0, const void *scale,
    const void *zero, int sdtype, long n, int R, float *out) {
    __m256 acc[GEMV4_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const long ahead = (long)GEMV4_PF * GEMV4_ROWS * K;
    for (int g = 0; g < G; g++) {
        const long off = (long)g * gs;
        __m256 t0[GEMV4_ROWS], t1[GEMV4_ROWS];
        for (int r = 0; r < R; r++) t0[r] = t1[r] = _mm256_setzero_ps();
        int j = 0;
        for (; j + 16 <= gs; j += 16) {
            if (GEMV4_PF && !((off + j) & 63))
                for (int r = 0; r < R; r++)
                    _mm_prefetch((const char *)(q0 + (long)r * K + off + j + ahead), _MM_HINT_T0);
            const __m256 xa = _mm256_loadu_ps(x + off + j), xb = _mm256_loadu_ps(x + off + j + 8);
            for (int r = 0; r < R; r++) {
                const int8_t *q = q0 + (long)r * K + off + j;
                t0[r] = _mm256_fmadd_ps(
                    xa, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q))),
                    t0[r]);
                t1[r] = _mm256_fmadd_ps(
                    xb,
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)))),
                    t1[r]);
            }
        }
        if (j < gs) { /* gs % 16 == 8 */
            if (GEMV4_PF && !((off + j) & 63))
                for (int r = 0; r < R; r++)
                    _mm_prefetch((const char *)(q0 + (long)r * K + off + j + ahead), _MM_HINT_T0);
            const __m256 xa = _mm256_loadu_ps(x + off + j);
            for (int r = 0; r < R; r++)
                t0[r] = _mm256_fmadd_ps(
                    xa,
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                        _mm_loadl_epi64((const __m128i *)(q0 + (long)r * K + off + j)))),
                    t0[r]);
        }
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_add_ps(t0[r], t1[r]),
                                     _mm256_set1_ps(load_s(scale, (n + r) * G + g, sdtype)),
                                     acc[r]);
    }
    for (int r = 0; r < R; r++) {
        float o = hsum(acc[r]);
        if (zero) o += zdot(zero, (n + r) * G, xsum, G, sdtype);
        out[n + r] = o;
    }
}

static inline __attribute__((always_inline)) void gemv8_range(
    const float *x, const float *xsum, int K, int N, int gs, const int8_t *qweight,
    const void *scale, const void *zero, int sdtype, float *out, int b0, int b1, int last) {
    const int G = K / gs;
    for (int b = b0; b < b1; b++) {
        const long n = (long)b * GEMV4_ROWS;
        gemv8_rows(x, xsum, K, G, gs, qweight + n * K, scale, zero, sdtype, n, GEMV4_ROWS, out);
    }
    if (last)
        for (long n = (long)(N / GEMV4_ROWS) * GEMV4_ROWS; n < N; n++)
            gemv8_rows(x, xsum, K, G, gs, qweight + n * K, scale, zero, sdtype, n, 1, out);
}

static void gemv8(const float *x, const float *xsum, int K, int N, int gs, const int8_t *qweight,
                  const void *scale, const void *zero, int sdtype, float *out, void *out_,
                  int xdtype, int nthreads) {
    const int NB = N / GEMV4_ROWS;
    if (nthreads > NB) nthreads = NB > 0 ? NB : 1;
#pragma omp parallel num_threads(nthreads)
    {
        int b0, b1, last;
        thread_blocks(NB, &b0, &b1, &last);
        if (sdtype == 0)
            gemv8_range(x, xsum, K, N, gs, qweight, scale, zero, 0, out, b0, b1, last);
        else
            gemv8_range(x, xsum, K, N, gs, qweight, scale, zero, 1, out, b0, b1, last);
        write_columns(out, out_, xdtype, (long)b0 * GEMV4_ROWS, last ? N : (long)b1 * GEMV4_ROWS);
    }
}

/* ---- M = 1, int8, bfloat16 activations, groups a multiple of 32: x as int16 (x16_block) ----
 * One row per pass (two rows spill registers): per 32 weights two sign-extensions to int16, two
 * vpmaddwd and an add, then t += sx * float(isum) per block and acc += scale * t per group.
 * Lane sums stay under 4 * 128 * 2^15 = 2^24: exact in float too. 1.5x the float kernel's speed
 * on the Q8_0 LM head (49152 x 576, two threads, weights from DRAM). */
static inline __attribute__((always_inline)) float gemv8i_row(
    const int16_t *xq, const float *sx, const float *xsum, int K, int G, int gs, const int8_t *q,
    const void *scale, const void *zero, int sdtype, long n) {
    __m256 acc = _mm256_setzero_ps();
    const int blocks = gs / 32;
    for (int g = 0; g < G; g++) {
        __m256 t = _mm256_setzero_ps();
        for (int b = 0; b < blocks; b++) {
            const long off = (long)g * gs + 32L * b;
            if (!(off & 63)) _mm_prefetch((const char *)(q + off + GEMV8I_AHEAD), _MM_HINT_T0);
            const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + off)));
            const __m256i w1 =
                _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + off + 16)));
            const __m256i p = _mm256_add_epi32(
                _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)(xq + off))),
                _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xq + off + 16))));
            t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(sx[off / 32]), t);
        }
        acc = _mm256_fmadd_ps(t, _mm256_set1_ps(load_s(scale, n * G + g, sdtype)), acc);
    }
    float o = hsum(acc);
    if (zero) o += zdot(zero, n * G, xsum, G, sdtype);
    return o;
}

static void gemv8i(const float *x, const float *xsum, int K, int N, int gs, const int8_t *qweight,
                   const void *scale, const void *zero, int sdtype, int16_t *xq, float *sx,
                   float *out, void *out_, int nthreads) {
    for (int b = 0; b < K / 32; b++) sx[b] = x16_block(x + 32L * b, xq + 32L * b);
    const int G = K / gs;
    if (nthreads > N) nthreads = N;
#pragma omp parallel num_threads(nthreads)
    {
        int n0, n1, last;
        thread_blocks(N, &n0, &n1, &last);
        if (sdtype == 0)
            for (long n = n0; n < n1; n++)
                out[n] = gemv8i_row(xq, sx, xsum, K, G, gs, qweight + n * K, scale, zero, 0, n);
        else
            for (long n = n0; n < n1; n++)
                out[n] = gemv8i_row(xq, sx, xsum, K, G, gs, qweight + n * K, scale, zero, 1, n);
        write_columns(out, out_, 1, n0, n1);
    }
}

/* x [K] float32 -> xp as gemv4 reads it (K rounded up to 64 with zeros) */
static void gemv4_prep_x(const float *x, int K, float *xp) {
    const int C = K / 64, CT = (K + 63) / 64;
    for (int c = 0; c < C; c++) { /* 8x8 transpose: row i = columns 64c + 8i .. + 7 */
        const float *xs = x + (long)c * 64;
        float *xc = xp + (long)c * XP_CHUNK;
        __m256 r0 = _mm256_loadu_ps(xs), r1 = _mm256_loadu_ps(xs + 8),
               r2 = _mm256_loadu_ps(xs + 16), r3 = _mm256_loadu_ps(xs + 24),
               r4 = _mm256_loadu_ps(xs + 32), r5 = _mm256_loadu_ps(xs + 40),
               r6 = _mm256_loadu_ps(xs + 48), r7 = _mm256_loadu_ps(xs + 56);
        __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1),
               t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3),
               t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
               t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
        __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE),
               u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE),
               u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
               u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
        __m256 col[8] = {
            _mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
            _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
            _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
            _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
        __m256 sum = col[0];
        for (int k = 1; k < 8; k++) sum = _mm256_add_ps(sum, col[k]);
        for (int k = 0; k < 8; k++)
            _mm256_storeu_ps(xc + 8 * k,
                             k < 7 ? _mm256_mul_ps(col[k], _mm256_set1_ps(1.0f / (float)(1 << (4 * k))))
                                   : col[k]);
        _mm256_storeu_ps(xc + 64, _mm256_mul_ps(sum, _mm256_set1_ps(-8.0f)));
    }
    for (int c = C; c < CT; c++) { /* the zero-padded tail */
        float *xc = xp + (long)c * XP_CHUNK;
        for (int i = 0; i < 8; i++) {
            float sum = 0.0f;
            for (int k = 0; k < 8; k++) {
                const int col = c * 64 + 8 * i + k;
                const float v = col < K ? x[col] : 0.0f;
                sum += v;
                xc[8 * k + i] = k < 7 ? v * (1.0f / (float)(1 << (4 * k))) : v;
            }
            xc[64 + i] = -8.0f * sum;
        }
    }
}

/* float32 -> bfloat16 (round to nearest even, NaN as torch's 0x7fc0) for out[n0, n1) */
static void store_bf16(const float *src, uint16_t *dst, long n0, long n1) {
    long i = n0;
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff),
                  absmask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000),
                  qnan = _mm256_set1_epi32(0x7fc00000);
    for (; i + 8 <= n1; i += 8) {
        __m256i u = _mm256_castps_si256(_mm256_loadu_ps(src + i));
        __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
        __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, absmask), inf);
        r = _mm256_blendv_epi8(r, qnan, nan); /* torch's NaN, as f32_to_bf16 */
        r = _mm256_srli_epi32(r, 16);
        __m128i p = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        _mm_storeu_si128((__m128i *)(dst + i), p);
    }
    for (; i < n1; i++) dst[i] = f32_to_bf16(src[i]);
}
#endif

static int quant_matmul_f32(const float *x, const float *xsum, int M, int K, int N, int bits, int gs,
                 const void *qweight, const void *scale, const void *zero, int sdtype, float *out,
                 int nthreads) {
    if (M < 1 || gs <= 0 || K % gs || (bits != 4 && bits != 8) || (gs & 1))
        return 1;
    const int G = K / gs;
    const long row_bytes = bits == 4 ? K / 2 : K;
#ifdef __AVX2__
    if (bits == 4 ? gs % 32 == 0 : gs % 8 == 0) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int n = 0; n < N; n++) {
            const uint8_t *qrow = (const uint8_t *)qweight + (long)n * row_bytes;
            int m0 = 0;
            /* constant row counts, so the accumulators live in registers */
            for (; m0 + 8 <= M; m0 += 8)
                column_avx2(x, m0, 8, K, G, gs, bits, qrow, scale, zero, sdtype, (long)n * G,
                            out, N, n);
            if (M - m0 >= 4) {
                column_avx2(x, m0, 4, K, G, gs, bits, qrow, scale, zero, sdtype, (long)n * G,
                            out, N, n);
                m0 += 4;
            }
            if (M - m0 >= 2) {
                column_avx2(x, m0, 2, K, G, gs, bits, qrow, scale, zero, sdtype, (long)n * G,
                            out, N, n);
                m0 += 2;
            }
            if (M - m0 == 1)
                out[(long)m0 * N + n] =
                    column1_avx2(x + (long)m0 * K, xsum + (long)m0 * G, G, gs, bits, qrow, scale,
                                 zero, sdtype, (long)n * G);
        }
        return 0;
    }
#endif
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int n = 0; n < N; n++) {
        const uint8_t *qrow = (const uint8_t *)qweight + (long)n * row_bytes;
        for (int m0 = 0; m0 < M; m0 += MAX_M) {
            const int mc = M - m0 < MAX_M ? M - m0 : MAX_M;
            float acc[MAX_M];
            for (int m = 0; m < mc; m++) acc[m] = 0.0f;
            for (int g = 0; g < G; g++) {
                const float s = load_s(scale, (long)n * G + g, sdtype);
                const float z = zero ? load_s(zero, (long)n * G + g, sdtype) : 0.0f;
                const float zc = bits == 4 ? z - 8.0f * s : z;
                for (int m = 0; m < mc; m++) {
                    const float *xg = x + (long)(m0 + m) * K + (long)g * gs;
                    float d = bits == 4
                                  ? dot4(qrow + (long)g * (gs / 2), xg, xg + gs / 2, gs / 2)
                                  : dot8((const int8_t *)qrow + (long)g * gs, xg, gs);
                    acc[m] += s * d + zc * xsum[(long)(m0 + m) * G + g];
                }
            }
            for (int m = 0; m < mc; m++) out[(long)(m0 + m) * N + n] = acc[m];
        }
    }
    return 0;
}

/* x_in [M, K] (xdtype 0 float32, 1 bfloat16, row stride x_stride) -> out_ [M, N] in xdtype. */
int quant_matmul(const void *x_in, long x_stride, int xdtype, int M, int K, int N, int bits, int gs,
                 const void *qweight, const void *scale, const void *zero, int sdtype, void *out_,
                 int nthreads) {
    if (M < 1 || gs <= 0 || K % gs || (bits != 4 && bits != 8) || (gs & 1))
        return 1;
    const int G = K / gs;
#ifdef __AVX2__
    if (M == 1 && (bits == 4 ? gs == 32 || gs % 64 == 0 : gs % 8 == 0)) {
        const int CT = (K + 63) / 64;
        float *xf = malloc(sizeof(float) * ((size_t)K + (size_t)CT * XP_CHUNK + G + N));
        if (!xf) return 2;
        float *xp = xf + K, *xsum = xp + (size_t)CT * XP_CHUNK, *out = xsum + G;
        if (xdtype == 0) {
            memcpy(xf, x_in, sizeof(float) * K);
        } else {
            int j = 0;
            for (; j + 8 <= K; j += 8) {
                __m256i h = _mm256_cvtepu16_epi32(
                    _mm_loadu_si128((const __m128i *)((const uint16_t *)x_in + j)));
                _mm256_storeu_ps(xf + j, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
            }
            for (; j < K; j++) xf[j] = load_s(x_in, j, 1);
        }
        for (int g = 0; g < G; g++) {
            float sum = 0.0f;
            for (int j = 0; j < gs; j++) sum += xf[(long)g * gs + j];
            xsum[g] = sum;
        }
        if (bits == 4 && xdtype == 1) {
            int16_t *xq = (int16_t *)xp; /* CT * 32 floats' room, then CT * XS_CHUNK floats */
            float *xs = xp + (size_t)CT * XQ_CHUNK / 2;
            gemv4i_prep_x(xf, K, xq, xs);
            gemv4i(xq, xs, xsum, K, N, gs, qweight, scale, zero, sdtype, out, out_, nthreads);
        } else if (bits == 4) {
            gemv4_prep_x(xf, K, xp);
            gemv4(xp, xsum, K, N, gs, qweight, scale, zero, sdtype, out, out_, xdtype, nthreads);
        } else if (xdtype == 1 && gs % 32 == 0) {
            /* K int16 (K / 2 floats' room) and K / 32 block scales fit in xp's CT * XP_CHUNK */
            gemv8i(xf, xsum, K, N, gs, qweight, scale, zero, sdtype, (int16_t *)xp,
                   xp + (K + 1) / 2, out, out_, nthreads);
        } else {
            gemv8(xf, xsum, K, N, gs, qweight, scale, zero, sdtype, out, out_, xdtype, nthreads);
        }
        free(xf);
        return 0;
    }
#endif
    float *x = malloc(sizeof(float) * ((size_t)M * K + (size_t)M * G + (size_t)M * N));
    if (!x) return 2;
    float *xsum = x + (size_t)M * K, *out = xsum + (size_t)M * G;
    /* float32 copy of x; int4 groups reordered [even | odd] to match the packed nibbles */
    for (int m = 0; m < M; m++) {
        for (int g = 0; g < G; g++) {
            float sum = 0.0f;
            for (int j = 0; j < gs; j++) {
                long src = (long)m * x_stride + (long)g * gs + j;
                float v = xdtype == 0 ? ((const float *)x_in)[src] : load_s(x_in, src, 1);
                int dst = bits == 4 ? (j & 1) * (gs / 2) + j / 2 : j;
                x[(long)m * K + (long)g * gs + dst] = v;
                sum += v;
            }
            xsum[(long)m * G + g] = sum;
        }
    }
    int rc = quant_matmul_f32(x, xsum, M, K, N, bits, gs, qweight, scale, zero, sdtype, out,
                              nthreads);
    long total = (long)M * N;
    if (xdtype == 0)
        memcpy(out_, out, sizeof(float) * total);
    else
        for (long i = 0; i < total; i++) ((uint16_t *)out_)[i] = f32_to_bf16(out[i]);
    free(x);
    return rc;
}

/* Rows [n0, n1) of the weight dequantized to float32 into out [n1 - n0, K]: w = (q - 8) s + z
 * (int4) or q s + z (int8), rounded as common/model/quant.py's `dequantize` rounds them (a
 * multiply then an add, never contracted to an FMA), so a float32 matmul over these rows sees the
 * very weights of the reference. For batches where a float32 GEMM beats the kernel above
 * (cpu_quant's "f32tiles" path, from cpu_gemm.MIN_ROWS = 128 rows of x: prefill); OpenMP over
 * rows. No FMA contraction here: GCC takes it off per function by attribute, clang by a pragma at
 * the top of the body (either compiler warns at the other's spelling). */
#if defined(__GNUC__) && !defined(__clang__)
#define NO_FP_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define NO_FP_CONTRACT
#endif
NO_FP_CONTRACT int dequantize_rows(
    int n0, int n1, int K, int bits, int gs, const void *qweight, const void *scale,
    const void *zero, int sdtype, float *out, int nthreads) {
#ifdef __clang__
#pragma clang fp contract(off)
#endif
    if (gs <= 0 || K % gs || (bits != 4 && bits != 8) || (gs & 1) || n0 < 0 || n1 < n0) return 1;
    const int G = K / gs;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int n = n0; n < n1; n++) {
        for (int g = 0; g < G; g++) {
            const long sidx = (long)n * G + g, base = (long)n * K + (long)g * gs;
            const float s = load_s(scale, sidx, sdtype);
            const float z = zero ? load_s(zero, sidx, sdtype) : 0.0f;
            float *restrict o = out + (long)(n - n0) * K + (long)g * gs;
            if (bits == 4) {
                const uint8_t *restrict q = (const uint8_t *)qweight + base / 2;
                for (int j = 0; j < gs / 2; j++) {
                    o[2 * j] = (float)((int)(q[j] & 15) - 8) * s + z;
                    o[2 * j + 1] = (float)((int)(q[j] >> 4) - 8) * s + z;
                }
            } else {
                const int8_t *restrict q = (const int8_t *)qweight + base;
                for (int j = 0; j < gs; j++) o[j] = (float)q[j] * s + z;
            }
        }
    }
    return 0;
}
