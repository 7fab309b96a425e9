/* Causal attention of a prompt's (or a prompt chunk's) tokens for the CPU: out = softmax(q k^T *
 * scale, causal) v per head, grouped-query heads sharing their KV head. Compiled on first use by
 * common/kernels/cpu_prefill.py; entry point `prefill_attention` (at the end).
 *
 * Layouts: q [q_len, H, D], k and v [k_len, Hkv, D], each with its own token stride (elements;
 * heads and head dims contiguous within a token), float32 (dtype 0) or bfloat16 (1), all the same
 * dtype; out [q_len, H, D] contiguous, in that dtype. Query i sits at position k_len - q_len + i
 * and attends keys 0 ..= that position (a chunk after a cached prefix: q_len < k_len). D 64 or
 * 128. Head h reads KV head h / (H / Hkv).
 *
 * Work: per KV head, K is converted once to float32 and transposed (Kt [D, keys]; bfloat16 in an
 * AVX-512 BF16 build: its 32-bit pairs of dims transposed, [D / 2, keys]) and V converted
 * (Vf [keys, D]; bfloat16 there: two keys' values a 32-bit pair, [keys / 2, D]); then units of
 * (KV head, TQ query tokens) go across the OpenMP threads. A unit's query vectors (TQ tokens x
 * the G heads of the KV head, padded to a multiple of 8) get
 *   1. scores S = q . k * scale, 8 query vectors x 32 keys at a time (16 accumulators; each K
 *      vector load feeds 8 FMAs), up to the unit's last position;
 *   2. per query vector, the softmax's numerators in place: exp(s - max) over its keys, zero past
 *      its position, and 1 / their sum (16 lanes at a time);
 *   3. O = S V, 4 (D 128: 2) query vectors x D at a time over chunks of 64 keys (16 accumulators),
 *      scaled by 1 / sum into out.
 * Each query's result is computed by the same operations in the same order whatever the unit, the
 * thread count or q_len: a prompt split into chunks gets the bits of the whole prompt's pass.
 * Float32 throughout, FMA where the ISA level has it (a GCC vector type of 16 floats: AVX-512,
 * two AVX2 vectors, or four SSE ones), except that an AVX-512 BF16 build takes bfloat16 inputs
 * through dpbf16 (two products a lane and instruction): step 1 on q and K as stored (K's pairs
 * of dims transposed instead of converted: scores_bf16), step 3 on the weights rounded once to
 * bfloat16 and V in pairs of keys (values_bf16), as the AMX path rounds them (measured, Zen 4,
 * 2 threads, 9 / 3 heads of 64, one layer: 256 tokens 0.52 -> 0.33 ms, 1,024 7.57 -> 4.59,
 * 4,096 110.0 -> 67.3; the scores alone gave 0.41, 5.77 and 84.4). exp is vecmath.h's
 * exp_approx (about 1 ulp; its steps fused in AVX-512 instructions in AVX-512 builds,
 * exp16_512). In an amx build on a CPU that grants the tile state, bfloat16 inputs take the AMX
 * path instead (both products on the tile unit, the weights rounded to bfloat16 before the V
 * product: see unit_amx), with the same chunking guarantee; `prefill_uses_amx` says which,
 * `prefill_rounds_weights` whether the weights are rounded.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vecmath.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include "amx.h" /* refused the tile state, the vector path below serves bfloat16 too */
#define AMX_ATTENTION 1
#endif

typedef float v16 __attribute__((vector_size(64)));

#define KB 32   /* keys per score tile */
#define QR 8    /* query vectors per score tile */
#define VCH 64  /* keys per chunk of the S V product */
#define TARGET_QV 24 /* query vectors a unit aims for */

