/* A bfloat16 matmul on AMX tiles for the CPU: out[M, N] = x[M, K] @ W.T, x and out bfloat16,
 * W a dense bfloat16 copy of a quantized weight (cpu_quant's "amxbf16" path; the C decode
 * layers call it too). Compiled on first use by common/kernels/cpu_dense.py, which also packs
 * W into the tile layout below; entry points `dense_amx` and `dense_amx_available`.
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
 * kernel had 29% of the samples, 63% of its own on the W loads and the product after them. Measured (the default model's 30 layers of projections,
 * bfloat16 copies, caches evicted, 2 threads, seven runs alternated, medians): M = 16 10.0 ->
 * 9.2 ms, 32 10.1 -> 9.1 (2 KiB ahead: 9.1), 64 12.9 -> 11.9 (1, 2, 8 and 16 KiB within 0.5 ms
 * of it), 128 20.9 -> 20.0, 256 33.2 -> 32.0. */
#define W_AHEAD 4096

/* Tiles (amx_configure_full: all 16 rows x 64 bytes): tmm0-3 the 2 x 2 result tiles (16 rows
 * x 16 float32); tmm4, tmm5 x (16 rows x 32 bfloat16); tmm6, tmm7 W (16 pair rows x 16 columns) */

/* 32 rows of x (row stride xs elements) times two panels (w0, w1: their first tiles): the
 * first `rows` rows and `cols` columns (32, or 16 for a lone last panel) of the 32 x 32 sums go
 * to out (row stride N) from column n0, rounded to bfloat16; `ahead`: ask for the panels' next
 * W_AHEAD bytes as it goes */
static void block(const uint16_t *x, long xs, int K, const uint16_t *w0, const uint16_t *w1,
                  uint16_t *out, long N, long n0, int rows, int cols, int ahead) {
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

/* x [M, K] bfloat16 (row stride x_stride elements), packed W [N, K] (above), out [M, N]
 * bfloat16 contiguous. 0, or -1 (no AMX here, or shapes it does not take), 1 out of memory. */
int dense_amx(const uint16_t *x, long x_stride, int M, int K, int N, const uint16_t *packed,
              uint16_t *out, int nthreads) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if (!amx_ok || M < 1 || K < 32 || K % 32 || N < 16 || N % 16) return -1;
    const int whole = M / 32 * 32, tail = M - whole, panels = N / 16, pairs = (panels + 1) / 2;
    const long tiles = (long)K / 32 * 512; /* elements of one panel */
    uint16_t *pad_x = NULL, *pad_w = NULL;
    if (tail) { /* the last rows, zero-padded to 32 */
        pad_x = calloc((size_t)32 * K, 2);
        if (pad_x == NULL) return 1;
        for (int r = 0; r < tail; r++)
            memcpy(pad_x + (long)r * K, x + (long)(whole + r) * x_stride, (size_t)K * 2);
    }
    if (panels % 2) { /* an odd last panel's partner: zeros */
        pad_w = calloc((size_t)tiles, 2);
        if (pad_w == NULL) {
            free(pad_x);
            return 1;
        }
    }
#pragma omp parallel num_threads(nthreads)
    {
        amx_configure_full();
#pragma omp for schedule(static)
        for (int q = 0; q < pairs; q++) {
            const long p = 2L * q;
            const uint16_t *w0 = packed + p * tiles;
            const uint16_t *w1 = p + 1 < panels ? w0 + tiles : pad_w;
            const int cols = p + 1 < panels ? 32 : 16;
            for (int m0 = 0; m0 < whole; m0 += 32)
                block(x + (long)m0 * x_stride, x_stride, K, w0, w1, out + (long)m0 * N, N,
                      16 * p, 32, cols, m0 == 0);
            if (tail)
                block(pad_x, K, K, w0, w1, out + (long)whole * N, N, 16 * p, tail, cols,
                      whole == 0);
        }
        _tile_release();
    }
    free(pad_x);
    free(pad_w);
    return 0;
#else
    (void)x, (void)x_stride, (void)M, (void)K, (void)N, (void)packed, (void)out, (void)nthreads;
    return -1;
#endif
}
