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
 * rows are then quantized by fused_ops.c's store_kv_rows, as the per-op path's are (so the
 * cache bytes equal its).
 */
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
int store_kv_rows(const void *k, long k_stride, const void *v, long v_stride, int T, int Hkv,
                  int D, int dtype, const int64_t *slots, long num_slots, void *k_cache,
                  void *v_cache, float *k_scales, float *v_scales, int kv_dtype);
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
int dense_amx(const uint16_t *x, long x_stride, int M, int K, int N, const uint16_t *packed,
              uint16_t *out, int nthreads);
int dense_amx_q4(const uint16_t *x, long x_stride, int M, int K, int N, const uint8_t *codes,
                 const float *scale, const float *zero, int group, uint16_t *out, int nthreads);

/* A quantized projection [n, k]; zero and bias may be NULL. bias has the activations' dtype.
 * a8 = 0: quant_matmul's format (float activations); a8 = 1: quant_gemm.c's panels (qweight the
 * codes; sdtype the format of its scale and zero, quant_gemm.c's sf), activations quantized
 * to int8 per row and block of 32; a8 = 2: dense_amx.c's tiles of the bfloat16 weight (qweight;
 * bfloat16 activations only, no scales); a8 = 3: dense_amx_q4's 4-bit codes in tile order
 * (qweight), float32 scale and zero [panels, groups, 16] (bfloat16 activations only). */
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

/* The rotated k heads and the v heads of qkv [T, width] into their slots of a cache not in the
 * activations' dtype (fused_ops.c's store_kv_rows: quantized or converted). */
static int store_kv_converted(const Layer *L, const Step *s, const void *qkv, int width) {
    const size_t elem = s->dtype == 0 ? 4 : 2;
    const char *k = (const char *)qkv + (size_t)L->heads * L->head_dim * elem;
    const char *v = k + (size_t)L->kv_heads * L->head_dim * elem;
    return store_kv_rows(k, width, v, width, s->tokens, L->kv_heads, L->head_dim, s->dtype,
                         s->slot_mapping, L->num_slots, L->k_cache, L->v_cache, L->k_scales,
                         L->v_scales, L->kv_dtype);
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
    int rc;
    if (p->a8 == 3)
        rc = dense_amx_q4(x, p->k, s->tokens, p->k, p->n, p->qweight, p->scale, p->zero,
                          p->group_size, out, s->threads);
    else if (p->a8 == 2)
        rc = dense_amx(x, p->k, s->tokens, p->k, p->n, p->qweight, out, s->threads);
    else if (p->a8)
        rc = qgemm_a8(x, p->k, s->dtype, s->tokens, p->k, p->n, p->bits, p->group_size,
                      p->qweight, p->scale, p->zero, p->sdtype, out, s->threads);
    else
        rc = quant_matmul(x, p->k, s->dtype, s->tokens, p->k, p->n, p->bits, p->group_size,
                          p->qweight, p->scale, p->zero, p->sdtype, out, s->threads);
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
