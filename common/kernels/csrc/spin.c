/* How long one iteration of libgomp's wait before sleeping takes on this CPU: a relaxed load of
 * the word waited on, then cpu_relax (x86's pause; a compiler barrier elsewhere, as libgomp's
 * generic one). GOMP_SPINCOUNT counts these iterations, and a pause takes from a few to over a
 * hundred cycles depending on the core, so common/runtime/omp_spin.py times them here to turn a
 * spin time into a count. Compiled on first use; entry point spin_ns.
 */
#include <time.h>

#include "vecmath.h" /* cpu_relax */

static volatile int word = 0; /* never set: every load says "keep waiting" */

/* *ns = nanoseconds per iteration over `spins` of them. Returns 0, or 1 for spins < 1. */
int spin_ns(long spins, double *ns) {
    if (spins < 1) return 1;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < spins; i++) {
        if (__atomic_load_n(&word, __ATOMIC_RELAXED)) break;
        cpu_relax();
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    *ns = ((double)(b.tv_sec - a.tv_sec) * 1e9 + (double)(b.tv_nsec - a.tv_nsec)) / (double)spins;
    return 0;
}
