/* One decoder layer of a decode step on the CPU, in a single call (one new token per row: a
 * sequence's decode token, or one token of a few a sequence verifies or prefills, each row with
 * its own block table and length, so that it attends causally):
 *
 *   residual += x; h = RMSNorm(residual)            (first layer: residual = x, h = RMSNorm(x))
 *   qkv = h @ Wqkv.T (+ bias); Qwen3's per-head q/k RMSNorm
 *   rotate q and k, store k and v in their cache slots
 *   a = paged attention of q over the cache
 *   residual += a @ Wo.T (+ bias); h = RMSNorm(residual)
 *   out = down(silu(gate(h)) * up(h))
 *
 * Each step is the same C function the per-op path calls (fused_ops.c, quant_matmul.c or
 * quant_gemm.c, paged_decode.c, linked into this library with their own flags), with the same
 * rounding, so a decode step's result equals the per-op path's (rows of a verify or a short
 * prefill attend through the decode kernel, rounded as a decode step at that position is, where
 * the per-op path would use its prefill attention); what goes away is the Python and torch
 * dispatch between the ops (about 12 calls a layer, which at batch 1 cost as much as the weight
 * streaming of a 4-bit model). Compiled on first use by common/kernels/cpu_layer.py, which checks the shapes;
 * its entry point is decode_layers (at the end).
 *
 * Projections are quantized (common/model/quant.py's format). dtype: 0 = float32, 1 = bfloat16;
 * every activation tensor is contiguous in that dtype. The KV cache is in that dtype too, or
 * 8-bit (kv_dtype 2 = int8, 3 = float8 e4m3) with float32 scales per (token, kv head): new K/V
 * rows are then quantized here as common/kernels/kv_quant.py does (absmax / 127 or / 448, the
 * same float32 division and round-to-nearest-even), so the cache bytes equal the per-op path's.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vecmath.h"

int add_rms_norm(const void *x, long x_stride, void *residual, long res_stride,
                 const void *weight, void *out, long out_stride, int rows, int dim, float eps,
                 int dtype);
int rope_qk(void *qkv, long qkv_stride, const int64_t *positions, const float *cos_table,
            const float *sin_table, long max_pos, int T, int H, int Hkv, int D, void *k_cache,
            void *v_cache, const int64_t *slot_mapping, long num_slots, int dtype);
int silu_mul(const void *gate_up, long in_stride, void *out, long out_stride, int T, int I,
             int dtype);
int paged_decode_kv(const void *q, long q_stride, const void *k_cache, const void *v_cache,
                    const float *k_scales, const float *v_scales, const int32_t *block_tables,
                    const int32_t *seq_lens, void *out, int B, int H, int Hkv, int D, int bs,
                    int max_blocks, float scale, int dtype, int kv_dtype, int num_threads);
int quant_matmul(const void *x_in, long x_stride, int xdtype, int M, int K, int N, int bits,
                 int gs, const void *qweight, const void *scale, const void *zero, int sdtype,
                 void *out_, int nthreads);
int qgemm_a8(const void *x_in, long x_stride, int xdtype, int M, int K, int N, int bits, int gs,
             const uint8_t *codes, const void *scale, const void *zero, int half, void *out,
             int nthreads);

/* A quantized projection [n, k]; zero and bias may be NULL. bias has the activations' dtype.
 * a8 = 0: quant_matmul's format (float activations); a8 = 1: quant_gemm.c's panels (qweight the
 * codes; sdtype the format of its scale and zero, quant_gemm.c's sf), activations quantized
 * to int8 per row and block of 32. */
typedef struct {
    const void *qweight, *scale, *zero, *bias;
    int bits, group_size, sdtype, n, k, a8;
} Proj;

typedef struct {
    Proj qkv, o, gate_up, down;
    const void *input_norm, *post_norm, *q_norm, *k_norm; /* q_norm, k_norm: NULL but Qwen3 */
    float eps, scale;
    int hidden, heads, kv_heads, head_dim, intermediate, block_size;
    void *k_cache, *v_cache; /* [blocks, block_size, kv_heads, head_dim], contiguous */
    long num_slots;
    float *k_scales, *v_scales; /* [blocks, block_size, kv_heads]: 8-bit caches only */
    int kv_dtype;               /* dtype, or 2 = int8, 3 = fp8 e4m3, 4 = float16 */
} Layer;