static inline v16 ld(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void st(float *p, v16 v) { memcpy(p, &v, sizeof v); }

/* n values of x from element i, as float32 */
static inline void to_f32(const void *x, long i, int dtype, int n, float *dst) {
    if (dtype == 0) {
        memcpy(dst, (const float *)x + i, sizeof(float) * n);
    } else {
        const uint16_t *h = (const uint16_t *)x + i;
        for (int d = 0; d < n; d++) dst[d] = bf16_to_f32(h[d]);
    }
}

/* S[r][j] = scale * q_r . k_j for r < nqv (a multiple of QR), j < kend (a multiple of KB) */
static inline __attribute__((always_inline)) void scores(int D, const float *Qf, int nqv,
                                                         const float *Kt, long kts, int kend,
                                                         float scale, float *S, long spad) {
    for (int j0 = 0; j0 < kend; j0 += KB) {
        for (int r0 = 0; r0 < nqv; r0 += QR) {
            v16 acc[QR][2];
            for (int r = 0; r < QR; r++) acc[r][0] = acc[r][1] = (v16){};
            for (int d = 0; d < D; d++) {
                const v16 k0 = ld(Kt + d * kts + j0), k1 = ld(Kt + d * kts + j0 + 16);
                for (int r = 0; r < QR; r++) {
                    const float qd = Qf[(long)(r0 + r) * D + d];
                    acc[r][0] += qd * k0;
                    acc[r][1] += qd * k1;
                }
            }
            for (int r = 0; r < QR; r++) {
                st(S + (long)(r0 + r) * spad + j0, acc[r][0] * scale);
                st(S + (long)(r0 + r) * spad + j0 + 16, acc[r][1] * scale);
            }
        }
    }
}

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define PAIRED_BF16 1
/* scores() for bfloat16 q and K as they are stored (AVX-512 BF16): Kp [D / 2, keys] holds each
 * key's dims 2p and 2p + 1 as one 32-bit pair, Qp [nqv, D / 2] the query vectors' pairs; one
 * dpbf16 multiplies a query's pair by 16 keys' pairs (exact products) and adds both to each key's
 * float32 sum, where the float32 path needs two FMAs: half the instructions, the same sums
 * rounded in another order. Per query vector the same operations whatever the unit. */
static inline __attribute__((always_inline)) void scores_bf16(int D, const uint32_t *Qp,
                                                              int nqv, const uint32_t *Kp,
                                                              long kts, int kend, float scale,
                                                              float *S, long spad) {
    const int P = D / 2;
    for (int j0 = 0; j0 < kend; j0 += KB) {
        for (int r0 = 0; r0 < nqv; r0 += QR) {
            __m512 acc[QR][2];
            for (int r = 0; r < QR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
            for (int p = 0; p < P; p++) {
                const __m512bh k0 = (__m512bh)_mm512_loadu_si512(Kp + p * kts + j0);
                const __m512bh k1 = (__m512bh)_mm512_loadu_si512(Kp + p * kts + j0 + 16);
                for (int r = 0; r < QR; r++) {
                    const __m512bh qv =
                        (__m512bh)_mm512_set1_epi32((int)Qp[(long)(r0 + r) * P + p]);
                    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qv, k0);
                    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qv, k1);
                }
            }
            const __m512 sc = _mm512_set1_ps(scale);
            for (int r = 0; r < QR; r++) {
                _mm512_storeu_ps(S + (long)(r0 + r) * spad + j0, _mm512_mul_ps(acc[r][0], sc));
                _mm512_storeu_ps(S + (long)(r0 + r) * spad + j0 + 16,
                                 _mm512_mul_ps(acc[r][1], sc));
            }
        }
    }
}
#endif

typedef int32_t vi16 __attribute__((vector_size(64)));

static inline v16 splat(float x) { return (v16){} + x; }

/* lanes of a where mask (-1 / 0 lanes), else of b */
static inline v16 sel(vi16 mask, v16 a, v16 b) { return (v16)(((vi16)a & mask) | ((vi16)b & ~mask)); }

#if defined(__AVX512F__)
#include <immintrin.h>
/* exp_approx's steps on 16 lanes in AVX-512 instructions (the softmax, where the exp is most of
 * the time): the clamps as min / max, the floor by rounding, the 2^n by scalef
 * (p * 2^n is exact: p is in [1/2, 2) and 2^n >= 2^-126 for the clamped x). The same
 * polynomial; the fused steps round once where exp16's may round twice, so its results may
 * differ from exp16's in the last bit (a prompt's outputs: 7 in 100,000 bfloat16 values one
 * unit apart at 1,000 tokens, none at 256). Measured on the AMX path with its bfloat16
 * rounding (softmax_row_amx), on an AVX-512 + AMX Xeon, 2 threads, one prompt's attention of
 * one layer (9 heads, 3 kv heads, head dim 64), old and new alternated three times: 256 tokens
 * 225-236 -> 164-191 us, 1,024 tokens 2.70-3.08 -> 2.08-2.45 ms, 2,048 10.2 -> 8.6 ms, 4,096
 * 38.3-41.8 -> 27.5-34.3 ms; on the vector path (float32) 3-5%. */
