/* A bfloat16 matmul on AMX tiles for the CPU: out[M, N] = x[M, K] @ W.T, x and out bfloat16,
 * W a dense bfloat16 copy of a quantized weight (cpu_quant's "amxbf16" path; the C decode
 * layers call it too). Compiled on first use by common/kernels/cpu_dense.py, which also packs
 * W into the tile layout below; entry points `dense_amx`, `dense_amx_q4` (the same products
 * from a 4-bit weight's codes, each panel made as it is reached: cpu_quant's "amx4") and
 * `dense_amx_available`.
 *
 * Why: at 16-128 rows (decode batches, verify steps) the int8-activation kernel's per-block
 * float steps bound it (quant_gemm.c), while a dense weight needs none: each output tile sums
 * the whole of K in the tile unit (float32, tdpbf16ps) and is rounded once. It streams 2 bytes
 * a weight instead of about 0.6, so it pays only where compute, not the weight stream, sets
 * the time: the kernel tune (common/kernels/tune.py) times it against the other paths at each
 * batch size on the machine that serves.
 *
 * Packed W: panels of 16 output columns; per panel K / 32 tiles of 16 rows x 64 bytes, row r
 * of tile t holding, for each column c, the pair W[c, 32t + 2r], W[c, 32t + 2r + 1] (the
 * tile unit's B layout): element ((p * K / 32 + t) * 16 + r) * 32 + 2c + e. N % 16 == 0 and
 * K % 32 == 0 (cpu_dense.supports).
 *
 * Blocking: 32 rows x 32 columns (2 x 2 result tiles, each x and W tile loaded once for two
 * products), OpenMP over the panel pairs; an odd last panel and the rows past the last 32 go
 * through zero-padded copies. A row's sums do not depend on the rows beside it.
 * Linux hands out the tile state only on request (arch_prctl, once per process, at load);
 * refused, or built without AMX-BF16, `dense_amx_available` is 0 and `dense_amx` returns -1.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vecmath.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include "amx.h"
/* Bytes of each W panel asked for into L2 ahead of its tile loads, by the first row block of a
 * panel pair (the later ones find it in cache). In a decode step the weights come from memory,
 * and the tile loads stalled on them: in a profile of a batch-64 step (C decode layers) this
 * kernel had 29% of the samples, 63% of its own on the W loads and the product after them.
 * Measured (the default model's 30 layers of projections, bfloat16 copies, caches evicted, 2
 * threads, seven runs alternated, medians): M = 16 10.0 -> 9.2 ms, 32 10.1 -> 9.1 (2 KiB
 * ahead: 9.1), 64 12.9 -> 11.9 (1, 2, 8 and 16 KiB within 0.5 ms of it), 128 20.9 -> 20.0,
 * 256 33.2 -> 32.0. */
#define W_AHEAD 4096

/* Tiles (amx_configure_full: all 16 rows x 64 bytes): tmm0-3 the 2 x 2 result tiles (16 rows
 * x 16 float32); tmm4, tmm5 x (16 rows x 32 bfloat16); tmm6, tmm7 W (16 pair rows x 16 columns) */

/* A 4-bit weight whose panels are made as they are used (dense_amx_q4): codes in tile order
 * (cpu_dense.pack_int4: per panel, per 32 columns of K, 16 rows of 16 bytes, byte c of row r
 * holding column c's codes for K 2r (low nibble) and 2r + 1 (high)); scale, zero (or NULL)
 * float32 [panels][K / group][16]; group a multiple of 32, so a tile lies in one group. */
typedef struct {
    const uint8_t *codes;
    const float *scale, *zero;
    int group;
} Q4;

/* Tile t of panel p of w in the packed layout above (dst: the panel's first tile), each value
 * as QuantWeight.dequantize(bfloat16) makes it: (q - 8) * s, rounded, + z, rounded (float32,
 * nearest even; no fused multiply-add), then to bfloat16 (nearest even). So the products are
 * amxbf16's, bit for bit. */
