/* The sparse dropout heads' 8-bit corrections of one position (heads/byte_columns.py): for each head k,
 * sum_{j in D_k} w_j * column j of W over the vocabulary, the columns stored 8 bits an entry in fbgemm's
 * row-wise format. Built and loaded by dropmatch/kernels/__init__.py.
 *
 * Every head of a position weights column j by the same w_j = h_j / (1 - p), so a column that several heads drop
 * contributes the same vector to each. The caller sorts the union of the dropped columns into groups, one per
 * set of heads that drop them (at most 2^K - 1); each group's sum is computed once and added to its heads (a
 * group of one head is summed straight into that head's: the caller orders the groups by their heads' bit
 * pattern, so a head's own group comes first and starts its sum, as the kernel's first version computed it).
 * At K = 5 and p_drop 0.3 that is ~540 column products a token instead of ~960 (fbgemm's embedding bags, one bag
 * a head, read a column once per head that drops it).
 * The vocabulary is cut into tiles of TILE tokens, each finished by one thread in the output itself (which stays
 * in the L2 cache meanwhile); a group's sum runs through its columns four at a time in registers, 8 tokens a
 * vector (bytes widened to float32 exactly).
 *
 * Speed (random 262k x 640 weight, K = 5, one position, caches flushed, 2-core AVX2 EPYC, medians of 15
 * interleaved): 8.7 ms at p_drop 0.3 and 2.7 ms at 0.032, against 14.2 and 3.5 ms for this kernel's first version
 * (tiles of 1k tokens in an L1 scratch, the compiler's own widening through 16-bit lanes, groups of one to three
 * columns padded to four), whose 1k-token tiles read each column in 1 KB runs, too short for the hardware
 * prefetchers; the same sums, bit for bit. Tile size measured at K = 5 on 2 cores only: K + 1 rows of a tile
 * are 192 KB there (at K = 62, 2 MB: past the L2 cache), and a 262k vocabulary makes 32 tiles.
 *
 * Given the clean logits, a finished tile becomes the heads and their statistics (head_statistics.c) while in cache,
 * where a second pass read the K heads back: 0.02-0.36 ms less a position than the two passes (4.4-5.9 ms; seven
 * runs, the embedded pair's shape, K = 5, p_drop 0.032). The statistics' exponentials, not their reads, are most
 * of that pass's cost; prefetching the next tile's columns meanwhile (1-4 KB of each) made it no faster.
 *
 * Arithmetic (float32 unless said): for each column, s_j = w_j * scale_j; a group's sum is s_j q_j + ... by fma,
 * its columns in the order given, from the head's running sum for a group of one head; a head's correction is
 * its other groups' sums added in order, then the sum of w_j * offset_j over its columns (float64, rounded once)
 * added. Each of the at most |D_k| + G_k + 3 <= 2 |D_k| + 3 roundings (G_k <= |D_k| groups hold head k) is at most
 * 2^-24 of sum_{j in D_k} |w_j| (255 |scale_j| + |offset_j|), inside the bound heads/byte_columns.py derives for
 * fbgemm's 2 |D_k| + 12 (tested against float64 sums).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 8192 /* vocabulary entries a thread finishes at a time: K + 1 rows of 32 KB */

/* head_statistics.c: its tile size and the statistics of one of its tiles, which byte_column_sums takes while a
 * tile of the heads is still in cache */
extern const long HEAD_STATISTICS_TILE;
void head_statistics_tile(float *logits, long k, long stride, long v0, long n, const float *clean, float keep,
                          const float *draft, float *centroid, float *head_max, double *own);
void head_statistics_total(const double *tile_sums, long n_tiles, long k, double *sums);

#if defined(__AVX2__) && defined(__FMA__)
#define VECTORS 1 /* add_columns runs 8 tokens a vector */
#include <immintrin.h>

/* 8 entries from p, as float32 (exact) */
static inline __m256 widen8(const uint8_t *p)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#endif