static inline __m512 exp16_512(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(88.72283f), _mm512_max_ps(_mm512_set1_ps(-87.33654f), x));
    const __m512 n = _mm512_roundscale_ps(
        _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#endif

/* exp_approx (vecmath.h) on 16 lanes: the same steps, floor through a truncating conversion
 * (AVX-512 builds: exp16_512) */
static inline v16 exp16(v16 x) {
#if defined(__AVX512F__)
    return (v16)exp16_512((__m512)x);
#else
    x = sel(x < splat(-87.33654f), splat(-87.33654f), x);
    x = sel(x > splat(88.72283f), splat(88.72283f), x);
    const v16 y = x * 1.44269504088896341f + 0.5f;
    const v16 t = __builtin_convertvector(__builtin_convertvector(y, vi16), v16);
    const v16 n = t + __builtin_convertvector(t > y, v16); /* t > y: -1, floor is t - 1 */
    v16 r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    v16 p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    return p * (v16)((__builtin_convertvector(n, vi16) + 127) << 23);
#endif
}

static const vi16 LANES = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

/* row s of kend scores (a multiple of 16): the first n -> exp(s - their max), the rest 0;
 * returns 1 / the sum. Lane-wise max and sums, then the 16 lanes in order: the same operations
 * for every row of n keys. */
static inline float softmax_row(float *s, int n, int kend) {
    v16 m = splat(-INFINITY);
    for (int j = 0; j < kend; j += 16) {
        const v16 x = sel(LANES + j < n, ld(s + j), splat(-INFINITY));
        m = sel(x > m, x, m);
    }
    float mx = m[0];
    for (int c = 1; c < 16; c++) mx = m[c] > mx ? m[c] : mx;
    v16 sum = {};
    for (int j = 0; j < kend; j += 16) {
        const v16 e = sel(LANES + j < n, exp16(ld(s + j) - mx), splat(0.0f));
        st(s + j, e);
        sum += e;
    }
    float total = 0.0f;
    for (int c = 0; c < 16; c++) total += sum[c];
    return 1.0f / total;
}

/* O[r] = sum_j S[r][j] Vf[j] for r < nqv (a multiple of QR), j < kmax; RV rows at a time */
static inline __attribute__((always_inline)) void values(int D, int RV, const float *S, long spad,
                                                         int nqv, const float *Vf, int kmax,
                                                         float *O) {
    memset(O, 0, sizeof(float) * nqv * D);
    for (int j0 = 0; j0 < kmax; j0 += VCH) {
        const int j1 = j0 + VCH < kmax ? j0 + VCH : kmax;
        for (int r0 = 0; r0 < nqv; r0 += RV) {
            v16 acc[4][8]; /* RV x D / 16 of them used: 16 */
            for (int r = 0; r < RV; r++)
                for (int c = 0; c < D / 16; c++) acc[r][c] = ld(O + (long)(r0 + r) * D + 16 * c);
            for (int j = j0; j < j1; j++) {
                v16 vv[8];
                for (int c = 0; c < D / 16; c++) vv[c] = ld(Vf + (long)j * D + 16 * c);
                for (int r = 0; r < RV; r++) {
                    const float p = S[(long)(r0 + r) * spad + j];
                    for (int c = 0; c < D / 16; c++) acc[r][c] += p * vv[c];
                }
            }
            for (int r = 0; r < RV; r++)
                for (int c = 0; c < D / 16; c++) st(O + (long)(r0 + r) * D + 16 * c, acc[r][c]);
        }
    }
}

#ifdef PAIRED_BF16
/* values() for weights rounded to bfloat16 (P [nqv, spad], each row's kend of them) and V in
 * pairs of keys (Vp [keys / 2, D]: key 2i's value in the low half of each 32-bit pair, key
 * 2i + 1's in the high one; an odd last key paired with 0): one dpbf16 adds two keys' exact
 * products to 16 dims' float32 sums, where values() needs two FMAs. Per query vector the same
 * operations over the same key pairs whatever the unit (pairs past its keys add exact zeros). */
static inline __attribute__((always_inline)) void values_bf16(int D, int RV, const uint16_t *P,
                                                              long spad, int nqv,
                                                              const uint32_t *Vp, int kmax,
                                                              float *O) {
    memset(O, 0, sizeof(float) * nqv * D);
    const int pairs = (kmax + 1) / 2;
    for (int i0 = 0; i0 < pairs; i0 += VCH / 2) {
        const int i1 = i0 + VCH / 2 < pairs ? i0 + VCH / 2 : pairs;
        for (int r0 = 0; r0 < nqv; r0 += RV) {
            __m512 acc[4][8]; /* RV x D / 16 of them used: 16 */
            for (int r = 0; r < RV; r++)
                for (int c = 0; c < D / 16; c++)
                    acc[r][c] = _mm512_loadu_ps(O + (long)(r0 + r) * D + 16 * c);
            for (int i = i0; i < i1; i++) {
                __m512bh vv[8];
                for (int c = 0; c < D / 16; c++)
                    vv[c] = (__m512bh)_mm512_loadu_si512(Vp + (long)i * D + 16 * c);
                for (int r = 0; r < RV; r++) {
                    uint32_t w;
                    memcpy(&w, P + (long)(r0 + r) * spad + 2 * i, sizeof w);
                    const __m512bh pw = (__m512bh)_mm512_set1_epi32((int)w);
                    for (int c = 0; c < D / 16; c++)
                        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pw, vv[c]);
                }
            }
            for (int r = 0; r < RV; r++)
                for (int c = 0; c < D / 16; c++)
                    _mm512_storeu_ps(O + (long)(r0 + r) * D + 16 * c, acc[r][c]);
        }
    }
}