static void dequant_tile(const Q4 *w, long p, int t, int K, uint16_t *dst) {
    const int groups = K / w->group;
    const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    const __m128i nibble = _mm_set1_epi8(0x0F);
    /* q - 8 for each code q, as a float: one permute where a conversion and a subtraction were */
    const __m512 centred = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);
    const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const size_t at = ((size_t)p * groups + (size_t)32 * t / w->group) * 16;
    const __m512 s = _mm512_loadu_ps(w->scale + at);
    const __m512 s0 = _mm512_permutexvar_ps(lo, s), s1 = _mm512_permutexvar_ps(hi, s);
    __m512 z0 = _mm512_setzero_ps(), z1 = z0;
    if (w->zero != NULL) {
        const __m512 z = _mm512_loadu_ps(w->zero + at);
        z0 = _mm512_permutexvar_ps(lo, z);
        z1 = _mm512_permutexvar_ps(hi, z);
    }
    const uint8_t *src = w->codes + ((size_t)p * (K / 32) + t) * 256;
    uint16_t *row = dst + (size_t)t * 512;
    for (int r = 0; r < 16; r++, src += 16, row += 32) {
        const __m128i b = _mm_loadu_si128((const __m128i *)src);
        const __m128i l = _mm_and_si128(b, nibble);
        const __m128i h = _mm_and_si128(_mm_srli_epi16(b, 4), nibble);
        /* columns 0-7 and 8-15, each column's two codes side by side */
        __m512 v0 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(l, h)), centred);
        __m512 v1 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(l, h)), centred);
        v0 = _mm512_mul_round_ps(v0, s0, rn);
        v1 = _mm512_mul_round_ps(v1, s1, rn);
        if (w->zero != NULL) {
            v0 = _mm512_add_round_ps(v0, z0, rn);
            v1 = _mm512_add_round_ps(v1, z1, rn);
        }
        _mm512_storeu_si512(row, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
    }
}

/* The panels a thread takes next, made a few tiles at a time between the tile products of the
 * pair before (the vector units dequantize while the tile unit multiplies): `total` tiles (the
 * next pair's, K / 32 a panel) into dst, `per_step` after each step of a block's K loop.
 * Measured (the default model's 30 layers of projections, caches evicted, 2 threads, medians
 * of seven runs alternated with amxbf16's): made before each pair's products, M = 32 13.2 ms
 * and M = 64 16.3 against amxbf16's 9.4 and 13.3; made meanwhile, 10.2 and 12.8 against 9.6
 * and 12.5. */
typedef struct {
    const Q4 *w;
    long p;        /* the next pair's first panel */
    int K, total, done, per_step;
    uint16_t *dst; /* its two panels, one after the other */
} Making;

static inline void making_step(Making *m, int tiles) {
    for (; tiles > 0 && m->done < m->total; tiles--, m->done++) {
        const int panel = m->done / (m->K / 32), t = m->done % (m->K / 32);
        dequant_tile(m->w, m->p + panel, t, m->K, m->dst + (size_t)panel * (m->K / 32) * 512);
    }
}

/* 32 rows of x (row stride xs elements) times two panels (w0, w1: their first tiles): the
 * first `rows` rows and `cols` columns (32, or 16 for a lone last panel) of the 32 x 32 sums go
 * to out (row stride N) from column n0, rounded to bfloat16; `ahead`: ask for the panels' next
 * W_AHEAD bytes as it goes; `mk`: make some of the next panels after each step */
static void block(const uint16_t *x, long xs, int K, const uint16_t *w0, const uint16_t *w1,
                  uint16_t *out, long N, long n0, int rows, int cols, int ahead, Making *mk) {
    float c[32][32];
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int t = 0; t < K / 32; t++) {
        if (ahead) {
            const char *a0 = (const char *)(w0 + (long)t * 512) + W_AHEAD;
            const char *a1 = (const char *)(w1 + (long)t * 512) + W_AHEAD;
            for (int l = 0; l < 1024; l += 64) {
                _mm_prefetch(a0 + l, _MM_HINT_T1);
                _mm_prefetch(a1 + l, _MM_HINT_T1);
            }
        }
        _tile_loadd(4, x + 32 * t, xs * 2);
        _tile_loadd(5, x + 16 * xs + 32 * t, xs * 2);
        _tile_loadd(6, w0 + (long)t * 512, 64);
        _tile_loadd(7, w1 + (long)t * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        if (mk != NULL) making_step(mk, mk->per_step);
    }
    _tile_stored(0, &c[0][0], 128);
    _tile_stored(1, &c[0][16], 128);
    _tile_stored(2, &c[16][0], 128);
    _tile_stored(3, &c[16][16], 128);
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < cols; j++) out[(long)r * N + n0 + j] = f32_to_bf16(c[r][j]);
}
#endif

int dense_amx_available(void) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    return amx_ok;
#else
    return 0;
#endif
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
/* dense_amx's work over a packed bfloat16 weight, or (q4) a 4-bit one's panels made per
 * thread, two at a time, as each pair of panels is reached */
