/* One pass over K head logits (K, V) for the greedy DropMatch decision (rules/dropmatch.py): their mean
 * (the centroid), their maximum at each token, and the sums of the exponentials of every head, of the
 * centroid and of a draft's logits. Built and loaded by dropmatch/kernels/__init__.py.
 *
 * Each of these is a pass over the logits in torch (exp, sum, mean, amax: ~1.5 ms for 5 x 262k with the caches
 * as a verify step leaves them); here the vocabulary is read once, in tiles that stay in the L1 cache, by the
 * threads of the OpenMP runtime torch runs on. Exponentials come from glibc's vector math library (libmvec,
 * <= 4 ulp). Sums: float32 within blocks of SUM_BLOCK terms (<= SUM_BLOCK - 1 roundings of at most 2^-24 of
 * the block's sum: relative error < 1e-5 with the exponentials'), then float64, tile by tile in order (the same
 * sums whatever the threads). The centroid is (l_1 + ... + l_K) / K in float32, summed left to right.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

__attribute__((__simd__("notinbranch"))) float expf(float); /* libmvec's vector variants */

#define TILE 1024      /* tokens a thread finishes at a time: K + 3 rows of 4 KB */
#define SUM_BLOCK 128  /* terms summed in float32 before the float64 sum */

static double exp_sum(const float *restrict x, long n)
{
    double total = 0.0;
    for (long start = 0; start < n; start += SUM_BLOCK) {
        long end = start + SUM_BLOCK < n ? start + SUM_BLOCK : n;
        float block = 0.f;
#pragma omp simd reduction(+ : block)
        for (long t = start; t < end; t++)
            block += expf(x[t]);
        total += block;
    }
    return total;
}

/* logits: k rows of vocab floats, row i at logits + i * stride; draft (vocab) or NULL. With clean (vocab) given,
 * the rows hold the heads' corrections and become clean / keep - row first, in place (as torch computes
 * (clean / keep) - row in float32). Writes centroid, head_max (vocab) and sums[0..k-1] (heads), sums[k]
 * (centroid), sums[k + 1] (draft, 0 without one). Returns 0, or -1 (k < 1, or no memory for the per-tile sums). */
int head_statistics(float *restrict logits, long k, long vocab, long stride, const float *restrict clean,
                    float keep, const float *restrict draft, float *restrict centroid, float *restrict head_max,
                    double *restrict sums)
{
    if (k < 1)
        return -1;
    long n_tiles = (vocab + TILE - 1) / TILE, width = k + 2;
    double *tile_sums = calloc((size_t)(n_tiles * width), sizeof(double)); /* summed in order below: deterministic */
    if (!tile_sums)
        return -1;
#pragma omp parallel for schedule(static)
    for (long tile = 0; tile < n_tiles; tile++) {
        long v0 = tile * TILE, n = vocab - v0 < TILE ? vocab - v0 : TILE;
        double *own = tile_sums + tile * width;
        float *restrict mean = centroid + v0, *restrict top = head_max + v0;
        for (long i = 0; clean && i < k; i++) {
            float *restrict row = logits + i * stride + v0;
#pragma omp simd
            for (long t = 0; t < n; t++)
                row[t] = clean[v0 + t] / keep - row[t];
        }
        const float *restrict first = logits + v0;
#pragma omp simd
        for (long t = 0; t < n; t++) {
            mean[t] = first[t];
            top[t] = first[t];
        }
        own[0] = exp_sum(first, n);
        for (long i = 1; i < k; i++) {
            const float *restrict row = logits + i * stride + v0;
#pragma omp simd
            for (long t = 0; t < n; t++) {
                mean[t] += row[t];
                top[t] = top[t] > row[t] ? top[t] : row[t];
            }
            own[i] = exp_sum(row, n);
        }
        float count = (float)k;
#pragma omp simd
        for (long t = 0; t < n; t++)
            mean[t] /= count;
        own[k] = exp_sum(mean, n);
        own[k + 1] = draft ? exp_sum(draft + v0, n) : 0.0;
    }
    for (long i = 0; i < width; i++) {
        double total = 0.0;
        for (long tile = 0; tile < n_tiles; tile++)
            total += tile_sums[tile * width + i];
        sums[i] = total;
    }
    free(tile_sums);
    return 0;
}
