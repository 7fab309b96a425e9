/* Float helpers shared by the C kernels (included, so each file inlines them): bfloat16
 * conversions as torch rounds, float16 to float32, an exp that vectorises; the pause of a
 * spin-wait loop and OpenMP's static share of a loop, for code that shares work out itself. Part
 * of every
 * kernel's build key (common/kernels/cbuild.py hashes every .h next to the sources) and of its ISA
 * level choice (an __AVX512VNNI__ test here would count for every source).
 */
#ifndef PDSERVE_VECMATH_H
#define PDSERVE_VECMATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* One spin-wait iteration's pause: x86's pause (as libgomp's), a compiler barrier elsewhere. */
static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#else
    __asm__ volatile("" : : : "memory");
#endif
}

/* Iterations [*i0, *i1) of n for thread tid of nth, as OpenMP's schedule(static) deals them
 * (contiguous shares, the first n % nth threads one more). */
static inline void static_share(int n, int tid, int nth, int *i0, int *i1) {
    int q = n / nth, t = n % nth;
    if (tid < t) q++, t = 0;
    *i0 = q * tid + t;
    *i1 = *i0 + q;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* IEEE float16 -> float32, exactly (a float16 KV cache, float16 weight scales). */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 0x3ff;
    if (e == 0) { /* zero or subnormal: m * 2^-24, exact in float32 */
        const float v = (float)m * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    const uint32_t mag = e == 31 ? 0x7f800000u : (e + 112) << 23; /* inf/NaN, or rebiased */
    const uint32_t bits = sign | mag | (m << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Round to nearest even, as torch does; NaN becomes torch's 0x7fc0. A select, not a branch, so
 * loops over it vectorise. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fff + ((u >> 16) & 1)) >> 16;
    return (uint16_t)((u & 0x7fffffff) > 0x7f800000 ? 0x7fc0 : rounded);
}

/* exp(x) within about 1 ulp in plain float arithmetic (Cephes' polynomial), so that loops over
 * it vectorise: libm's expf is a call per element. Below -87.3 it returns 2^-126 instead of a
 * subnormal (silu(x) = x / (1 + exp(-x)) is x either way); above 88.72 it gives inf. */
static inline float exp_approx(float x) {
    x = x < -87.33654f ? -87.33654f : (x > 88.72283f ? 88.72283f : x);
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

#endif
