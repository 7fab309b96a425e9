/* The tile unit's plumbing shared by the AMX sections of the C kernels (quant_gemm.c,
 * dense_amx.c, prefill_attention.c): the permission request, the tile configuration record and
 * the configuration of eight whole tiles.
 * Included only inside an includer's own AMX conditional, so this header tests no ISA macro
 * itself (common/kernels/cbuild.py counts every .h next to a source when choosing its level).
 *
 * Linux hands out the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XTILEDATA, once per process, at load). `amx_ok` says whether it was granted: refused (an
 * older kernel, a sandbox), each includer serves from its vector code instead.
 */
#ifndef PDSERVE_AMX_H
#define PDSERVE_AMX_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_ok;
__attribute__((constructor)) static void amx_request(void) {
    amx_ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* the record _tile_loadconfig reads (palette 1): per tile, its rows and bytes per row */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* all eight tiles 16 rows x 64 bytes, on the calling thread (dense_amx.c, prefill_attention.c;
 * quant_gemm.c shapes its own) */
static inline void amx_configure_full(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

#endif
