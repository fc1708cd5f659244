/* The layout-invariant init's fill on the host, fused into one pass (init_cpu.py builds and calls it).

   Each element's value is init.py's definition, computed with the same operations in the same order: the hash
   on uint32 (where a multiply wraps as the definition's masked one does), u's 53 bits converted exactly, the bin as
   searchsorted counts it, and the interpolation z0 + (u - p0) / dp * dz rounded step by step. Built with
   -ffp-contract=off and without -ffast-math, every floating-point step is one IEEE 754 operation, rounded to
   nearest even, whatever the compiler vectorizes: the values are bit for bit those of the torch ops and the GPU. */

#include <stdint.h>

#define KNOTS 4096 /* bins of init.py's quantile table */
#define BLOCK 512  /* draws hashed at once: that loop vectorizes, the table lookups after it cannot */

typedef struct {
    double p, dp, z, dz; /* a bin's lower knot, its width in p (clamped above 0) and in z */
} bin_t;

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x21F0AAADu;
    x ^= x >> 15;
    x *= 0x735A2D97u;
    return x ^ (x >> 15);
}

/* out[i] = std * the quantile of u[i]. first_bin[t] is the bin of t / 2**16, and p_next[j] the upper knot of bin j:
   a u's bin is that of its 2**-16-wide slot, plus the knots inside the slot at or below u (almost never any: the
   slots are far narrower than the bins, except at the very ends). */
void quantiles(const double *u, int64_t n, double std, const int16_t *first_bin, const bin_t *bins,
               const double *p_next, double *out64, float *out32) {
    for (int64_t i = 0; i < n; i++) {
        int32_t j = first_bin[(int32_t)(u[i] * 65536.0)]; /* exact: a power of two, then truncation */
        while (j < KNOTS - 1 && p_next[j] <= u[i])
            j++;
        const bin_t *b = bins + j;
        double v = (b->z + (u[i] - b->p) / b->dp * b->dz) * std;
        if (out64)
            out64[i] = v;
        else
            out32[i] = (float)v;
    }
}

/* Rows of a block: row r holds `cols` elements whose global flat indices are row_start[r] + 0, 1, ... (the last
   dimension is the contiguous one, sharded or not); out is float64 when out64, else float32. */
void fill(int64_t rows, int64_t cols, const int64_t *row_start, const uint32_t key[4], double std,
          const int16_t *first_bin, const bin_t *bins, const double *p_next, double *out64, float *out32) {
    double u[BLOCK];
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c0 = 0; c0 < cols; c0 += BLOCK) {
            int64_t m = cols - c0 < BLOCK ? cols - c0 : BLOCK;
            uint64_t start = (uint64_t)row_start[r] + (uint64_t)c0;
            for (int64_t c = 0; c < m; c++) {
                uint64_t index = start + (uint64_t)c;
                uint32_t lo = (uint32_t)index, hi = (uint32_t)(index >> 32);
                uint32_t a = mix32(mix32(lo ^ key[0]) ^ hi ^ key[1]);
                uint32_t b = mix32(mix32(lo ^ key[2]) ^ hi ^ key[3]);
                /* (a >> 6) * 2**27 + (b >> 5): an integer below 2**53, so both conversions and the sum are exact;
                   from int32 halves, which every vector unit converts */
                u[c] = ((double)(int32_t)(a >> 6) * 134217728.0 + (double)(int32_t)(b >> 5)) * 0x1p-53;
            }
            int64_t at = r * cols + c0;
            quantiles(u, m, std, first_bin, bins, p_next, out64 ? out64 + at : 0, out32 ? out32 + at : 0);
        }
    }
}
