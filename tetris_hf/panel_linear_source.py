"""The C source of the CPU's panel linear kernel (:mod:`tetris_hf.cpu_kernels` builds and calls it): ``y = x @ W.T
(+ bias)`` on a copy of ``W`` laid out in blocks of 32 outputs, for any number of rows.

Kept as a string in a module of its own so that it travels wherever the package's modules do (see
:mod:`tetris_hf.row_attention_source`). Compiled with ``gcc -O3 -march=native -fopenmp``; GCC's vector extensions
(``vector_size``) are lowered to whatever vectors the CPU has, ``sum += x * w`` to fused multiply-adds.

The layout: ``W`` ``(N, K)`` as ``ceil(N / 32)`` blocks of ``(K, 32)`` (block ``p``, row ``k`` holds ``W[32 p .. 32 p +
31, k]``; the last block's missing outputs zero), so that a block is one stream of cache lines read front to back. A
tile of up to 12 rows keeps its sums (up to 12 x 32) in vector registers for the whole of ``K`` (each input element,
broadcast, feeds two products); the rows are cut into tiles of equal heights (16 rows: two of 8), and a block's tiles
run one after another, the block read from memory by the first and from the cache by the rest. Each output is the same
sum in the same order, ``k = 0 .. K - 1``, one fused multiply-add each: a row's outputs do not depend on how many rows
share the call. Threads split the blocks, each thread's blocks contiguous, and meet every 240 rows (so that those rows'
inputs stay cached). ``panel_linear_parts`` multiplies stacked weights (a module's q/k/v, say), each part in blocks of
its own, and writes each part's outputs into a tensor of its own; ``panel_linear`` is its one-part case.

Why: a decode step's products are bound by reading the weights, which oneDNN's kernel read slower than this one
does; in blocks of 32 one stream feeds both of a tile's vectors, so the same kernel serves prompts as well, with no
third copy of the weights, and a row's outputs do not depend on the row count (measurements: docs/benchmarks.md, "A
linear kernel for few rows" and "One linear kernel for every row count").
"""

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <omp.h>

#define LANES 16       /* fp32 lanes of a vector */
#define WIDTH 32       /* outputs a block holds: two vectors */
#define TILE 12        /* rows a tile holds (24 sums in registers) */
#define SPAN 240       /* rows the threads' blocks meet in turn (their inputs stay cached) */

typedef float vector __attribute__((vector_size(LANES * sizeof(float))));

/* sums (rows, 32), contiguous, = x (rows, K), rows ldx apart, @ block (K, 32): each sum over k = 0 .. K - 1 in order */
static inline __attribute__((always_inline)) void tile(const int rows, const float *x, int64_t ldx,
        const float *block, int64_t K, float *sums) {
    vector first[TILE], second[TILE];
    for (int m = 0; m < rows; m++) first[m] = second[m] = (vector){0};
    for (int64_t k = 0; k < K; k++) {
        vector w, v;
        memcpy(&w, block + WIDTH * k, sizeof w);
        memcpy(&v, block + WIDTH * k + LANES, sizeof v);
        for (int m = 0; m < rows; m++) {
            float input = x[m * ldx + k];
            first[m] += input * w;
            second[m] += input * v;
        }
    }
    for (int m = 0; m < rows; m++) {
        memcpy(sums + m * WIDTH, &first[m], sizeof(vector));
        memcpy(sums + m * WIDTH + LANES, &second[m], sizeof(vector));
    }
}

/* the tiles by row count, each compiled for its count (sums in registers, loops unrolled) */
#define ROWS(n) case n: tile(n, x, ldx, block, K, sums); break;
static void tile_of(int rows, const float *x, int64_t ldx, const float *block, int64_t K, float *sums) {
    switch (rows) { ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8) ROWS(9) ROWS(10) ROWS(11) ROWS(12) }
}

static inline int64_t smaller(int64_t a, int64_t b) { return a < b ? a : b; }

static inline int64_t blocks_of(int64_t outputs) { return (outputs + WIDTH - 1) / WIDTH; }

/* where block p's outputs go: part i holds outputs first[i] .. first[i + 1] - 1, in blocks of its own, in ys[i] (rows
   ldys[i] apart); the block's first output there, its row stride, its bias and its width */
typedef struct { float *y; int64_t ldy; const float *bias; int lanes; } place;

static inline place place_of(int64_t p, int parts, const int64_t *first, float *const *ys, const int64_t *ldys,
                             const float *bias) {
    int i = 0;
    while (i + 1 < parts && p >= blocks_of(first[i + 1] - first[i])) {
        p -= blocks_of(first[i + 1] - first[i]);
        i++;
    }
    const int64_t offset = p * WIDTH, left = first[i + 1] - first[i] - offset;
    place at = {ys[i] + offset, ldys[i], bias ? bias + first[i] + offset : 0, (int)smaller(WIDTH, left)};
    return at;
}

/* rows of the place's outputs = sums (rows, 32) (+ bias) */
static inline void put(int rows, const float *sums, place at) {
    for (int m = 0; m < rows; m++) {
        float *y = at.y + m * at.ldy;
        const float *sum = sums + m * WIDTH;
        if (at.bias)
            for (int j = 0; j < at.lanes; j++) y[j] = sum[j] + at.bias[j];
        else
            memcpy(y, sum, at.lanes * sizeof(float));
    }
}

/* ys[i] (M, first[i + 1] - first[i]), rows ldys[i] apart, for each part i < parts: x (M, K), rows ldx apart, @ W.T
   (+ bias (N,)); W (N, K) the parts' weights stacked, each as blocks (K, 32) of its own, one part's after another
   (first: parts + 1 ints, first[0] = 0, first[parts] = N) */
void panel_linear_parts(const float *x, int64_t M, int64_t ldx, const float *blocks, int64_t K, const float *bias,
                        int parts, const int64_t *first, float *const *ys, const int64_t *ldys, int threads) {
    int64_t count = 0;
    for (int i = 0; i < parts; i++) count += blocks_of(first[i + 1] - first[i]);
    #pragma omp parallel num_threads(threads)
    {
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t low = count * me / team, high = count * (me + 1) / team;
        float sums[SPAN * WIDTH] __attribute__((aligned(64)));  /* a span's sums for one block */
        for (int64_t start = 0; start < M; start += SPAN) {
            const int64_t end = smaller(M, start + SPAN), tiles = (end - start + TILE - 1) / TILE;
            const int64_t step = (end - start + tiles - 1) / tiles;  /* the span's rows in tiles of equal heights */
            for (int64_t p = low; p < high; p++) {
                for (int64_t m = start; m < end; m += step)
                    tile_of((int)smaller(step, end - m), x + m * ldx, ldx, blocks + p * WIDTH * K, K,
                            sums + (m - start) * WIDTH);
                place at = place_of(p, parts, first, ys, ldys, bias);
                at.y += start * at.ldy;
                put((int)(end - start), sums, at);
            }
        }
    }
}

/* y (M, N), rows ldy apart = x (M, K), rows ldx apart, @ W.T (+ bias (N,)); W as ceil(N / 32) blocks (K, 32) */
void panel_linear(const float *x, int64_t M, int64_t ldx, const float *blocks, int64_t N, int64_t K,
                  const float *bias, float *y, int64_t ldy, int threads) {
    const int64_t first[2] = {0, N};
    panel_linear_parts(x, M, ldx, blocks, K, bias, 1, first, &y, &ldy, threads);
}
"""