/* What every layer of one step shares. */
typedef struct {
    const int64_t *positions, *slot_mapping; /* [tokens] */
    const float *cos, *sin;                   /* float32 [max_pos, head_dim] */
    const int32_t *block_tables, *seq_lens;   /* [tokens, max_blocks], [tokens] */
    long max_pos;
    int tokens, max_blocks, dtype, threads;
} Step;

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

/* The rotated k heads and the v heads of qkv [T, width] into their slots of a cache not in the
 * activations' dtype: an 8-bit one (quantized, one scale per (token, kv head)) or a float16 one
 * (converted); negative slots are padding. 3 for a slot past the cache, checked before anything
 * is written. */
static int store_kv_converted(const Layer *L, const Step *s, const void *qkv, int width) {
    const int T = s->tokens, H = L->heads, Hkv = L->kv_heads, D = L->head_dim;
    const float qmax = L->kv_dtype == 2 ? 127.f : 448.f;
    for (int t = 0; t < T; t++)
        if (s->slot_mapping[t] >= L->num_slots) return 3;
    float row[D];
    for (int t = 0; t < T; t++) {
        const int64_t slot = s->slot_mapping[t];
        if (slot < 0) continue;
        for (int part = 0; part < 2; part++) { /* K, then V */
            uint8_t *cache = part ? L->v_cache : L->k_cache;
            float *scales = part ? L->v_scales : L->k_scales;
            for (int j = 0; j < Hkv; j++) {
                const long idx = (long)t * width + (long)(H + part * Hkv + j) * D;
                for (int d = 0; d < D; d++)
                    row[d] = s->dtype == 0 ? ((const float *)qkv)[idx + d]
                                           : bf16_to_f32(((const uint16_t *)qkv)[idx + d]);
                const long slot_row = slot * Hkv + j;
                if (L->kv_dtype == 4) { /* float16: converted, no scale */
                    uint16_t *dst16 = (uint16_t *)(part ? L->v_cache : L->k_cache) + slot_row * D;
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
                    dst[d] = L->kv_dtype == 2 ? (uint8_t)(int8_t)rintf(y) : f32_to_e4m3(y);
                }
            }
        }
    }
    return 0;
}

/* out [T, n] += bias [n], rounded to dtype as torch's `out + bias` rounds. */
static void add_bias(void *out, const void *bias, int T, int n, int dtype) {
    for (int t = 0; t < T; t++) {
        if (dtype == 0) {
            float *o = (float *)out + (long)t * n;
            for (int i = 0; i < n; i++) o[i] += ((const float *)bias)[i];
        } else {
            uint16_t *o = (uint16_t *)out + (long)t * n;
            const uint16_t *b = (const uint16_t *)bias;
            for (int i = 0; i < n; i++) o[i] = f32_to_bf16(bf16_to_f32(o[i]) + bf16_to_f32(b[i]));
        }
    }
}

static int project(const Proj *p, const Step *s, const void *x, void *out) {
    int rc = p->a8 ? qgemm_a8(x, p->k, s->dtype, s->tokens, p->k, p->n, p->bits, p->group_size,
                              p->qweight, p->scale, p->zero, p->sdtype, out, s->threads)
                   : quant_matmul(x, p->k, s->dtype, s->tokens, p->k, p->n, p->bits,
                                  p->group_size, p->qweight, p->scale, p->zero, p->sdtype, out,
                                  s->threads);
    if (rc == 0 && p->bias != NULL) add_bias(out, p->bias, s->tokens, p->n, s->dtype);
    return rc;
}

/* x [T, hidden] in, out [T, hidden] the MLP's output; residual [T, hidden] is updated in place.
 * first != 0 (the first layer): residual is x itself, and the first RMSNorm adds nothing.
 * Returns 0, or the failing step plus its code (9 for a negative one): 10 first RMSNorm, 20 qkv,
 * 30 q/k norm, 40 rotary, 50 attention, 60 o, 70 second RMSNorm, 80 gate/up, 90 silu, 100 down;
 * 1 when out of memory. */