/* a row of n weights (a multiple of 16) rounded to bfloat16, to nearest even (vcvtneps2bf16:
 * the weights are 0 or normal floats in (2^-126, 1], where it rounds as f32_to_bf16) */
static inline void round_weights(const float *s, int n, uint16_t *P) {
    for (int j = 0; j < n; j += 16)
        _mm256_storeu_si256((__m256i *)(P + j),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + j)));
}
#endif

/* one unit: KV head hk's query vectors of tokens t0 .. t1 - 1 */
static inline __attribute__((always_inline)) void unit(
    int D, const void *q, long qs, void *out, int dtype, int q_len, int k_len, int H, int G,
    int hk, int t0, int t1, const float *Kt, long kts, const float *Vf, float scale, float *Qf,
    float *S, long spad, float *O, float *inv, const int paired) {
    const int base = k_len - q_len; /* position of query 0 */
    const int nq = (t1 - t0) * G, nqv = (nq + QR - 1) / QR * QR;
    const int kmax = base + t1; /* keys the last token attends */
    const int kend = (kmax + KB - 1) / KB * KB;
    for (int r = 0; r < nqv; r++) {
        const long src = (long)(t0 + r / G) * qs + (long)(hk * G + r % G) * D;
        if (paired) { /* the pairs as stored (paired: bfloat16 q) */
            uint16_t *dst = (uint16_t *)Qf + (long)r * D;
            if (r < nq)
                memcpy(dst, (const uint16_t *)q + src, sizeof(uint16_t) * D);
            else
                memset(dst, 0, sizeof(uint16_t) * D);
            continue;
        }
        float *dst = Qf + (long)r * D;
        if (r >= nq) {
            memset(dst, 0, sizeof(float) * D);
            continue;
        }
        to_f32(q, src, dtype, D, dst);
    }
#ifdef PAIRED_BF16
    if (paired)
        scores_bf16(D, (const uint32_t *)Qf, nqv, (const uint32_t *)Kt, kts, kend, scale, S,
                    spad);
    else
#endif
        scores(D, Qf, nqv, Kt, kts, kend, scale, S, spad);
    for (int r = 0; r < nqv; r++) {
        const int n = r < nq ? base + t0 + r / G + 1 : 1; /* padding rows: any finite row */
        inv[r] = softmax_row(S + (long)r * spad, n, kend);
    }
#ifdef PAIRED_BF16
    if (paired) { /* the weights rounded to bfloat16 (as the AMX path and torch's SDPA do) */
        uint16_t *P = (uint16_t *)(S + (long)nqv * spad);
        for (int r = 0; r < nqv; r++) round_weights(S + (long)r * spad, kend, P + (long)r * spad);
        values_bf16(D, D == 64 ? 4 : 2, P, spad, nqv, (const uint32_t *)Vf, kmax, O);
    } else
#endif
    {
        if (D == 64)
            values(64, 4, S, spad, nqv, Vf, kmax, O);
        else
            values(128, 2, S, spad, nqv, Vf, kmax, O);
    }
    for (int r = 0; r < nq; r++) {
        const long dst = ((long)(t0 + r / G) * H + hk * G + r % G) * D;
        const float *o = O + (long)r * D;
        if (dtype == 0)
            for (int d = 0; d < D; d++) ((float *)out)[dst + d] = o[d] * inv[r];
        else
            for (int d = 0; d < D; d++) ((uint16_t *)out)[dst + d] = f32_to_bf16(o[d] * inv[r]);
    }
}

#ifdef AMX_ATTENTION
/* The AMX path (bfloat16 q, k, v on a CPU with AMX tiles that granted them): the two products on
 * the tile unit, the softmax in float32 vectors.
 *   S = q . k: tiles of 16 query vectors x 32 dims of q (bfloat16, as stored) times K in dim
 *     pairs, D/32 products a tile of 16 x 16 scores (float32 sums of the exact bfloat16
 *     products), two key tiles at a time; K is repacked per KV head tile by tile (Kp: per 16
 *     keys and 32 dims, 16 rows of the 16 keys' two dims, 1 KiB contiguous);
 *   per query vector, the softmax over its keys (scaled scores, lane-wise maximum and sums as
 *     softmax_row) writing the weights rounded once to bfloat16 (P);
 *   O = P V: tiles of 16 query vectors x 32 keys of P times V in key pairs (Vp: per 32 keys and
 *     16 dims, 16 rows of two keys' 16 dims, 1 KiB contiguous), summed over the keys in tiles of
 *     16 x 16 dims, 64 dims at a time, float32.
 * Each score and each output value is one tile element, made by the same instructions over the
 * same keys whatever else is in its tile: keys past a query's position have weight 0, and a
 * unit's extra key tiles add exact zeros, so chunking changes no bit, as on the vector path.
 * Units are 16 tokens (16 * G query vectors: whole tiles for every G). Against the float32
 * products: the weights' rounding, at most 2^-9 of each, so |error| <= 2^-9 max |v| beside the
 * output's own bfloat16 rounding (torch's SDPA rounds its weights so too). */
