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
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#include <limits.h>
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

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
/* the team's parts (quant_gemm.c, paged_decode.c: see there) */
int qgemm_a8_team_unsupported(int M, int K, int N, int bits, int gs, int sf, const void *zero);
long qgemm_a8_bytes(int M, int K, int gs);
void qgemm_a8_quantize(const void *x_in, long x_stride, int xdtype, int M, int K, int bits,
                       int gs, void *buf, int m0, int m1);
void qgemm_a8_part(const void *buf, int xdtype, int M, int K, int N, int bits, int gs,
                   const uint8_t *codes, const void *scale, const void *zero, int sf, void *out,
                   int tid, int nth, long *col0, long *col1);
void *paged_decode_plan(const int32_t *block_tables, const int32_t *seq_lens, int B, int H,
                        int Hkv, int D, int max_blocks, int num_threads);
void paged_decode_plan_free(void *plan);
int paged_decode_part_unsupported(int dtype, int kv_dtype, const float *k_scales,
                                  const float *v_scales, int bs);
void paged_decode_part(const void *plan, const void *q, long q_stride, const void *k_cache,
                       const void *v_cache, const float *k_scales, const float *v_scales,
                       const int32_t *block_tables, const int32_t *seq_lens, void *out, int B,
                       int H, int Hkv, int D, int bs, int max_blocks, float scale, int dtype,
                       int kv_dtype, int tid, int nth, void (*barrier)(void *), void *arg);

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
    int team_rows; /* steps of up to this many rows run as one team (below); 0: never */
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