static int amx_matmul(const uint16_t *x, long x_stride, int M, int K, int N,
                      const uint16_t *packed, const Q4 *q4, uint16_t *out, int nthreads) {
    const int whole = M / 32 * 32, tail = M - whole, panels = N / 16, pairs = (panels + 1) / 2;
    const long tiles = (long)K / 32 * 512; /* elements of one panel */
    uint16_t *pad_x = NULL, *pad_w = NULL, *made = NULL;
    if (tail) { /* the last rows, zero-padded to 32 */
        pad_x = calloc((size_t)32 * K, 2);
        if (pad_x == NULL) return 1;
        for (int r = 0; r < tail; r++)
            memcpy(pad_x + (long)r * K, x + (long)(whole + r) * x_stride, (size_t)K * 2);
    }
    if (panels % 2) /* an odd last panel's partner: zeros */
        pad_w = calloc((size_t)tiles, 2);
    if (q4 != NULL) /* each thread's two pairs of panels: the pair it multiplies, the next */
        made = malloc(sizeof(uint16_t) * 4 * (size_t)tiles * (nthreads > 0 ? nthreads : 1));
    if ((panels % 2 && pad_w == NULL) || (q4 != NULL && made == NULL)) {
        free(pad_x);
        free(pad_w);
        free(made);
        return 1;
    }
    const int steps = (whole / 32 + (tail > 0)) * (K / 32); /* a pair's steps of block loops */
#pragma omp parallel num_threads(nthreads)
    {
        amx_configure_full();
        /* each thread a contiguous share of the pairs (a pair's bits do not depend on the
         * thread); a 4-bit weight's next pair made while the thread multiplies the one before */
#ifdef _OPENMP
        const int me = omp_get_thread_num(), nth = omp_get_num_threads();
#else
        const int me = 0, nth = 1;
#endif
        const int lo = (int)((long)pairs * me / nth), hi = (int)((long)pairs * (me + 1) / nth);
        uint16_t *now = NULL, *next = NULL;
        if (q4 != NULL) {
            now = made + (size_t)me * 4 * tiles;
            next = now + 2 * tiles;
            Making first = {q4, 2L * lo, K, 0, 0, 0, now};
            first.total = (2L * lo + 1 < panels ? 2 : 1) * (K / 32);
            if (lo < hi) making_step(&first, first.total);
        }
        for (int q = lo; q < hi; q++) {
            const long p = 2L * q;
            Making mk = {q4, p + 2, K, 0, 0, 0, next};
            if (q4 != NULL && q + 1 < hi) {
                mk.total = (p + 3 < panels ? 2 : 1) * (K / 32);
                mk.per_step = (mk.total + steps - 1) / steps;
            }
            __asm__ volatile("" ::: "memory"); /* `now` made before its tiles are loaded */
            const uint16_t *w0 = q4 != NULL ? now : packed + p * tiles;
            const uint16_t *w1 = p + 1 < panels ? w0 + tiles : pad_w;
            const int cols = p + 1 < panels ? 32 : 16;
            Making *making = q4 != NULL ? &mk : NULL; /* a made pair is in cache: no asking */
            for (int m0 = 0; m0 < whole; m0 += 32)
                block(x + (long)m0 * x_stride, x_stride, K, w0, w1, out + (long)m0 * N, N,
                      16 * p, 32, cols, q4 == NULL && m0 == 0, making);
            if (tail)
                block(pad_x, K, K, w0, w1, out + (long)whole * N, N, 16 * p, tail, cols,
                      q4 == NULL && whole == 0, making);
            if (q4 != NULL) {
                making_step(&mk, mk.total); /* what the steps left */
                __asm__ volatile("" ::: "memory"); /* `now`'s tiles loaded before it is remade */
                uint16_t *swap = now;
                now = next;
                next = swap;
            }
        }
        _tile_release();
    }
    free(pad_x);
    free(pad_w);
    free(made);
    return 0;
}
#endif

/* x [M, K] bfloat16 (row stride x_stride elements), packed W [N, K] (above), out [M, N]
 * bfloat16 contiguous. 0, or -1 (no AMX here, or shapes it does not take), 1 out of memory. */
int dense_amx(const uint16_t *x, long x_stride, int M, int K, int N, const uint16_t *packed,
              uint16_t *out, int nthreads) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if (!amx_ok || M < 1 || K < 32 || K % 32 || N < 16 || N % 16) return -1;
    return amx_matmul(x, x_stride, M, K, N, packed, NULL, out, nthreads);
#else
    (void)x, (void)x_stride, (void)M, (void)K, (void)N, (void)packed, (void)out, (void)nthreads;
    return -1;
#endif
}

/* dense_amx for a 4-bit weight (codes, scale, zero or NULL, group: see Q4 above) without a
 * dense copy: each panel dequantized to bfloat16 as a thread reaches it, the same bits as
 * dense_amx over pack(dequantize(bfloat16)). Same returns; -1 also for a group that is not a
 * multiple of 32. */
int dense_amx_q4(const uint16_t *x, long x_stride, int M, int K, int N, const uint8_t *codes,
                 const float *scale, const float *zero, int group, uint16_t *out, int nthreads) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if (!amx_ok || M < 1 || K < 32 || K % 32 || N < 16 || N % 16 || group < 32 || group % 32 ||
        K % group)
        return -1;
    const Q4 q4 = {codes, scale, zero, group};
    return amx_matmul(x, x_stride, M, K, N, NULL, &q4, out, nthreads);
#else
    (void)x, (void)x_stride, (void)M, (void)K, (void)N, (void)codes, (void)scale, (void)zero;
    (void)group, (void)out, (void)nthreads;
    return -1;
#endif
}