#define AMX_TQ 16

/* Tiles (amx_configure_full: all 16 rows x 64 bytes). Scores: tmm0, tmm6 sums, tmm1-4 q (D/32 of
 * them), tmm5 K. Values: tmm0-3 sums (64 dims), tmm4 P, tmm5-7 V. */

/* one query vector's softmax on the AMX path: s holds kend raw scores (a multiple of 16), the
 * first n its keys; P gets exp(scale s - max) of those as bfloat16 (rounded to nearest even by
 * vcvtneps2bf16: the weights are normal floats in [2^-126, 1], where it rounds as f32_to_bf16),
 * 0 past them; returns 1 / the float32 sum of the unrounded weights. Lane-wise maximum and sums,
 * then the 16 lanes in order: the same operations for every row of n keys. */
static inline float softmax_row_amx(const float *s, int n, int kend, float scale, uint16_t *P) {
    /* lanes past n hold -inf in the maximum and add +0 to the sums: the 16-key blocks wholly
     * past them are left out (no bit changes), their weights written as zeros */
    const int nj = (n + 15) / 16 * 16 < kend ? (n + 15) / 16 * 16 : kend;
    memset(P + nj, 0, sizeof(uint16_t) * (kend - nj));
    kend = nj;
    const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512 m = ninf;
    for (int j = 0; j < kend; j += 16) {
        const __mmask16 in = _mm512_cmplt_epi32_mask(_mm512_add_epi32(lanes, _mm512_set1_epi32(j)),
                                                     _mm512_set1_epi32(n));
        m = _mm512_max_ps(m, _mm512_mask_mul_ps(ninf, in, _mm512_loadu_ps(s + j), sc));
    }
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < kend; j += 16) {
        const __mmask16 in = _mm512_cmplt_epi32_mask(_mm512_add_epi32(lanes, _mm512_set1_epi32(j)),
                                                     _mm512_set1_epi32(n));
        const __m512 e = _mm512_maskz_mov_ps(
            in, exp16_512(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(s + j), sc), mx)));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256((__m256i *)(P + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    float lane[16], total = 0.0f;
    _mm512_storeu_ps(lane, sum);
    for (int c = 0; c < 16; c++) total += lane[c];
    return 1.0f / total;
}

/* rows rb..rb+15 x keys j0..j0+31 of S: two tiles of 16 keys, tmm0 and tmm6 */
#define AMX_SCORES_PAIR(DC)                                                                     \
    do {                                                                                        \
        const uint16_t *kb = Kp + (long)(j0 / 16) * (DC) * 512;                                  \
        _tile_zero(0);                                                                          \
        _tile_zero(6);                                                                          \
        _tile_loadd(5, kb, 64);                                                                 \
        _tile_dpbf16ps(0, 1, 5);                                                                \
        _tile_loadd(7, kb + (DC) * 512, 64);                                                    \
        _tile_dpbf16ps(6, 1, 7);                                                                \
        _tile_loadd(5, kb + 512, 64);                                                           \
        _tile_dpbf16ps(0, 2, 5);                                                                \
        _tile_loadd(7, kb + ((DC) + 1) * 512, 64);                                              \
        _tile_dpbf16ps(6, 2, 7);                                                                \
        if ((DC) == 4) {                                                                        \
            _tile_loadd(5, kb + 2 * 512, 64);                                                   \
            _tile_dpbf16ps(0, 3, 5);                                                            \
            _tile_loadd(7, kb + 6 * 512, 64);                                                   \
            _tile_dpbf16ps(6, 3, 7);                                                            \
            _tile_loadd(5, kb + 3 * 512, 64);                                                   \
            _tile_dpbf16ps(0, 4, 5);                                                            \
            _tile_loadd(7, kb + 7 * 512, 64);                                                   \
            _tile_dpbf16ps(6, 4, 7);                                                            \
        }                                                                                       \
        _tile_stored(0, S + (long)rb * spad + j0, 4 * spad);                                     \
        _tile_stored(6, S + (long)rb * spad + j0 + 16, 4 * spad);                                \
    } while (0)

static void unit_amx(int D, const uint16_t *q, long qs, uint16_t *out, int q_len, int k_len,
                     int H, int G, int hk, int t0, int t1, const uint16_t *Kp,
                     const uint16_t *Vp, long kpad, float scale, uint16_t *Qb, float *S,
                     uint16_t *P, float *O, float *inv) {
    const int base = k_len - q_len; /* position of query 0 */
    const int nq = (t1 - t0) * G, nqv = (nq + 15) / 16 * 16;
    const int kmax = base + t1, kend = (kmax + KB - 1) / KB * KB;
    const long spad = kpad;
    for (int r = 0; r < nqv; r++) {
        uint16_t *dst = Qb + (long)r * D;
        if (r < nq)
            memcpy(dst, q + (long)(t0 + r / G) * qs + (long)(hk * G + r % G) * D, 2 * D);
        else
            memset(dst, 0, 2 * D);
    }
    /* GCC's tile intrinsics do not say they read or write memory: these barriers keep the
     * plain loads and stores of Qb, S, P and O on their side of the tile loads and stores */
    __asm__ volatile("" ::: "memory");
    for (int rb = 0; rb < nqv; rb += 16) {
        const uint16_t *qb = Qb + (long)rb * D;
        _tile_loadd(1, qb, 2L * D);
        _tile_loadd(2, qb + 32, 2L * D);
        if (D == 128) {
            _tile_loadd(3, qb + 64, 2L * D);
            _tile_loadd(4, qb + 96, 2L * D);
            for (int j0 = 0; j0 < kend; j0 += 32) AMX_SCORES_PAIR(4);
        } else {
            for (int j0 = 0; j0 < kend; j0 += 32) AMX_SCORES_PAIR(2);
        }
    }
    __asm__ volatile("" ::: "memory");
    for (int r = 0; r < nqv; r++) {
        const int n = r < nq ? base + t0 + r / G + 1 : 1; /* padding rows: any finite row */
        inv[r] = softmax_row_amx(S + (long)r * spad, n, kend, scale, P + (long)r * spad);
    }
    __asm__ volatile("" ::: "memory");
    for (int rb = 0; rb < nqv; rb += 16)
        for (int dh = 0; dh < D; dh += 64) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int j0 = 0; j0 < kend; j0 += 32) {
                const uint16_t *vb = Vp + ((long)(j0 / 32) * (D / 16) + dh / 16) * 512;
                _tile_loadd(4, P + (long)rb * spad + j0, 2 * spad);
                _tile_loadd(5, vb, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, vb + 512, 64);
                _tile_dpbf16ps(1, 4, 6);
                _tile_loadd(7, vb + 2 * 512, 64);
                _tile_dpbf16ps(2, 4, 7);
                _tile_loadd(5, vb + 3 * 512, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
            float *o = O + (long)rb * D + dh;
            _tile_stored(0, o, 4L * D);
            _tile_stored(1, o + 16, 4L * D);
            _tile_stored(2, o + 32, 4L * D);
            _tile_stored(3, o + 48, 4L * D);
            __asm__ volatile("" ::: "memory");
        }
    for (int r = 0; r < nq; r++) {
        const long dst = ((long)(t0 + r / G) * H + hk * G + r % G) * D;
        const float *o = O + (long)r * D;
        for (int d = 0; d < D; d++) out[dst + d] = f32_to_bf16(o[d] * inv[r]);
    }
}
#undef AMX_SCORES_PAIR

/* prefill_attention's bfloat16 case on the tile unit (see above); same returns */
static int prefill_amx(const uint16_t *q, long q_stride, const uint16_t *k, long k_stride,
                       const uint16_t *v, long v_stride, uint16_t *out, int q_len, int k_len,
                       int H, int Hkv, int D, float scale, int nthreads) {
    const int G = H / Hkv;
    const long kpad = (k_len + KB - 1) / KB * KB, spad = kpad;
    uint16_t *Kp = malloc(sizeof(uint16_t) * (size_t)Hkv * D * kpad);
    uint16_t *Vp = malloc(sizeof(uint16_t) * (size_t)Hkv * D * kpad);
    if (!Kp || !Vp) {
        free(Kp);
        free(Vp);
        return 2;
    }
    /* K and V of each KV head in tiles (see above), per 64 keys; pad keys 0 (finite scores) */
    const int chunks = (int)((kpad + 63) / 64);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int c = 0; c < Hkv * chunks; c++) {
        const int hk = c / chunks;
        const long j0 = (long)(c % chunks) * 64, j1 = j0 + 64 < kpad ? j0 + 64 : kpad;
        uint16_t *kp = Kp + (long)hk * D * kpad, *vp = Vp + (long)hk * D * kpad;
        /* K: block j / 16, dim chunk d / 32, row (d % 32) / 2, lane j % 16, pair d % 2: each
         * key's dim pairs move as 32-bit units */
        for (long j = j0; j < j1; j++) {
            uint32_t *kt = (uint32_t *)(kp + (j / 16) * (D / 32) * 512) + (j % 16);
            const uint16_t *kr = k + j * k_stride + (long)hk * D;
            for (int p = 0; p < D / 2; p++) {
                uint32_t pair = 0;
                if (j < k_len) memcpy(&pair, kr + 2 * p, 4);
                kt[(p / 16) * 256 + (p % 16) * 16] = pair;
            }
        }
        /* V: block j / 32, dim block d / 16, row (j % 32) / 2, lane d % 16, pair j % 2: two
         * keys' 16 dims interleaved into one 64-byte row */
        const __m512i mix = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25,
                                             9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                                             17, 1, 16, 0);
        for (long j = j0; j < j1; j += 2) {
            uint16_t *vt = vp + (j / 32) * (D / 16) * 512 + ((j % 32) / 2) * 32;
            const uint16_t *v0 = v + j * v_stride + (long)hk * D, *v1 = v0 + v_stride;
            for (int d = 0; d < D; d += 16) {
                const __m256i a = j < k_len ? _mm256_loadu_si256((const __m256i *)(v0 + d))
                                            : _mm256_setzero_si256();
                const __m256i b = j + 1 < k_len ? _mm256_loadu_si256((const __m256i *)(v1 + d))
                                                : _mm256_setzero_si256();
                const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
                _mm512_storeu_si512(vt + (d / 16) * 512, _mm512_permutexvar_epi16(mix, both));
            }
        }
    }
    const int tiles = (q_len + AMX_TQ - 1) / AMX_TQ, units = Hkv * tiles, nqv = AMX_TQ * G;
    const int nqv_max = (nqv + 15) / 16 * 16;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        uint16_t *Qb = malloc(sizeof(uint16_t) * (size_t)nqv_max * D);
        float *S = malloc(sizeof(float) * (size_t)nqv_max * spad);
        uint16_t *P = malloc(sizeof(uint16_t) * (size_t)nqv_max * spad);
        float *O = malloc(sizeof(float) * (size_t)nqv_max * D);
        float *inv = malloc(sizeof(float) * (size_t)nqv_max);
        const int ok = Qb && S && P && O && inv;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        amx_configure_full();
        /* the last tiles (the most keys) first: the long units start early */