/* sum[t] (= s_0 q_0[t] if first, else fma(s_0, q_0[t], sum[t])), then fma(s_i, q_i[t], .) for i = 1 .. m - 1,
 * over t in [0, n): m (1 .. 4) columns of a group in registers, the same arithmetic in the vector and scalar loops */
static inline __attribute__((always_inline)) void add_columns(float *restrict sum, const uint8_t *const *q,
                                                              const float *s, long n, const int m, const int first)
{
    long t = 0;
#ifdef VECTORS
    __m256 sv[4];
    for (int i = 0; i < m; i++)
        sv[i] = _mm256_set1_ps(s[i]);
    for (; t + 8 <= n; t += 8) {
        __m256 acc = first ? _mm256_mul_ps(sv[0], widen8(q[0] + t))
                           : _mm256_fmadd_ps(sv[0], widen8(q[0] + t), _mm256_loadu_ps(sum + t));
        for (int i = 1; i < m; i++)
            acc = _mm256_fmadd_ps(sv[i], widen8(q[i] + t), acc);
        _mm256_storeu_ps(sum + t, acc);
    }
#endif
    for (; t < n; t++) {
        float acc = first ? s[0] * (float)q[0][t] : fmaf(s[0], (float)q[0][t], sum[t]);
        for (int i = 1; i < m; i++)
            acc = fmaf(s[i], (float)q[i][t], acc);
        sum[t] = acc;
    }
}

/* One group's sum over the tile [t0, t0 + n) of block b, its columns four at a time, by fma into sum (fresh: sum
 * starts at the first column's product). Adds the group's sum of w_j * offset_j to *offset_sum. */
static void group_sum(const uint8_t *restrict packed, long d, long width, long b, long t0, long n,
                      const float *restrict w, const long *restrict columns, long count, float *restrict sum,
                      int fresh, double *offset_sum)
{
    long row_bytes = width + 8;
    for (long c = 0; c < count; c += 4) {
        const uint8_t *q[4];
        float s[4];
        int m = count - c < 4 ? (int)(count - c) : 4;
        for (int i = 0; i < m; i++) {
            long j = columns[c + i];
            const uint8_t *row = packed + (b * d + j) * row_bytes;
            float scale, offset;
            memcpy(&scale, row + width, sizeof scale);
            memcpy(&offset, row + width + 4, sizeof offset);
            q[i] = row + t0;
            s[i] = w[j] * scale;
            *offset_sum += (double)w[j] * (double)offset;
        }
        switch (m * 2 + (fresh && c == 0)) { /* each case inlined with its column count and start fixed */
#define CASE(m, first)                                                                                             \
    case m * 2 + first:                                                                                            \
        add_columns(sum, q, s, n, m, first);                                                                      \
        break;
            CASE(1, 0) CASE(1, 1) CASE(2, 0) CASE(2, 1) CASE(3, 0) CASE(3, 1) CASE(4, 0) CASE(4, 1)
#undef CASE
        }
    }
}

/* packed: n_blocks * d rows of width + 8 bytes (row b * d + j: column j of W over vocabulary block b, then its
 * float32 scale and offset); w: (d) the columns' weights; columns: the union of the heads' dropped columns, group
 * after group (group g: columns[starts[g] .. starts[g + 1]), non-empty); member: (n_groups, k) 1 where head r drops
 * group g's columns. Writes out: k rows of n_blocks * width float32, laid out as the vocabulary.
 *
 * With clean (vocab) given, each finished tile of the sums becomes the heads clean / keep - sum and their
 * statistics (head_statistics.c: centroid, head_max (vocab), sums (k + 2), draft (vocab) or NULL) are taken on it
 * while it is in cache, on head_statistics' own tiles, so the heads and statistics are those of head_statistics
 * run on the sums afterwards, bit for bit; width must then be a multiple of HEAD_STATISTICS_TILE, or n_blocks 1.
 * Returns 0, or -1 (no memory for a thread's scratch or the statistics' sums, a width the statistics cannot take, or
 * a vocab past the blocks). */