static int decode_layer(const Layer *L, const Step *s, const void *x, void *residual,
                        int first, void *out) {
    const int T = s->tokens, H = L->heads, Hkv = L->kv_heads, D = L->head_dim;
    const int width = (H + 2 * Hkv) * D, hidden = L->hidden, inter = L->intermediate;
    const size_t elem = s->dtype == 0 ? 4 : 2;
    /* h | qkv | attention out | gate_up | act, one block */
    const size_t per_token = (size_t)hidden + width + (size_t)H * D + 3 * (size_t)inter;
    char *scratch = malloc(per_token * T * elem);
    if (scratch == NULL) return 1;
    char *h = scratch, *qkv = h + (size_t)T * hidden * elem;
    char *attn = qkv + (size_t)T * width * elem, *gate_up = attn + (size_t)T * H * D * elem;
    char *act = gate_up + (size_t)T * 2 * inter * elem;
    int rc, stage = 0;

    if (first) {
        rc = add_rms_norm(x, hidden, NULL, 0, L->input_norm, h, hidden, T, hidden, L->eps,
                          s->dtype);
    } else {
        rc = add_rms_norm(x, hidden, residual, hidden, L->input_norm, h, hidden, T, hidden,
                          L->eps, s->dtype);
    }
    if (rc) { stage = 10; goto done; }
    if ((rc = project(&L->qkv, s, h, qkv))) { stage = 20; goto done; }
    if (L->q_norm != NULL) {
        for (int t = 0; t < T && rc == 0; t++) {
            char *row = qkv + (size_t)t * width * elem;
            rc = add_rms_norm(row, D, NULL, 0, L->q_norm, row, D, H, D, L->eps, s->dtype);
            if (rc == 0) {
                char *k = row + (size_t)H * D * elem;
                rc = add_rms_norm(k, D, NULL, 0, L->k_norm, k, D, Hkv, D, L->eps, s->dtype);
            }
        }
        if (rc) { stage = 30; goto done; }
    }
    /* an 8-bit or float16 cache: stored here (quantized or converted), not in rope_qk */
    const int converted = L->kv_dtype != s->dtype;
    rc = rope_qk(qkv, width, s->positions, s->cos, s->sin, s->max_pos, T, H, Hkv, D,
                 converted ? NULL : L->k_cache, converted ? NULL : L->v_cache, s->slot_mapping,
                 L->num_slots, s->dtype);
    if (rc == 0 && converted) rc = store_kv_converted(L, s, qkv, width);
    if (rc) { stage = 40; goto done; }
    rc = paged_decode_kv(qkv, width, L->k_cache, L->v_cache, L->k_scales, L->v_scales,
                         s->block_tables, s->seq_lens, attn, T, H, Hkv, D, L->block_size,
                         s->max_blocks, L->scale, s->dtype, L->kv_dtype, s->threads);
    if (rc) { stage = 50; goto done; }
    /* the o projection's output goes to h: h is free again */
    if ((rc = project(&L->o, s, attn, h))) { stage = 60; goto done; }
    rc = add_rms_norm(h, hidden, residual, hidden, L->post_norm, h, hidden,
                      T, hidden, L->eps, s->dtype);
    if (rc) { stage = 70; goto done; }
    if ((rc = project(&L->gate_up, s, h, gate_up))) { stage = 80; goto done; }
    rc = silu_mul(gate_up, 2L * inter, act, inter, T, inter, s->dtype);
    if (rc) { stage = 90; goto done; }
    if ((rc = project(&L->down, s, act, out))) { stage = 100; goto done; }
done:
    free(scratch);
    return rc ? stage + (rc > 0 && rc < 10 ? rc : 9) : 0;
}

/* `count` layers in a row (the whole decoder of a decode step): layer 0 takes x and makes it
 * the residual stream (updated in place, as with first != 0 above), each layer's MLP output
 * feeds the next, the last one's lands in out. Returns 0, or 1000 * (failing layer) + its
 * decode_layer code. */
int decode_layers(const Layer *L, int count, const Step *s, void *x, void *out) {
    const size_t bytes = (size_t)s->tokens * L[0].hidden * (s->dtype == 0 ? 4 : 2);
    void *tmp = count > 1 ? malloc(bytes) : NULL;
    if (count > 1 && tmp == NULL) return 1;
    const void *in = x;
    int rc = 0;
    for (int i = 0; i < count && rc == 0; i++) {
        void *dst = (count - 1 - i) % 2 == 0 ? out : tmp; /* so the last layer writes out */
        rc = decode_layer(&L[i], s, in, x, i == 0, dst);
        if (rc) rc += 1000 * i;
        in = dst;
    }
    free(tmp);
    return rc;
}