/* out [T, n] columns [c0, c1) += bias [n], rounded to dtype as torch's `out + bias` rounds. */
static void add_bias(void *out, const void *bias, int T, int n, long c0, long c1, int dtype) {
    for (int t = 0; t < T; t++) {
        if (dtype == 0) {
            float *o = (float *)out + (long)t * n;
            for (long i = c0; i < c1; i++) o[i] += ((const float *)bias)[i];
        } else {
            uint16_t *o = (uint16_t *)out + (long)t * n;
            const uint16_t *b = (const uint16_t *)bias;
            for (long i = c0; i < c1; i++)
                o[i] = f32_to_bf16(bf16_to_f32(o[i]) + bf16_to_f32(b[i]));
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
    if (rc == 0 && p->bias != NULL) add_bias(out, p->bias, s->tokens, p->n, 0, p->n, s->dtype);
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

/* ---- The team: a step's layers in one parallel region ----
 *
 * Above, every projection and the attention open an OpenMP region of their own: about 5 a layer,
 * 150 a batch-1 step of the default model, plus the barriers inside them. On a 2-core AMD EPYC
 * (Zen 4) VM an empty region costs 1.3-1.4 us and a libgomp barrier 0.55 us, and at each of
 * them libgomp's last thread calls futex_wake, sleeper or not (a syscall: 476 futex calls a
 * served token). Where every projection is qgemm_a8's and the step has few rows, the layers run
 * instead in one region whose threads (the "team") meet at a barrier of their own below (0.3 us
 * there, no syscall unless a thread sleeps), 6 a layer at one row (7 where the attention merges
 * parts): after the qkv projection, the rotary and cache stores, the attention, o, gate/up and
 * down.
 * What each needs from the others' work is all it waits for. The row-wise steps (the RMSNorms
 * with their residual adds, the activations' int8 codes, SiLU * up) go one of two ways:
 *   - at one row every thread does them itself, on its own copy of the residual stream (the
 *     same function on the same values: the same bits), which is cheaper than a barrier;
 *   - from TEAM_SPLIT_ROWS rows on they are shared out by rows, the residual stream is x itself
 *     (each row updated by its thread), and a barrier follows the codes of each projection's
 *     input (10 barriers a layer).
 * Measured, default model, 2 threads, 256 tokens of context, a forward alternated with the
 * regions' one by one, medians: the shared-out steps against every thread doing them, time
 * against the regions': 1 row 0.954-0.969x vs 0.930-0.961x; 2 rows 0.930 vs 0.942; 5 rows
 * 0.932 vs 0.963; 8 rows 0.955 vs 1.003; 4 sequences 0.929 vs 0.972; 8 sequences 0.981 vs
 * 1.020; 16 sequences 0.995 vs 1.015.
 * The projections' panels, the rotary's rows and the attention's units are shared out as the
 * functions above share them (quant_gemm.c's and paged_decode.c's parts, the same static
 * schedules), so each output has the same bits as above.
 * The barrier spins for libgomp's count (GOMP_SPINCOUNT, OMP_WAIT_POLICY, 300,000 iterations by
 * default, 1,000 where threads outnumber the CPUs), then sleeps on a futex, as libgomp's
 * threads do: other processes get the cores as before. */

/* Threads meeting n at a time; err: any arriving thread's error in this round (two rounds'
 * flags, each cleared by the round before it ends). */
typedef struct {
    _Alignas(64) int arrived;
    _Alignas(64) int gen;
    int sleepers, n, err[2];
    long spins;
} Barrier;

/* GOMP_SPINCOUNT's number (a k, M, G or T suffix multiplies by powers of 1,000; "infinite"),
 * else by OMP_WAIT_POLICY (active: for ever, passive: 0), else 300,000: libgomp's rules. */
static long libgomp_spins(void) {
    const char *count = getenv("GOMP_SPINCOUNT"), *policy = getenv("OMP_WAIT_POLICY");
    if (count != NULL && *count) {
        if (!strncasecmp(count, "infinit", 7)) return LONG_MAX;
        char *end;
        long long n = strtoll(count, &end, 10);
        if (end != count && n >= 0) {
            while (*end == ' ') end++;
            const char *units = "kMGT";
            for (int i = 0; units[i]; i++)
                if (*end == units[i] || *end == (units[i] | 0x20)) {
                    for (int j = 0; j <= i && n < LLONG_MAX / 1000; j++) n *= 1000;
                    break;
                }
            return n > LONG_MAX ? LONG_MAX : (long)n;
        }
    }
    if (policy != NULL && !strcasecmp(policy, "active")) return LONG_MAX;
    if (policy != NULL && !strcasecmp(policy, "passive")) return 0;
    return 300000;
}

static long team_spins(int threads) {
    /* read once, as libgomp reads its own at load; a race writes the same */
    static long spins = -1;
    if (spins < 0) spins = libgomp_spins();
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && threads > CPU_COUNT(&set))
        return spins < 1000 ? spins : 1000;
#endif
    return spins;
}

/* Waits until all b->n threads have called it; returns nonzero where any of them passed err. */
static int team_wait(Barrier *b, int err) {
    const int g = __atomic_load_n(&b->gen, __ATOMIC_ACQUIRE);
    if (err) __atomic_store_n(&b->err[g & 1], 1, __ATOMIC_RELAXED);
    if (__atomic_add_fetch(&b->arrived, 1, __ATOMIC_ACQ_REL) == b->n) {
        /* every thread has read the other round's flag: clear it for the round after this one */
        __atomic_store_n(&b->err[(g + 1) & 1], 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->arrived, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->gen, g + 1, __ATOMIC_SEQ_CST);
#ifdef __linux__
        if (__atomic_load_n(&b->sleepers, __ATOMIC_SEQ_CST))
            syscall(SYS_futex, &b->gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#endif
        return __atomic_load_n(&b->err[g & 1], __ATOMIC_RELAXED);
    }
    for (long i = 0; i < b->spins; i++) {
        if (__atomic_load_n(&b->gen, __ATOMIC_ACQUIRE) != g)
            return __atomic_load_n(&b->err[g & 1], __ATOMIC_RELAXED);
        cpu_relax();
    }
    __atomic_add_fetch(&b->sleepers, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&b->gen, __ATOMIC_SEQ_CST) == g) {
#ifdef __linux__
        syscall(SYS_futex, &b->gen, FUTEX_WAIT_PRIVATE, g, NULL, NULL, 0);
#else
        sched_yield();
#endif
    }
    __atomic_sub_fetch(&b->sleepers, 1, __ATOMIC_SEQ_CST);
    return __atomic_load_n(&b->err[g & 1], __ATOMIC_ACQUIRE);
}

static void team_barrier(void *b) { team_wait(b, 0); }

typedef struct {
    const Layer *L;
    const Step *s;
    int count;
    void *x, *out, *tmp;
    char *qkv, *attn, *o; /* shared: [T, width], [T, H * D], [T, hidden] */
    char *gate_up;        /* shared: [T, 2 * intermediate] */
    char *h, *act, *buf;  /* shared where split: [T, hidden], [T, intermediate], int8 codes */
    int split;            /* the row-wise steps shared out by rows (else done by every thread) */
    char *own;            /* per thread, own_bytes each: residual, h [T, hidden], act [T, inter],
                           * then the int8 codes of one projection's input */
    size_t own_bytes;
    void *plan; /* paged_decode.c's, for the step's rows */
    Barrier bar;
    int rc;     /* the first failure's code, as decode_layers returns it */
} Team;

/* Rows [q0, q1) of x [T, p->k], the projection's input, quantized into buf. */
static inline void quantize_rows(const Proj *p, const Step *s, const void *x, void *buf, int q0,
                                 int q1) {
    qgemm_a8_quantize(x, p->k, s->dtype, s->tokens, p->k, p->bits, p->group_size, buf, q0, q1);
}

/* This thread's panels of (buf's quantized x) @ W.T (+ bias) into out. */
static void project_part(const Proj *p, const Step *s, const void *buf, void *out, int tid,
                         int nth) {
    long c0, c1;
    qgemm_a8_part(buf, s->dtype, s->tokens, p->k, p->n, p->bits, p->group_size, p->qweight,
                  p->scale, p->zero, p->sdtype, out, tid, nth, &c0, &c1);
    if (p->bias != NULL && c1 > c0) add_bias(out, p->bias, s->tokens, p->n, c0, c1, s->dtype);
}

/* Code as decode_layer returns it, for layer i's stage and its function's rc. */
static inline int fail_code(int i, int stage, int rc) {
    return 1000 * i + stage + (rc > 0 && rc < 10 ? rc : 9);
}

static void team_note(Team *tm, int code) {
    int none = 0;
    __atomic_compare_exchange_n(&tm->rc, &none, code, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
}

/* Thread tid of nth's part of the team's step: every layer, stage by stage. */
static void team_run(Team *tm, int tid, int nth) {
    const Step *s = tm->s;
    const int T = s->tokens, dtype = s->dtype, split = tm->split;
    const size_t elem = dtype == 0 ? 4 : 2;
    const int hidden = tm->L[0].hidden, inter = tm->L[0].intermediate;
    /* the rows this thread computes the row-wise steps of: all of them, or its share */
    int q0 = 0, q1 = T, r0, r1;
    static_share(T, tid, nth, &r0, &r1);
    if (split) q0 = r0, q1 = r1;
    const int mine = q1 - q0;
    char *res, *h, *act, *buf;
    if (split) { /* shared: the residual stream is x itself, each row updated by its thread */
        res = tm->x, h = tm->h, act = tm->act, buf = tm->buf;
    } else {
        res = tm->own + tm->own_bytes * tid;
        h = res + (((size_t)T * hidden * elem + 63) & ~(size_t)63);
        act = h + (((size_t)T * hidden * elem + 63) & ~(size_t)63);
        buf = act + (((size_t)T * inter * elem + 63) & ~(size_t)63);
    }
    const size_t hrow = (size_t)hidden * elem, q0h = (size_t)q0 * hrow;
    Barrier *bar = &tm->bar;
    const void *in = tm->x;
    for (int i = 0; i < tm->count; i++) {
        const Layer *L = &tm->L[i];
        const int H = L->heads, Hkv = L->kv_heads, D = L->head_dim;
        const int width = (H + 2 * Hkv) * D;
        void *dst = (tm->count - 1 - i) % 2 == 0 ? tm->out : tm->tmp;
        int rc = 0;
        /* the input RMSNorm (layer 0: of x, which becomes the residual stream) */
        if (i == 0 && !split) memcpy(res, tm->x, (size_t)T * hidden * elem);
        if (mine && i == 0)
            rc = add_rms_norm((const char *)tm->x + q0h, hidden, NULL, 0, L->input_norm, h + q0h,
                              hidden, mine, hidden, L->eps, dtype);
        else if (mine)
            rc = add_rms_norm((const char *)in + q0h, hidden, res + q0h, hidden, L->input_norm,
                              h + q0h, hidden, mine, hidden, L->eps, dtype);
        if (rc) team_note(tm, fail_code(i, 10, rc));
        else quantize_rows(&L->qkv, s, h, buf, q0, q1);
        if (split && team_wait(bar, rc)) return;
        if (rc == 0) project_part(&L->qkv, s, buf, tm->qkv, tid, nth);
        if (team_wait(bar, rc)) return;
        /* this thread's rows: q/k norms, rotary, the cache slots */
        for (int t = r0; t < r1 && rc == 0 && L->q_norm != NULL; t++) {
            char *row = tm->qkv + (size_t)t * width * elem;
            rc = add_rms_norm(row, D, NULL, 0, L->q_norm, row, D, H, D, L->eps, dtype);
            if (rc == 0) {
                char *k = row + (size_t)H * D * elem;
                rc = add_rms_norm(k, D, NULL, 0, L->k_norm, k, D, Hkv, D, L->eps, dtype);
            }
            if (rc) team_note(tm, fail_code(i, 30, rc));
        }
        if (rc == 0 && r1 > r0) {
            const int converted = L->kv_dtype != dtype;
            char *rows = tm->qkv + (size_t)r0 * width * elem;
            rc = rope_qk(rows, width, s->positions + r0, s->cos, s->sin, s->max_pos, r1 - r0, H,
                         Hkv, D, converted ? NULL : L->k_cache, converted ? NULL : L->v_cache,
                         s->slot_mapping + r0, L->num_slots, dtype);
            if (rc == 0 && converted) {
                const char *k = rows + (size_t)H * D * elem, *v = k + (size_t)Hkv * D * elem;
                rc = store_kv_rows(k, width, v, width, r1 - r0, Hkv, D, dtype,
                                   s->slot_mapping + r0, L->num_slots, L->k_cache, L->v_cache,
                                   L->k_scales, L->v_scales, L->kv_dtype);
            }
            if (rc) team_note(tm, fail_code(i, 40, rc));
        }
        if (team_wait(bar, rc)) return;
        paged_decode_part(tm->plan, tm->qkv, width, L->k_cache, L->v_cache, L->k_scales,
                          L->v_scales, s->block_tables, s->seq_lens, tm->attn, T, H, Hkv, D,
                          L->block_size, s->max_blocks, L->scale, dtype, L->kv_dtype, tid, nth,
                          team_barrier, bar);
        team_wait(bar, 0);
        quantize_rows(&L->o, s, tm->attn, buf, q0, q1);
        if (split) team_wait(bar, 0);
        project_part(&L->o, s, buf, tm->o, tid, nth);
        team_wait(bar, 0);
        if (mine)
            rc = add_rms_norm(tm->o + q0h, hidden, res + q0h, hidden, L->post_norm, h + q0h,
                              hidden, mine, hidden, L->eps, dtype);
        if (rc) team_note(tm, fail_code(i, 70, rc));
        else quantize_rows(&L->gate_up, s, h, buf, q0, q1);
        if (split && team_wait(bar, rc)) return;
        if (rc == 0) project_part(&L->gate_up, s, buf, tm->gate_up, tid, nth);
        if (team_wait(bar, rc)) return;
        const size_t arow = (size_t)inter * elem;
        if (mine)
            rc = silu_mul(tm->gate_up + (size_t)q0 * 2 * arow, 2L * inter, act + q0 * arow, inter,
                          mine, inter, dtype);
        if (rc) team_note(tm, fail_code(i, 90, rc));
        else quantize_rows(&L->down, s, act, buf, q0, q1);
        if (split && team_wait(bar, rc)) return;
        if (rc == 0) project_part(&L->down, s, buf, dst, tid, nth);
        if (team_wait(bar, rc)) return;
        in = dst;
    }
    if (!split && tid == 0) memcpy(tm->x, res, (size_t)T * hidden * elem); /* the stream out */
}

/* Whether the team takes this step: its switch, threads to share, few rows, every projection
 * qgemm_a8's vector tiles, the attention's cache kinds, one shape for all layers (the shared
 * buffers and the attention plan are the step's). */
static int team_applies(const Layer *L, int count, const Step *s) {
    if (s->threads < 2 || s->tokens < 1 || s->tokens > s->team_rows || count < 1) return 0;
#ifdef _OPENMP
    if (omp_in_parallel() || omp_get_dynamic() || omp_get_thread_limit() < s->threads) return 0;
#else
    return 0;
#endif
    for (int i = 0; i < count; i++) {
        const Layer *l = &L[i];
        if (l->hidden != L[0].hidden || l->heads != L[0].heads ||
            l->kv_heads != L[0].kv_heads || l->head_dim != L[0].head_dim ||
            l->intermediate != L[0].intermediate ||
            paged_decode_part_unsupported(s->dtype, l->kv_dtype, l->k_scales, l->v_scales,
                                          l->block_size))
            return 0;
        const Proj *ps[4] = {&l->qkv, &l->o, &l->gate_up, &l->down};
        for (int j = 0; j < 4; j++)
            if (ps[j]->a8 != 1 ||
                qgemm_a8_team_unsupported(s->tokens, ps[j]->k, ps[j]->n, ps[j]->bits,
                                          ps[j]->group_size, ps[j]->sdtype, ps[j]->zero))
                return 0;
    }
    return 1;
}

#define TEAM_SPLIT_ROWS 2 /* rows from which the row-wise steps are shared out (above) */

static int team_steps = 0; /* wraps: tests read differences */

/* The step by the team. Returns as decode_layers does, or -1 where it did not run (no plan, or
 * fewer threads than asked): the caller runs the layers one region at a time instead. */
static int team_layers(const Layer *L, int count, const Step *s, void *x, void *out) {
    const int T = s->tokens, nth = s->threads;
    const int H = L[0].heads, Hkv = L[0].kv_heads, D = L[0].head_dim;
    const int hidden = L[0].hidden, inter = L[0].intermediate, width = (H + 2 * Hkv) * D;
    const size_t elem = s->dtype == 0 ? 4 : 2;
    long most = 0; /* the largest projection input's codes */
    for (int i = 0; i < count; i++) {
        const Proj *ps[4] = {&L[i].qkv, &L[i].o, &L[i].gate_up, &L[i].down};
        for (int j = 0; j < 4; j++) {
            const long b = qgemm_a8_bytes(T, ps[j]->k, ps[j]->group_size);
            most = b > most ? b : most;
        }
    }
#define A64(n) (((size_t)(n) + 63) & ~(size_t)63)
    const int split = T >= TEAM_SPLIT_ROWS;
    const size_t rowwise = A64(T * hidden * elem) + A64(T * inter * elem) + A64(most);
    const size_t own = split ? 0 : A64(T * hidden * elem) + rowwise; /* + its residual */
    const size_t shared = A64(T * width * elem) + A64(T * H * D * elem) +
                          2 * A64(T * hidden * elem) + A64(2 * T * inter * elem) +
                          (split ? rowwise : 0);
    char *mem = aligned_alloc(64, shared + own * nth);
    void *plan = paged_decode_plan(s->block_tables, s->seq_lens, T, H, Hkv, D, s->max_blocks,
                                   nth);
    if (mem == NULL || plan == NULL) {
        free(mem);
        paged_decode_plan_free(plan);
        return -1;
    }
    Team tm = {.L = L, .s = s, .count = count, .x = x, .out = out, .plan = plan,
               .own_bytes = own, .split = split, .rc = 0};
    tm.qkv = mem, tm.attn = tm.qkv + A64(T * width * elem);
    tm.o = tm.attn + A64(T * H * D * elem), tm.tmp = tm.o + A64(T * hidden * elem);
    tm.gate_up = (char *)tm.tmp + A64(T * hidden * elem);
    tm.own = tm.gate_up + A64(2 * T * inter * elem);
    tm.h = tm.own, tm.act = tm.h + A64(T * hidden * elem), tm.buf = tm.act + A64(T * inter * elem);
#undef A64
    tm.bar.n = nth, tm.bar.spins = team_spins(nth);
    int short_team = 0;
#pragma omp parallel num_threads(nth)
    {
#ifdef _OPENMP
        if (omp_get_num_threads() != nth) { /* every thread sees it: none waits for another */
            if (omp_get_thread_num() == 0) short_team = 1;
        } else {
            team_run(&tm, omp_get_thread_num(), nth);
        }
#endif
    }
    paged_decode_plan_free(plan);
    free(mem);
    if (!short_team) __atomic_add_fetch(&team_steps, 1, __ATOMIC_RELAXED);
    return short_team ? -1 : tm.rc;
}

/* How many steps the team has run in this process (tests read it). */
int decode_layers_team_steps(void) { return __atomic_load_n(&team_steps, __ATOMIC_RELAXED); }

/* `count` layers in a row (the whole decoder of a decode step): layer 0 takes x and makes it
 * the residual stream (updated in place, as with first != 0 above), each layer's MLP output
 * feeds the next, the last one's lands in out. Returns 0, or 1000 * (failing layer) + its
 * decode_layer code. Steps the team takes (above) run in one parallel region. */
int decode_layers(const Layer *L, int count, const Step *s, void *x, void *out) {
    if (team_applies(L, count, s)) {
        const int rc = team_layers(L, count, s, x, out);
        if (rc >= 0) return rc;
    }
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
