/* The sparse dropout heads' 8-bit corrections of one position (heads/byte_columns.py): for each head k,
 * sum_{j in D_k} w_j * column j of W over the vocabulary, the columns stored 8 bits an entry in fbgemm's
 * row-wise format. Built and loaded by dropmatch/kernels/__init__.py.
 *
 * Every head of a position weights column j by the same w_j = h_j / (1 - p), so a column that several heads drop
 * contributes the same vector to each. The caller sorts the union of the dropped columns into groups, one per
 * set of heads that drop them (at most 2^K - 1); each group's sum is computed once and added to its heads. At
 * K = 5 and p_drop 0.3 that is ~540 column products a token instead of ~960 (fbgemm's embedding bags, one bag
 * a head, read a column once per head that drops it). The vocabulary is cut into tiles that stay in the L1
 * cache, each finished by one thread; a group's sum runs through its columns four at a time in registers.
 *
 * Arithmetic (float32 unless said): for each column, s_j = w_j * scale_j; a group's sum is s_j q_j + ... by fma,
 * its columns in the order given; a head's correction is its groups' sums added in order, then the sum of
 * w_j * offset_j over its columns (float64, rounded once) added. Each of the at most |D_k| + G_k + 3 <= 2 |D_k| + 3
 * roundings (G_k <= |D_k| groups hold head k) is at most 2^-24 of sum_{j in D_k} |w_j| (255 |scale_j| + |offset_j|),
 * inside the bound heads/byte_columns.py derives for fbgemm's 2 |D_k| + 12 (tested against float64 sums).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 1024 /* vocabulary entries a thread finishes at a time: K + 1 rows of 4 KB */
#define PAD 16    /* floats between two rows of the scratch, so that they do not alias in the L1 cache */

/* One group's sum over the tile [t0, t0 + n) of block b into part (its first four columns start it). Adds the
 * group's sum of w_j * offset_j to *offset_sum. */
static void group_sum(const uint8_t *restrict packed, long d, long width, long b, long t0, long n,
                      const float *restrict w, const long *restrict columns, long count, float *restrict part,
                      double *offset_sum)
{
    long row_bytes = width + 8;
    for (long c = 0; c < count; c += 4) {
        const uint8_t *q[4];
        float s[4] = {0.f, 0.f, 0.f, 0.f};
        long m = count - c < 4 ? count - c : 4;
        for (long i = 0; i < 4; i++) {
            long j = columns[c + (i < m ? i : 0)];
            const uint8_t *row = packed + (b * d + j) * row_bytes;
            q[i] = row + t0; /* past the group's end: its first column again, with s = 0 */
            if (i < m) {
                float scale, offset;
                memcpy(&scale, row + width, sizeof scale);
                memcpy(&offset, row + width + 4, sizeof offset);
                s[i] = w[j] * scale;
                *offset_sum += (double)w[j] * (double)offset;
            }
        }
        const uint8_t *restrict q0 = q[0], *restrict q1 = q[1], *restrict q2 = q[2], *restrict q3 = q[3];
        float s0 = s[0], s1 = s[1], s2 = s[2], s3 = s[3];
        if (c == 0) {
#pragma omp simd
            for (long t = 0; t < n; t++)
                part[t] = fmaf(s3, (float)q3[t], fmaf(s2, (float)q2[t], fmaf(s1, (float)q1[t], s0 * (float)q0[t])));
        } else {
#pragma omp simd
            for (long t = 0; t < n; t++)
                part[t] = fmaf(s3, (float)q3[t], fmaf(s2, (float)q2[t], fmaf(s1, (float)q1[t],
                                                                              fmaf(s0, (float)q0[t], part[t]))));
        }
    }
}

/* packed: n_blocks * d rows of width + 8 bytes (row b * d + j: column j of W over vocabulary block b, then its
 * float32 scale and offset); w: (d) the columns' weights; columns: the union of the heads' dropped columns, group
 * after group (group g: columns[starts[g] .. starts[g + 1]), non-empty); member: (n_groups, k) 1 where head r drops
 * group g's columns. Writes out: k rows of n_blocks * width float32, laid out as the vocabulary. Returns 0, or -1
 * (no memory for a thread's scratch). */
int byte_column_sums(const uint8_t *restrict packed, long d, long width, long n_blocks, const float *restrict w,
                     const long *restrict columns, const long *restrict starts, const uint8_t *restrict member,
                     long n_groups, long k, float *restrict out)
{
    long tiles_per_block = (width + TILE - 1) / TILE, n_tiles = n_blocks * tiles_per_block;
    long out_stride = n_blocks * width;
    int failed = 0;
#pragma omp parallel
    {
        float *sums = malloc(sizeof(float) * (size_t)((k + 1) * (TILE + PAD)));
        double *offsets = malloc(sizeof(double) * (size_t)k);
        if (!sums || !offsets) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (long tile = 0; tile < n_tiles; tile++) {
            if (!sums || !offsets)
                continue;
            long b = tile / tiles_per_block, t0 = (tile % tiles_per_block) * TILE;
            long n = width - t0 < TILE ? width - t0 : TILE;
            float *restrict part = sums + k * (TILE + PAD);
            memset(sums, 0, sizeof(float) * (size_t)(k * (TILE + PAD)));
            for (long r = 0; r < k; r++)
                offsets[r] = 0.0;
            for (long g = 0; g < n_groups; g++) {
                double offset_sum = 0.0;
                group_sum(packed, d, width, b, t0, n, w, columns + starts[g], starts[g + 1] - starts[g], part,
                          &offset_sum);
                for (long r = 0; r < k; r++) {
                    if (!member[g * k + r])
                        continue;
                    offsets[r] += offset_sum;
                    float *restrict acc = sums + r * (TILE + PAD);
#pragma omp simd
                    for (long t = 0; t < n; t++)
                        acc[t] += part[t];
                }
            }
            for (long r = 0; r < k; r++) {
                float offset = (float)offsets[r];
                const float *restrict acc = sums + r * (TILE + PAD);
                float *restrict row = out + r * out_stride + b * width + t0;
#pragma omp simd
                for (long t = 0; t < n; t++)
                    row[t] = acc[t] + offset;
            }
        }
        free(sums);
        free(offsets);
    }
    return failed ? -1 : 0;
}