#pragma omp for schedule(dynamic, 1)
        for (int u = 0; u < units; u++) {
            if (!ok) continue;
            const int tile = tiles - 1 - u / Hkv, hk = u % Hkv;
            const int t0 = tile * AMX_TQ, t1 = t0 + AMX_TQ < q_len ? t0 + AMX_TQ : q_len;
            unit_amx(D, q, q_stride, out, q_len, k_len, H, G, hk, t0, t1,
                     Kp + (long)hk * D * kpad, Vp + (long)hk * D * kpad, kpad, scale, Qb, S, P,
                     O, inv);
        }
        _tile_release();
        free(Qb);
        free(S);
        free(P);
        free(O);
        free(inv);
    }
    free(Kp);
    free(Vp);
    return failed ? 2 : 0;
}
#endif

/* Whether bfloat16 inputs take the tile unit's path (an AMX build that got the tile state). */
int prefill_uses_amx(void) {
#ifdef AMX_ATTENTION
    return amx_ok;
#else
    return 0;
#endif
}

/* Whether bfloat16 inputs have their softmax weights rounded to bfloat16 before the V product
 * (the AMX path, and the AVX-512 BF16 vector path). */
int prefill_rounds_weights(void) {
#ifdef PAIRED_BF16
    return 1;
#else
    return prefill_uses_amx();
#endif
}

