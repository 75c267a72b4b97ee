"""The C source of the CPU's panel linear kernel (:mod:`tetris_hf.cpu_kernels` builds and calls it): ``y = x @ W.T
(+ bias)`` for the few rows a decode or verify step multiplies, on a copy of ``W`` laid out in panels.

Kept as a string in a module of its own so that it travels wherever the package's modules do (see
:mod:`tetris_hf.row_attention_source`). Compiled with ``gcc -O3 -march=native -fopenmp``; GCC's vector extensions
(``vector_size``) are lowered to whatever vectors the CPU has, ``sum += x * w`` to fused multiply-adds.

The layout: ``W`` ``(N, K)`` as ``ceil(N / 16)`` panels of ``(K, 16)`` (panel ``p``, row ``k`` holds ``W[16 p .. 16 p +
15, k]``; the last panel's missing outputs zero), so that one panel is one stream of cache lines read front to back,
asked for ``AHEAD`` floats before it is read. A tile keeps each of its rows' 16 sums in a register for the whole of
``K``: one panel and up to 16 rows (a decode step: every weight read once, each multiplied by all rows at once), or
two panels and up to 12 rows (more rows: each broadcast input feeds two products). Either way each output is the same
sum in the same order, ``k = 0 .. K - 1``, one fused multiply-add each: a row's outputs do not depend on how many rows
share the call. Threads split the panels (``#pragma omp``), each thread's panels contiguous. ``panel_linear_parts``
multiplies stacked weights (a module's q/k/v, say) and writes each part's outputs into a tensor of its own, its
panels whole (every part but the last a multiple of 16 outputs); ``panel_linear`` is its one-part case.

Why: at 16 rows a step's products are bound by reading the weights (SmolLM2-135M: 538 MB a step), and oneDNN's
kernel read them at 11-19 GB/s where this one reads 18-22 (docs/benchmarks.md, "A linear kernel for few rows").
"""

