/* y = x W^T (+ bias) in float32 for a few rows x (decode and verify steps), W (n, k) read in its own row-major
 * layout (no reordered copy). Built and loaded by dropmatch/kernels/__init__.py; used by
 * dropmatch/onednn_linear.py where oneDNN's float32 few-row GEMMs fall short (CPUs without AVX-512).
 *
 * A step reads every weight once from memory and does little arithmetic with it (2 m flops a weight for m
 * rows), so the kernel streams W: each thread walks its share of W's rows in order, software-prefetching a
 * few rows ahead so that the loads overlap the arithmetic, and multiplies each loaded W vector with every row
 * of x (held in cache) before the next load.
 *
 * Arithmetic, the same for every entry whatever m, the blocking or the thread: y[i][v] is 8 partial sums,
 * lane l over k = l, l + 8, ... in order by fma; then ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7)); then
 * the k % 8 last terms by fma in order; then + bias[v]. So a row's output does not depend on the rows beside it
 * (a verify step's rows equal the same rows decoded one at a time, bit for bit), and its error is at most
 * (ceil(k / 8) + 3 + k % 8 + 1) 2^-24 sum_j |x_j w_j| (+ the bias's rounding) to first order.
 */
#include <math.h>
#include <string.h>
#ifdef __FMA__
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));

#define MAX_ROWS 12 /* rows of x a pass holds: a verify step of up to 12 rows reads W once (AVX2 EPYC, trunk
                     * + head: 8 and 9 rows 4-6 % faster than passes of 6 + 2 and 6 + 3 rows; 1 row the same) */
#define CHUNK 16    /* W rows a thread takes at a time (every pass over x re-reads them from cache) */
#define AHEAD 4     /* W rows prefetched ahead of the one being read */
#define AHEAD_OF(nb) (AHEAD > (nb) ? AHEAD : (nb)) /* from a block of nb rows: AHEAD rows on, or the next block */
_Static_assert(MAX_ROWS == 12, "pass() has a case for each of 1 .. MAX_ROWS rows");

static inline v8 load8(const float *p)
{
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline v8 fma8(v8 a, v8 b, v8 c)
{
#ifdef __FMA__
    return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    v8 r;
    for (int l = 0; l < 8; l++)
        r[l] = fmaf(a[l], b[l], c[l]);
    return r;
#endif
}

static inline float lanes_sum(v8 s)
{
    return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

/* nb consecutive W rows times mb rows of x (nb * mb accumulators and nb W vectors), prefetching the W rows
 * ahead rows on (rows W holds). */
static inline __attribute__((always_inline)) void block(const float *restrict x, long ldx, const float *restrict w,
                                                        long ldw, long k, long ahead, const float *restrict bias,
                                                        float *restrict y, long ldy, const int nb, const int mb)
{
    v8 acc[4][MAX_ROWS];
    long k8 = k & ~7L;
    for (int r = 0; r < nb; r++)
        for (int i = 0; i < mb; i++)
            acc[r][i] = (v8){0};
    for (long t = 0; t < k8; t += 8) {
        if (!(t & 15)) /* a cache line of each W row to prefetch */
            for (int r = 0; r < nb; r++)
                __builtin_prefetch(w + (ahead + r) * ldw + t);
        v8 wv[4];
        for (int r = 0; r < nb; r++)
            wv[r] = load8(w + r * ldw + t);
        for (int i = 0; i < mb; i++) {
            v8 xv = load8(x + i * ldx + t);
            for (int r = 0; r < nb; r++)
                acc[r][i] = fma8(wv[r], xv, acc[r][i]);
        }
    }
    for (int r = 0; r < nb; r++)
        for (int i = 0; i < mb; i++) {
            float s = lanes_sum(acc[r][i]);
            for (long t = k8; t < k; t++)
                s = fmaf(x[i * ldx + t], w[r * ldw + t], s);
            y[i * ldy + r] = bias ? s + bias[r] : s;
        }
}

/* W rows [0, n) times mb (<= MAX_ROWS) rows of x: four W rows at a time for up to 3 rows of x, two for 4-6, one
 * for 7-12 (the compiler keeps what does not fit the 16 vector registers as memory operands). W holds rest >= n
 * rows from w on: a block prefetches the rows AHEAD (or its nb) rows on where W holds them, else its own. */
static void pass(const float *x, long ldx, const float *w, long n, long rest, long ldw, long k, const float *bias,
                 float *y, long ldy, long mb)
{
    switch (mb) {
#define BLOCK(v, nb, rows)                                                                                     \
    block(x, ldx, w + (v) * ldw, ldw, k, (v) + AHEAD_OF(nb) + (nb) <= rest ? AHEAD_OF(nb) : 0,                   \
          bias ? bias + (v) : 0, y + (v), ldy, nb, rows)
#define PASS(rows, nb)                                                                                         \
    case rows: {                                                                                               \
        long v = 0;                                                                                            \
        for (; v + nb <= n; v += nb)                                                                           \
            BLOCK(v, nb, rows);                                                                                \
        for (; v < n; v++)                                                                                     \
            BLOCK(v, 1, rows);                                                                                 \
        break;                                                                                                 \
    }
        PASS(1, 4) PASS(2, 4) PASS(3, 4) PASS(4, 2) PASS(5, 2) PASS(6, 2)
        PASS(7, 1) PASS(8, 1) PASS(9, 1) PASS(10, 1) PASS(11, 1) PASS(12, 1)
#undef PASS
#undef BLOCK
    }
}

/* W rows [0, n) times all m rows of x, MAX_ROWS rows of x a pass (W holds rest >= n rows from w on). */
static void passes(const float *x, long m, long ldx, const float *w, long n, long rest, long ldw, long k,
                   const float *bias, float *y, long ldy)
{
    for (long i = 0; i < m; i += MAX_ROWS)
        pass(x + i * ldx, ldx, w, n, rest, ldw, k, bias, y + i * ldy, ldy, m - i < MAX_ROWS ? m - i : MAX_ROWS);
}

/* x: m rows of k floats, row stride ldx; w: n rows of k floats, row stride ldw; bias: n floats or NULL;
 * y: m rows of n floats, row stride ldy. */
void few_row_linear(const float *x, long m, long k, long ldx, const float *w, long n, long ldw, const float *bias,
                    float *y, long ldy)
{
    long chunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static)
    for (long c = 0; c < chunks; c++) {
        long v = c * CHUNK, count = n - v < CHUNK ? n - v : CHUNK;
        passes(x, m, ldx, w + v * ldw, count, n - v, ldw, k, bias ? bias + v : 0, y + v, ldy);
    }
}

/* The same product on the W rows index names only: y[i][j] = x_i . W[index[j]] (+ bias[index[j]]) for j < count,
 * each entry computed as few_row_linear computes it (so equal, bit for bit, to its column index[j]). For the few
 * hundred to few thousand tokens a decision makes exact, without a gathered copy of their rows. */
void few_row_linear_at(const float *x, long m, long k, long ldx, const float *w, long ldw, const long *index,
                       long count, const float *bias, float *y, long ldy)
{
#pragma omp parallel for schedule(static)
    for (long j = 0; j < count; j++) {
        if (j + 2 < count) { /* the row after next, its last line included */
            const float *ahead = w + index[j + 2] * ldw;
            for (long t = 0; t < k; t += 16)
                __builtin_prefetch(ahead + t);
            __builtin_prefetch(ahead + k - 1);
        }
        passes(x, m, ldx, w + index[j] * ldw, 1, 1, ldw, k, bias ? bias + index[j] : 0, y + j, ldy);
    }
}