/* 0: done; 1: shapes not supported (D not 64 or 128, H not a multiple of Hkv, q_len > k_len,
 * an unknown dtype); 2: no memory. */
int prefill_attention(const void *q, long q_stride, const void *k, long k_stride, const void *v,
                      long v_stride, void *out, int q_len, int k_len, int H, int Hkv, int D,
                      float scale, int dtype, int nthreads) {
    if ((D != 64 && D != 128) || Hkv <= 0 || H % Hkv || q_len < 0 || q_len > k_len ||
        (dtype != 0 && dtype != 1))
        return 1;
    if (q_len == 0) return 0;
#ifdef AMX_ATTENTION
    if (dtype == 1 && amx_ok)
        return prefill_amx(q, q_stride, k, k_stride, v, v_stride, out, q_len, k_len, H, Hkv, D,
                           scale, nthreads);
#endif
    const int G = H / Hkv;
    const int TQ = (TARGET_QV + G - 1) / G;
    const long kpad = (k_len + KB - 1) / KB * KB, spad = kpad;
    /* Kt's row stride: off powers of two, whose rows would share a few L1 sets (measured, 256
     * keys: the transpose and the scores ~1.3x slower) */
    const long kts = kpad + 16;
#ifdef PAIRED_BF16
    /* bfloat16: both products by dpbf16 (Kt holds K's pairs of dims [D / 2, keys], Vf V's pairs
     * of keys [keys / 2, D]) */
    const int paired = dtype == 1;
#else
    const int paired = 0;
#endif
    float *Kt = malloc(sizeof(float) * (size_t)Hkv * D * kts);
    /* a head's V: k_len rows of D floats, or (paired) (k_len + 1) / 2 rows of D key pairs */
    const long vhead = (paired ? (k_len + 1) / 2 : k_len) * (long)D;
    float *Vf = malloc(sizeof(float) * (size_t)Hkv * vhead);
    if (!Kt || !Vf) {
        free(Kt);
        free(Vf);
        return 2;
    }
    /* K transposed and V, in float32, per (KV head, 64 keys); Kt's pad keys 0 (finite scores) */
    const int chunks = (int)((kpad + 63) / 64);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int c = 0; c < Hkv * chunks; c++) {
        const int hk = c / chunks;
        const long j0 = (long)(c % chunks) * 64, j1 = j0 + 64 < kpad ? j0 + 64 : kpad;
        float *kt = Kt + (long)hk * D * kts, *vf = Vf + (long)hk * vhead;
        float row[128];
        if (paired) { /* each key's 32-bit pairs of dims, transposed: [D / 2, keys] */
            uint32_t *kp = (uint32_t *)Kt + (long)hk * (D / 2) * kts, *vp = (uint32_t *)vf;
            const uint16_t *kb = k, *vb = v;
            for (long j = j0; j < j1; j++) {
                uint32_t pairs[64];
                if (j < k_len)
                    memcpy(pairs, kb + j * k_stride + (long)hk * D, sizeof(uint16_t) * D);
                else
                    memset(pairs, 0, sizeof pairs);
                for (int p = 0; p < D / 2; p++) kp[p * kts + j] = pairs[p];
                if (j % 2 == 0 && j < k_len) /* keys j and j + 1's values, dim by dim */
                    for (int d = 0; d < D; d++) {
                        const long at = j * v_stride + (long)hk * D + d;
                        const uint32_t hi = j + 1 < k_len ? vb[at + v_stride] : 0;
                        vp[j / 2 * D + d] = vb[at] | hi << 16;
                    }
            }
            continue;
        }
        for (long j = j0; j < j1; j++) {
            if (j < k_len) {
                to_f32(k, j * k_stride + (long)hk * D, dtype, D, row);
                to_f32(v, j * v_stride + (long)hk * D, dtype, D, vf + j * D);
            } else {
                memset(row, 0, sizeof row);
            }
            for (int d = 0; d < D; d++) kt[d * kts + j] = row[d];
        }
    }
    const int tiles = (q_len + TQ - 1) / TQ, units = Hkv * tiles;
    const int nqv_max = (TQ * G + QR - 1) / QR * QR;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *Qf = malloc(sizeof(float) * (size_t)nqv_max * D);
        /* S, and after it (paired) the weights rounded to bfloat16 */
        const size_t per_score = sizeof(float) + (paired ? sizeof(uint16_t) : 0);
        float *S = malloc(per_score * (size_t)nqv_max * spad);
        float *O = malloc(sizeof(float) * (size_t)nqv_max * D);
        float *inv = malloc(sizeof(float) * (size_t)nqv_max);
        const int ok = Qf && S && O && inv;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        /* the last tiles (the most keys) first: the long units start early */
#pragma omp for schedule(dynamic, 1)
        for (int u = 0; u < units; u++) {
            if (!ok) continue;
            const int tile = tiles - 1 - u / Hkv, hk = u % Hkv;
            const int t0 = tile * TQ, t1 = t0 + TQ < q_len ? t0 + TQ : q_len;
            /* a head's K: D rows of kts floats, or (paired) D / 2 rows of kts pairs */
            const float *kt = Kt + (long)hk * (paired ? D / 2 : D) * kts;
            const float *vf = Vf + (long)hk * vhead;
#define UNIT(d, pr)                                                                              \
    unit(d, q, q_stride, out, dtype, q_len, k_len, H, G, hk, t0, t1, kt, kts, vf, scale, Qf, S,  \
         spad, O, inv, pr)
            if (D == 64) {
                if (paired)
                    UNIT(64, 1);
                else
                    UNIT(64, 0);
            } else if (paired) {
                UNIT(128, 1);
            } else {
                UNIT(128, 0);
            }
#undef UNIT
        }
        free(Qf);
        free(S);
        free(O);
        free(inv);
    }
    free(Kt);
    free(Vf);
    return failed ? 2 : 0;
}