SOURCE = r"""
#include <stdint.h>
#include <string.h>

#define LANES 16       /* outputs a panel holds: one vector of fp32 lanes */
#define ROWS 16        /* rows a one-panel tile holds (16 sums in registers) */
#define PAIR_ROWS 12   /* rows a two-panel tile holds (24 sums in registers) */
#define AHEAD 1024     /* floats ahead of the panel row read whose memory is asked for (4 KB: 64 panel rows) */

typedef float vector __attribute__((vector_size(LANES * sizeof(float))));

/* y[0 .. lanes) = sum (+ bias[0 .. lanes)) */
static inline void store(float *y, vector sum, const float *bias, int lanes) {
    if (bias) {
        vector more = {0};
        memcpy(&more, bias, lanes * sizeof(float));
        sum += more;
    }
    memcpy(y, &sum, lanes * sizeof(float));
}

/* rows x 16 outputs: x (rows, K) rows ldx apart, one panel (K, 16), y rows ldy apart */
static inline __attribute__((always_inline)) void one_panel(const int rows, const float *x, int64_t ldx,
        const float *panel, int64_t K, float *y, int64_t ldy, const float *bias, int lanes) {
    vector sum[ROWS];
    for (int m = 0; m < rows; m++) sum[m] = (vector){0};
    for (int64_t k = 0; k < K; k++) {
        __builtin_prefetch(panel + LANES * k + AHEAD, 0, 0);
        vector w;
        memcpy(&w, panel + LANES * k, sizeof w);
        for (int m = 0; m < rows; m++) sum[m] += x[m * ldx + k] * w;
    }
    for (int m = 0; m < rows; m++) store(y + m * ldy, sum[m], bias, lanes);
}

/* rows x 32 outputs: two panels, the second K * 16 floats after the first, its outputs lanes wide at y2 (rows ldy2
   apart: the next part's, where the two panels' outputs belong to two parts) */
static inline __attribute__((always_inline)) void two_panels(const int rows, const float *x, int64_t ldx,
        const float *panel, int64_t K, float *y, int64_t ldy, const float *bias, float *y2, int64_t ldy2,
        const float *bias2, int lanes) {
    vector first[PAIR_ROWS], second[PAIR_ROWS];
    const float *next = panel + LANES * K;
    for (int m = 0; m < rows; m++) first[m] = second[m] = (vector){0};
    for (int64_t k = 0; k < K; k++) {
        __builtin_prefetch(panel + LANES * k + AHEAD, 0, 0);
        __builtin_prefetch(next + LANES * k + AHEAD, 0, 0);
        vector w, v;
        memcpy(&w, panel + LANES * k, sizeof w);
        memcpy(&v, next + LANES * k, sizeof v);
        for (int m = 0; m < rows; m++) {
            float input = x[m * ldx + k];
            first[m] += input * w;
            second[m] += input * v;
        }
    }
    for (int m = 0; m < rows; m++) {
        store(y + m * ldy, first[m], bias, LANES);
        store(y2 + m * ldy2, second[m], bias2, lanes);
    }
}

/* the tiles by row count, each compiled for its count (sums in registers, loops unrolled) */
#define ONE(n) case n: one_panel(n, x, ldx, panel, K, y, ldy, bias, lanes); break;
static void one_panel_tile(int rows, const float *x, int64_t ldx, const float *panel, int64_t K, float *y,
                           int64_t ldy, const float *bias, int lanes) {
    switch (rows) {
        ONE(1) ONE(2) ONE(3) ONE(4) ONE(5) ONE(6) ONE(7) ONE(8) ONE(9) ONE(10) ONE(11) ONE(12) ONE(13) ONE(14)
        ONE(15) ONE(16)
    }
}
#define TWO(n) case n: two_panels(n, x, ldx, panel, K, y, ldy, bias, y2, ldy2, bias2, lanes); break;
static void two_panel_tile(int rows, const float *x, int64_t ldx, const float *panel, int64_t K, float *y,
                           int64_t ldy, const float *bias, float *y2, int64_t ldy2, const float *bias2, int lanes) {
    switch (rows) { TWO(1) TWO(2) TWO(3) TWO(4) TWO(5) TWO(6) TWO(7) TWO(8) TWO(9) TWO(10) TWO(11) TWO(12) }
}

static inline int64_t smaller(int64_t a, int64_t b) { return a < b ? a : b; }

/* where panel p's outputs go: part i holds outputs first[i] .. first[i + 1] - 1 (each first[i] a multiple of 16), in
   ys[i], rows ldys[i] apart; the panel's first output there, its row stride, its bias and its width */
typedef struct { float *y; int64_t ldy; const float *bias; int lanes; } place;

static inline place place_of(int64_t p, int parts, const int64_t *first, float *const *ys, const int64_t *ldys,
                             const float *bias, int64_t N) {
    int i = 0;
    while (i + 1 < parts && first[i + 1] <= p * LANES) i++;
    place at = {ys[i] + (p * LANES - first[i]), ldys[i], bias ? bias + p * LANES : 0,
                (int)smaller(LANES, N - p * LANES)};
    return at;
}

/* ys[i] (M, first[i + 1] - first[i]), rows ldys[i] apart, for each part i < parts: x (M, K), rows ldx apart, @ W.T
   (+ bias (N,)); W (N, K) as ceil(N / 16) panels (K, 16), the parts' outputs one after another (first: parts + 1
   ints, first[0] = 0, first[parts] = N) */
void panel_linear_parts(const float *x, int64_t M, int64_t ldx, const float *panels, int64_t N, int64_t K,
                        const float *bias, int parts, const int64_t *first, float *const *ys, const int64_t *ldys,
                        int threads) {
    const int64_t count = (N + LANES - 1) / LANES;
    if (M <= ROWS) {  /* every weight read once for all rows */
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t p = 0; p < count; p++) {
            place at = place_of(p, parts, first, ys, ldys, bias, N);
            one_panel_tile((int)M, x, ldx, panels + p * LANES * K, K, at.y, at.ldy, at.bias, at.lanes);
        }
        return;
    }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t pair = 0; pair < (count + 1) / 2; pair++) {
        const int64_t p = 2 * pair;
        const float *panel = panels + p * LANES * K;
        place at = place_of(p, parts, first, ys, ldys, bias, N);
        if (p + 1 < count) {
            place next = place_of(p + 1, parts, first, ys, ldys, bias, N);
            for (int64_t m = 0; m < M; m += PAIR_ROWS)
                two_panel_tile((int)smaller(PAIR_ROWS, M - m), x + m * ldx, ldx, panel, K, at.y + m * at.ldy, at.ldy,
                               at.bias, next.y + m * next.ldy, next.ldy, next.bias, next.lanes);
        } else {  /* an odd count's last panel */
            for (int64_t m = 0; m < M; m += ROWS)
                one_panel_tile((int)smaller(ROWS, M - m), x + m * ldx, ldx, panel, K, at.y + m * at.ldy, at.ldy,
                               at.bias, at.lanes);
        }
    }
}

/* y (M, N), rows ldy apart = x (M, K), rows ldx apart, @ W.T (+ bias (N,)); W as ceil(N / 16) panels (K, 16) */
void panel_linear(const float *x, int64_t M, int64_t ldx, const float *panels, int64_t N, int64_t K,
                  const float *bias, float *y, int64_t ldy, int threads) {
    const int64_t first[2] = {0, N};
    panel_linear_parts(x, M, ldx, panels, N, K, bias, 1, first, &y, &ldy, threads);
}
"""