int byte_column_sums(const uint8_t *restrict packed, long d, long width, long n_blocks, const float *restrict w,
                     const long *restrict columns, const long *restrict starts, const uint8_t *restrict member,
                     long n_groups, long k, float *restrict out, const float *restrict clean, float keep, long vocab,
                     const float *restrict draft, float *restrict centroid, float *restrict head_max,
                     double *restrict sums)
{
    long tiles_per_block = (width + TILE - 1) / TILE, n_tiles = n_blocks * tiles_per_block;
    long out_stride = n_blocks * width, stat_tile = HEAD_STATISTICS_TILE;
    long n_stat_tiles = clean ? (vocab + stat_tile - 1) / stat_tile : 0;
    if (clean && ((width % stat_tile && n_blocks > 1) || TILE % stat_tile || vocab > out_stride))
        return -1;
    double *stat_sums = clean ? calloc((size_t)(n_stat_tiles * (k + 2)), sizeof(double)) : NULL;
    if (clean && !stat_sums)
        return -1;
    int failed = 0;
#pragma omp parallel
    {
        float *part = malloc(sizeof(float) * TILE);
        double *offsets = malloc(sizeof(double) * (size_t)k);
        char *started = malloc((size_t)k);
        if (!part || !offsets || !started) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (long tile = 0; tile < n_tiles; tile++) {
            if (!part || !offsets || !started)
                continue;
            long b = tile / tiles_per_block, t0 = (tile % tiles_per_block) * TILE;
            long n = width - t0 < TILE ? width - t0 : TILE;
            float *rows = out + b * width + t0; /* head r's tile: rows + r * out_stride, its running sum */
            for (long r = 0; r < k; r++) {
                offsets[r] = 0.0;
                started[r] = 0;
            }
            for (long g = 0; g < n_groups; g++) {
                long count = starts[g + 1] - starts[g], members = 0, only = 0;
                for (long r = 0; r < k; r++)
                    if (member[g * k + r]) {
                        members++;
                        only = r;
                    }
                double offset_sum = 0.0;
                if (members == 1) { /* a group of one head: its columns go straight into that head's sum */
                    group_sum(packed, d, width, b, t0, n, w, columns + starts[g], count, rows + only * out_stride,
                              !started[only], &offset_sum);
                    offsets[only] += offset_sum;
                    started[only] = 1;
                    continue;
                }
                group_sum(packed, d, width, b, t0, n, w, columns + starts[g], count, part, 1, &offset_sum);
                for (long r = 0; r < k; r++) {
                    if (!member[g * k + r])
                        continue;
                    offsets[r] += offset_sum;
                    float *restrict acc = rows + r * out_stride;
                    if (!started[r])
                        memcpy(acc, part, sizeof(float) * (size_t)n);
                    else {
#pragma omp simd
                        for (long t = 0; t < n; t++)
                            acc[t] += part[t];
                    }
                    started[r] = 1;
                }
            }
            for (long r = 0; r < k; r++) {
                float *restrict acc = rows + r * out_stride;
                float offset = (float)offsets[r];
                if (!started[r]) /* a head that drops nothing */
                    memset(acc, 0, sizeof(float) * (size_t)n);
#pragma omp simd
                for (long t = 0; t < n; t++)
                    acc[t] += offset;
            }
            for (long v0 = b * width + t0, end = v0 + n; clean && v0 < end && v0 < vocab; v0 += stat_tile) {
                long m = end - v0 < stat_tile ? end - v0 : stat_tile;
                m = vocab - v0 < m ? vocab - v0 : m;
                head_statistics_tile(out, k, out_stride, v0, m, clean, keep, draft, centroid, head_max,
                                     stat_sums + (v0 / stat_tile) * (k + 2));
            }
        }
        free(part);
        free(offsets);
        free(started);
    }
    if (clean && !failed)
        head_statistics_total(stat_sums, n_stat_tiles, k, sums);
    free(stat_sums);
    return failed ? -1 : 0;
}
