/* One pass over K head logits (K, V) for the greedy DropMatch decision (rules/dropmatch.py): their mean
 * (the centroid), their maximum at each token, and the sums of the exponentials of every head, of the
 * centroid and of a draft's logits. Built and loaded by dropmatch/kernels/__init__.py.
 *
 * Each of these is a pass over the logits in torch (exp, sum, mean, amax: ~1.5 ms for 5 x 262k with the caches
 * as a verify step leaves them); here the vocabulary is read once, in tiles that stay in the L1 cache, by the
 * threads of the OpenMP runtime torch runs on (or tile by tile inside byte_columns.c's pass, which calls
 * head_statistics_tile). The exponentials are the pass's cost: with AVX2 they are computed inline (exp8, within
 * 1.5e-7 relative), else by glibc's vector math library (libmvec, <= 4 ulp). Sums: float32 within blocks of
 * SUM_BLOCK terms (at most SUM_BLOCK - 1 roundings of at most 2^-24 of the block's sum: relative error < 1e-5 with
 * the exponentials'), then float64, tile by tile in order (the same sums whatever the threads). The centroid is
 * (l_1 + ... + l_K) / K in float32, summed left to right.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define TILE 1024      /* tokens a thread finishes at a time: K + 3 rows of 4 KB */
#define SUM_BLOCK 128  /* terms summed in float32 before the float64 sum */

#if defined(__AVX2__) && defined(__FMA__)
/* e^x of 8 floats, within 1.5e-7 of its value, relative (measured: 7.5e-8 over 2^20 samples of [-87.3, 88.7];
 * tested where e^x is a normal float32); 0 below -104, +inf above 88.75, NaN kept. x = n ln 2 + r with
 * |r| <= ln 2 / 2 (ln 2 in two parts, by fma), e^r by its Taylor polynomial of degree 7 (truncation < 1e-8
 * relative) in Horner's form, and 2^n as two powers of two (n in [-150, 128]: each part a normal float). The
 * statistics of 5 x 262k heads and a draft, in cache, 2-core AVX2 EPYC: 1.3 against 1.7 ms with libmvec's expf
 * (caches flushed: 1.6 against 1.9 ms). */
static inline __m256 exp8(__m256 x)
{
    x = _mm256_min_ps(_mm256_set1_ps(88.75f), x); /* NaN is the second operand: it passes through both */
    x = _mm256_max_ps(_mm256_set1_ps(-104.0f), x);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x); /* ln 2's first 16 bits: n ln2_hi exact */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i whole = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(whole, 1), bias = _mm256_set1_epi32(127);
    __m256 first = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    __m256 second = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(whole, half), bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, first), second);
}

/* sum_t e^x[t] over [0, n): float32 within blocks of SUM_BLOCK terms (8 lanes of 16, then the lanes pairwise:
 * 18 roundings), float64 across them; the end of a block padded with -inf (e^-inf = 0) */
static double exp_sum(const float *restrict x, long n)
{
    double total = 0.0;
    for (long start = 0; start < n; start += SUM_BLOCK) {
        long end = start + SUM_BLOCK < n ? start + SUM_BLOCK : n, t = start;
        __m256 acc = _mm256_setzero_ps();
        for (; t + 8 <= end; t += 8)
            acc = _mm256_add_ps(acc, exp8(_mm256_loadu_ps(x + t)));
        if (t < end) {
            float pad[8];
            for (int i = 0; i < 8; i++)
                pad[i] = t + i < end ? x[t + i] : -INFINITY;
            acc = _mm256_add_ps(acc, exp8(_mm256_loadu_ps(pad)));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, acc);
        total += ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    }
    return total;
}
#else
__attribute__((__simd__("notinbranch"))) float expf(float); /* libmvec's vector variants (<= 4 ulp) */

/* sum_t e^x[t] over [0, n): float32 within blocks of SUM_BLOCK terms, float64 across them */
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
#endif

const long HEAD_STATISTICS_TILE = TILE; /* for byte_columns.c, which takes the statistics on the same tiles */

/* The statistics of the tokens [v0, v0 + n) (n <= TILE), n = one tile of head_statistics: logits, clean, draft,
 * centroid and head_max as there (indexed by token); writes own[0 .. k + 1], the tile's sums in head_statistics'
 * order. Also called by byte_columns.c on the tiles of the heads it has just summed (the same arithmetic, so the
 * same statistics bit for bit). */
void head_statistics_tile(float *restrict logits, long k, long stride, long v0, long n, const float *restrict clean,
                          float keep, const float *restrict draft, float *restrict centroid, float *restrict head_max,
                          double *restrict own)
{
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

/* sums[i] = the tiles' own[i] added in tile order, in float64 (the same sums whatever the threads) */
void head_statistics_total(const double *restrict tile_sums, long n_tiles, long k, double *restrict sums)
{
    for (long i = 0; i < k + 2; i++) {
        double total = 0.0;
        for (long tile = 0; tile < n_tiles; tile++)
            total += tile_sums[tile * (k + 2) + i];
        sums[i] = total;
    }
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
        head_statistics_tile(logits, k, stride, v0, n, clean, keep, draft, centroid, head_max,
                             tile_sums + tile * width);
    }
    head_statistics_total(tile_sums, n_tiles, k, sums);
    free(tile_sums);
    return 0;
}

/* The tokens a greedy decision keeps at a cut (rules/dropmatch.py): v in [0, vocab), ascending, where
 * max(head_max[v], draft[v] + shift) >= threshold, in float32 as torch computes
 * torch.maximum(head_max, draft + shift) >= threshold (a NaN on either side keeps nothing); draft may be NULL
 * (head_max alone). One pass over the two arrays where torch takes four. Writes at most capacity indices to kept;
 * returns their count, or -1 where more tokens reach the threshold. */
long kept_tokens(const float *restrict head_max, const float *restrict draft, float shift, float threshold,
                 long vocab, long *restrict kept, long capacity)
{
    long count = 0, v = 0;
#if defined(__AVX2__)
    /* 8 tokens a vector: max(a, b) >= t with neither a NaN is (a >= t or b >= t) with both ordered */
    __m256 limit = _mm256_set1_ps(threshold), by = _mm256_set1_ps(shift);
    for (; v + 8 <= vocab; v += 8) {
        __m256 top = _mm256_loadu_ps(head_max + v), hit = _mm256_cmp_ps(top, limit, _CMP_GE_OQ);
        if (draft) {
            __m256 other = _mm256_add_ps(_mm256_loadu_ps(draft + v), by);
            hit = _mm256_and_ps(_mm256_or_ps(hit, _mm256_cmp_ps(other, limit, _CMP_GE_OQ)),
                                _mm256_cmp_ps(top, other, _CMP_ORD_Q));
        }
        for (unsigned bits = (unsigned)_mm256_movemask_ps(hit); bits; bits &= bits - 1) {
            if (count == capacity)
                return -1;
            kept[count++] = v + __builtin_ctz(bits);
        }
    }
#endif
    for (; v < vocab; v++) {
        float top = head_max[v];
        if (draft) {
            float other = draft[v] + shift;
            top = isnan(top) || isnan(other) ? NAN : (top > other ? top : other);
        }
        if (top >= threshold) {
            if (count == capacity)
                return -1;
            kept[count++] = v;
        }
    }
    return count;
}
