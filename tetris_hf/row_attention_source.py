"""The C source of the CPU's row-walking attention kernel, of the packed cache write beside it and of the prompts'
tiled causal attention (:mod:`tetris_hf.cpu_attention` builds and calls them).

Kept as a string in a module of its own so that it travels wherever the package's modules do (the wheel, the Hub
folder's flat copy, the Space) without data files. Compiled with ``gcc -O3 -march=native -fopenmp``; GCC's vector
extensions (``vector_size``) are lowered to whatever vectors the CPU has.

What it computes, for row ``b`` and key-value head ``h``: the ``G = H / H_kv`` query heads ``h * G .. h * G + G - 1``
(transformers' grouped-query order) at each of the ``L`` positions are one block of ``G * L`` queries; the keys are
those some query of the row may see (mask true), each read once for the whole block. Softmax in two passes (scores,
then the maximum, exponentials and sums), then the weighted values, each read once; each pass asks for the memory of
the key (value) ``AHEAD`` slots on while it reads one (a decode step's keys and values come from DRAM: the
kernel then reads them at the machine's bandwidth, about 24 GB/s on two cores here, where it read 17 without). A query
that sees no key gets zeros (sdpa's kernels differ there; such a query is filler whose output nothing reads).

``prompt_attention`` reads prompts (many queries a row, causal over the row's own keys) as a GEMM multiplies: the keys
transposed into panels of 16 once, then tiles of 12 queries (positions x query heads of one key-value head) scored
against 32 keys at a time with every sum in a register, the softmax in two passes over the tile's scores, and the
weighted values 6 queries x 64 columns at a time.
"""

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#define FEW_QUERIES 4  /* at most this many queries a key-value head: keys not transposed (see attend_row_head) */
#define AHEAD 16  /* keys (values) ahead of the one read whose memory is asked for (a cache's rows come from DRAM) */
#define KEYS 16  /* keys scored together: one vector of fp32 lanes (AVX-512), the block's keys transposed first */

typedef float vector __attribute__((vector_size(KEYS * sizeof(float))));  /* (GCC lowers it to the CPU's vectors) */
typedef int32_t lanes __attribute__((vector_size(KEYS * sizeof(float))));  /* comparisons: -1 (true) or 0 a lane */

static inline vector load(const float *from) { vector v; memcpy(&v, from, sizeof v); return v; }
static inline void store(float *to, vector v) { memcpy(to, &v, sizeof v); }
static inline vector pick(lanes where, vector yes, vector no) {  /* yes where true, else no */
    return (vector)((where & (lanes)yes) | (~where & (lanes)no));
}

static inline void prefetch(const float *row, int64_t D) {  /* a key's or value's D floats, every cache line */
    for (int64_t byte = 0; byte < D * (int64_t)sizeof(float); byte += 64) __builtin_prefetch((const char *)row + byte);
}

static inline float sum_lanes(vector v) {  /* v[0] + ... + v[KEYS - 1], halving */
    v += __builtin_shuffle(v, (lanes){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (lanes){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (lanes){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1});
    v += __builtin_shuffle(v, (lanes){1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0});
    return v[0];
}

/* tile[d][t] = tile[t][d]: a KEYS x KEYS tile transposed in place, by swapping ever smaller blocks (8, 4, 2, 1) */
static inline void transpose(vector *tile) {
#define SWAP(W, LOW, HIGH)                                                                                         \
    for (int i = 0; i < KEYS; i++)                                                                                 \
        if (!(i & W)) {                                                                                            \
            const vector a = tile[i], b = tile[i + W];                                                             \
            tile[i] = __builtin_shuffle(a, b, LOW);                                                                \
            tile[i + W] = __builtin_shuffle(a, b, HIGH);                                                           \
        }
    SWAP(8, ((lanes){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}),
         ((lanes){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}))
    SWAP(4, ((lanes){0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}),
         ((lanes){4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}))
    SWAP(2, ((lanes){0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}),
         ((lanes){2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}))
    SWAP(1, ((lanes){0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}),
         ((lanes){1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}))
#undef SWAP
}

/* e^x for x <= 0 (a score minus its row's maximum), within 2 ulp, and 0 for x = -inf (a key the query may not see):
 * Cephes' expf, lane by lane. */
static inline vector exp_nonpositive(vector x) {
    const lanes seen = x > -INFINITY;
    const vector lowest = (vector){0.0f} - 87.0f;  /* (e^-87 is still a normal float) */
    x = pick(x < lowest, lowest, x);
    vector n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504088896341f + 0.5f, lanes), vector);
    n = pick(n > x * 1.44269504088896341f + 0.5f, n - 1.0f, n);  /* floor (the conversion truncated to zero) */
    const vector r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vector p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const lanes power = (__builtin_convertvector(n, lanes) + 127) << 23;
    return (vector)((lanes)(p * (vector)power) & seen);
}

/* One row b, one key-value head h (see row_attention): its L queries from query position query_first on, their
 * outputs from row out_first of out (B * L, H, D) on, mask already at the row's first query's; scratch: room for S
 * slot indices, Q rows of S scores rounded up to KEYS, D vectors of transposed keys, L vectors of mask biases, Q * D
 * sums and Q sums. Inlined with D a constant where it is 64 or 128. */
static inline __attribute__((always_inline)) void attend_row_head(
        const float *query, int64_t q_b, int64_t q_h, int64_t q_l,
        const float *key, int64_t k_b, int64_t k_h, int64_t k_s,
        const float *value, int64_t v_b, int64_t v_h, int64_t v_s,
        const uint8_t *mask, int64_t m_b, int64_t m_l, int64_t m_s,
        float *out, int64_t b, int64_t query_first, int64_t out_first, int64_t h, int64_t H, int64_t G, int64_t L,
        int64_t S, const int64_t D, float scale, int64_t *slots, float *scores, vector *transposed, vector *biases,
        float *accumulated, float *sums) {
    const int64_t Q = G * L;
    const uint8_t *row_mask = mask + b * m_b;
    const float *row_keys = key + b * k_b + h * k_h, *row_values = value + b * v_b + h * v_h;  /* b, h at slot 0 */
    query += query_first * q_l;  /* (a packed block's row starts at its first token) */
    int64_t n = 0;
    for (int64_t s = 0; s < S; s++) {  /* the slots some query of the row sees */
        uint8_t seen = 0;
        for (int64_t l = 0; l < L; l++) seen |= row_mask[l * m_l + s * m_s];
        if (seen) slots[n++] = s;
    }
    const int64_t width = (n + KEYS - 1) / KEYS * KEYS;  /* a row of scores: the n keys, then -inf */
    const int64_t chunks = D / KEYS;  /* whole vectors of a key or value; the last D % KEYS elements one by one */
    const int few = Q <= FEW_QUERIES && chunks * KEYS == D;
    for (int64_t first = 0; first < n; first += KEYS) {  /* scores, KEYS keys at a time, each key read once */
        const int64_t count = n - first < KEYS ? n - first : KEYS;
        for (int64_t l = 0; l < L; l++)  /* 0 where position l sees the key, else -inf */
            for (int64_t t = 0; t < KEYS; t++)
                biases[l][t] = t < count && row_mask[l * m_l + slots[first + t] * m_s] ? 0.0f : -INFINITY;
        if (few) {  /* a decode step's few queries: each key's products summed across its lanes, no transposing */
            vector dots[FEW_QUERIES] = {{0.0f}};
            for (int64_t t = 0; t < count; t++) {
                const float *k = row_keys + slots[first + t] * k_s;
                if (first + t + AHEAD < n) prefetch(row_keys + slots[first + t + AHEAD] * k_s, D);
                for (int64_t i = 0; i < Q; i++) {
                    const float *q = query + b * q_b + (h * G + i / L) * q_h + i % L * q_l;
                    vector products = load(q) * load(k);
                    for (int64_t c = 1; c < chunks; c++) products += load(q + c * KEYS) * load(k + c * KEYS);
                    dots[i][t] = sum_lanes(products);
                }
            }
            for (int64_t i = 0; i < Q; i++) store(scores + i * width + first, dots[i] * scale + biases[i % L]);
            continue;
        }
        const float *block[KEYS];  /* the block's keys, the first repeated past the n-th (scores dropped) */
        for (int64_t t = 0; t < KEYS; t++) {
            block[t] = row_keys + slots[first + (t < count ? t : 0)] * k_s;
            if (first + t + AHEAD < n) prefetch(row_keys + slots[first + t + AHEAD] * k_s, D);
        }
        if (chunks * KEYS == D) {  /* KEYS x KEYS tiles transposed in vectors */
            for (int64_t c = 0; c < chunks; c++) {
                vector tile[KEYS];
                for (int64_t t = 0; t < KEYS; t++) tile[t] = load(block[t] + c * KEYS);
                transpose(tile);
                for (int64_t d = 0; d < KEYS; d++) transposed[c * KEYS + d] = tile[d];
            }
        } else {
            for (int64_t t = 0; t < KEYS; t++)
                for (int64_t d = 0; d < D; d++) transposed[d][t] = block[t][d];
        }
        for (int64_t i = 0; i < Q; i++) {
            const float *q = query + b * q_b + (h * G + i / L) * q_h + i % L * q_l;
            vector dots[4] = {{0.0f}, {0.0f}, {0.0f}, {0.0f}};  /* (four chains of products, not one) */
            int64_t d = 0;
            for (; d + 4 <= D; d += 4)
                for (int64_t u = 0; u < 4; u++) dots[u] += q[d + u] * transposed[d + u];
            for (; d < D; d++) dots[0] += q[d] * transposed[d];
            store(scores + i * width + first, (dots[0] + dots[1] + (dots[2] + dots[3])) * scale + biases[i % L]);
        }
    }
    for (int64_t i = 0; i < Q; i++) {  /* exponentials and their sums */
        float *row = scores + i * width, maximum = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : maximum)
        for (int64_t j = 0; j < width; j++) maximum = row[j] > maximum ? row[j] : maximum;
        if (maximum == -INFINITY) {  /* (a query that sees no key) */
            for (int64_t j = 0; j < width; j++) row[j] = 0.0f;
        } else {
            vector total = {0.0f};
            for (int64_t j = 0; j < width; j += KEYS) {
                const vector p = exp_nonpositive(load(row + j) - maximum);
                store(row + j, p);
                total += p;
            }
            for (int64_t t = 0; t < KEYS; t++) sum += total[t];
        }
        sums[i] = sum;
    }
    if (few) {  /* weighted values, each read once for the few queries, their sums in registers */
        vector sums_d[FEW_QUERIES][chunks];
        for (int64_t i = 0; i < Q; i++)
            for (int64_t c = 0; c < chunks; c++) sums_d[i][c] = (vector){0.0f};
        for (int64_t j = 0; j < n; j++) {
            const float *v = row_values + slots[j] * v_s;
            if (j + AHEAD < n) prefetch(row_values + slots[j + AHEAD] * v_s, D);
            for (int64_t i = 0; i < Q; i++) {
                const float weight = scores[i * width + j];
                for (int64_t c = 0; c < chunks; c++) sums_d[i][c] += weight * load(v + c * KEYS);
            }
        }
        for (int64_t i = 0; i < Q; i++)
            for (int64_t c = 0; c < chunks; c++) store(accumulated + i * D + c * KEYS, sums_d[i][c]);
    } else {
        for (int64_t i = 0; i < Q * D; i++) accumulated[i] = 0.0f;
        for (int64_t first = 0; first < n; first += KEYS) {  /* weighted values, KEYS at a time, each read once */
            const int64_t count = n - first < KEYS ? n - first : KEYS;
            const float *values[KEYS];
            for (int64_t t = 0; t < count; t++) {
                values[t] = row_values + slots[first + t] * v_s;
                if (first + t + AHEAD < n) prefetch(row_values + slots[first + t + AHEAD] * v_s, D);
            }
            for (int64_t i = 0; i < Q; i++) {
                const float *p = scores + i * width + first;
                float *acc = accumulated + i * D;
                vector sums_d[chunks > 0 ? chunks : 1];  /* (registers where D is a constant) */
                for (int64_t c = 0; c < chunks; c++) sums_d[c] = load(acc + c * KEYS);
                for (int64_t t = 0; t < count; t++) {
                    const float weight = p[t], *v = values[t];
                    for (int64_t c = 0; c < chunks; c++) sums_d[c] += weight * load(v + c * KEYS);
                    for (int64_t d = chunks * KEYS; d < D; d++) acc[d] += weight * v[d];
                }
                for (int64_t c = 0; c < chunks; c++) store(acc + c * KEYS, sums_d[c]);
            }
        }
    }
    for (int64_t i = 0; i < Q; i++) {
        const int64_t g = i / L, l = i % L;
        float *o = out + ((out_first + l) * H + h * G + g) * D;
        const float inverse = sums[i] > 0.0f ? 1.0f / sums[i] : 0.0f;
        for (int64_t d = 0; d < D; d++) o[d] = accumulated[i * D + d] * inverse;
    }
}

/* query (B, H, L, D) with strides q_b, q_h, q_l; key and value (B, Hk, S, D) with strides k_* and v_*; mask (B or 1,
 * 1, L or 1, S) bool with strides m_b, m_l, m_s (0 where broadcast); out (B, L, H, D) contiguous; threads: OpenMP's
 * (the process's runtime, torch's).
 * Packed (ends not NULL): query (1, H, N, D) holds the rows' tokens one row after another, q_b 0 and q_l the stride
 * between tokens; row b's are tokens ends[b - 1] - first_token .. ends[b] - first_token - 1 (ends[-1]: first_token),
 * at most L of them, its first at mask row columns[its first token] (the rest follow it); out (N, H, D). */
void row_attention(const float *query, int64_t q_b, int64_t q_h, int64_t q_l,
                   const float *key, int64_t k_b, int64_t k_h, int64_t k_s,
                   const float *value, int64_t v_b, int64_t v_h, int64_t v_s,
                   const uint8_t *mask, int64_t m_b, int64_t m_l, int64_t m_s,
                   float *out, int64_t B, int64_t H, int64_t Hk, int64_t L, int64_t S, int64_t D, float scale,
                   int threads, const int64_t *ends, const int64_t *columns, int64_t first_token) {
    const int64_t G = H / Hk, Q = G * L;
#pragma omp parallel num_threads(threads)
    {
        const size_t room = (size_t)((S + KEYS - 1) / KEYS * KEYS + KEYS);
        int64_t *slots = malloc(sizeof(int64_t) * room);
        float *scores = malloc(sizeof(float) * (size_t)Q * room);
        vector *transposed = aligned_alloc(sizeof(vector), sizeof(vector) * (size_t)D);
        vector *biases = aligned_alloc(sizeof(vector), sizeof(vector) * (size_t)L);
        float *accumulated = malloc(sizeof(float) * (size_t)(Q * D)), *sums = malloc(sizeof(float) * (size_t)Q);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < B * Hk; task++) {
            const int64_t b = task / Hk, h = task % Hk;
            int64_t first = 0, out_first = b * L, length = L;
            const uint8_t *row_mask = mask;
            if (ends) {  /* a packed block: the row's tokens, their first mask row */
                first = (b ? ends[b - 1] : first_token) - first_token;
                out_first = first;
                length = ends[b] - first_token - first;
                if (length <= 0) continue;
                row_mask += columns[first] * m_l;
            }
#define ATTEND(DIM) attend_row_head(query, q_b, q_h, q_l, key, k_b, k_h, k_s, value, v_b, v_h, v_s, row_mask, m_b, \
                                    m_l, m_s, out, b, first, out_first, h, H, G, length, S, DIM, scale, slots, scores, \
                                    transposed, biases, accumulated, sums)
            if (D == 64) ATTEND(64);
            else if (D == 128) ATTEND(128);
            else ATTEND(D);
        }
        free(slots); free(scores); free(transposed); free(biases); free(accumulated); free(sums);
    }
}

/* A packed block's keys and values into their rows' slots: token t (of N) of key_states and value_states
 * (1, H, N, D), strides ks_h, ks_n and vs_h, vs_n, goes to row rows[t], slot start + columns[t] of keys and values
 * (R, H, capacity, D), strides kb_r, kb_h, kb_s and vb_*; elements of size bytes, last dimensions contiguous. */
void write_packed(char *keys, int64_t kb_r, int64_t kb_h, int64_t kb_s, char *values, int64_t vb_r, int64_t vb_h,
                  int64_t vb_s, const char *key_states, int64_t ks_h, int64_t ks_n, const char *value_states,
                  int64_t vs_h, int64_t vs_n, const int64_t *rows, const int64_t *columns, int64_t start, int64_t N,
                  int64_t H, int64_t D, int64_t size) {
    for (int64_t t = 0; t < N; t++) {
        const int64_t r = rows[t], s = start + columns[t];
        for (int64_t h = 0; h < H; h++) {
            memcpy(keys + (r * kb_r + h * kb_h + s * kb_s) * size, key_states + (h * ks_h + t * ks_n) * size,
                   (size_t)(D * size));
            memcpy(values + (r * vb_r + h * vb_h + s * vb_s) * size, value_states + (h * vs_h + t * vs_n) * size,
                   (size_t)(D * size));
        }
    }
}

/* -- Prompts' causal attention (prompt_attention): each row's queries over its own keys, tiled as a GEMM is -- */

#define PROMPT_ROWS 12  /* queries (position x head) a tile of scores holds: 12 x 2 vectors of sums in registers */
#define VALUE_ROWS 6  /* queries a tile of weighted values holds: 6 x VALUE_VECTORS vectors of sums in registers */
#define VALUE_VECTORS 4  /* the vectors of a value row (64 floats) such a tile sums; D is a multiple of them */

static __thread float *tile_room;  /* each thread's tile of scores and queries, grown as needed (calls may overlap) */
static __thread int64_t tile_floats;

static float *room(int64_t wanted) {
    if (wanted > tile_floats) {
        free(tile_room);
        tile_room = aligned_alloc(64, sizeof(float) * (size_t)((wanted + KEYS - 1) / KEYS * KEYS));
        tile_floats = wanted;
    }
    return tile_room;
}

static inline int64_t panels_of(int64_t length) { return (length + 31) / 32 * 2; }  /* a head's keys: pairs of panels */

/* scores[r][32 p + i] for the PROMPT_ROWS queries of queries (PROMPT_ROWS x D, scaled) and the keys of panel pairs
 * p < pairs (panels: (2 pairs, D, KEYS), a panel's keys transposed) */
static void score_tile(const float *queries, const float *panels, int64_t D, int64_t pairs, float *scores,
                       int64_t stride) {
    for (int64_t p = 0; p < pairs; p++) {
        const float *first = panels + 2 * p * D * KEYS, *second = first + D * KEYS;
        vector sums[PROMPT_ROWS][2];
        for (int r = 0; r < PROMPT_ROWS; r++) sums[r][0] = sums[r][1] = (vector){0.0f};
        for (int64_t d = 0; d < D; d++) {
            const vector a = load(first + d * KEYS), b = load(second + d * KEYS);
#pragma GCC unroll 12
            for (int r = 0; r < PROMPT_ROWS; r++) {
                const float q = queries[r * D + d];
                sums[r][0] += q * a;
                sums[r][1] += q * b;
            }
        }
        for (int r = 0; r < PROMPT_ROWS; r++) {
            store(scores + r * stride + 32 * p, sums[r][0]);
            store(scores + r * stride + 32 * p + KEYS, sums[r][1]);
        }
    }
}

/* sums[r] = weights[r] (keys of them) times the values' columns c0 .. c0 + VALUE_VECTORS * KEYS - 1, r < VALUE_ROWS */
static void value_tile(const float *weights, int64_t stride, const float *value, int64_t v_s, int64_t keys,
                       int64_t c0, vector sums[VALUE_ROWS][VALUE_VECTORS]) {
    for (int r = 0; r < VALUE_ROWS; r++)
        for (int c = 0; c < VALUE_VECTORS; c++) sums[r][c] = (vector){0.0f};
    for (int64_t j = 0; j < keys; j++) {
        vector x[VALUE_VECTORS];
        for (int c = 0; c < VALUE_VECTORS; c++) x[c] = load(value + j * v_s + c0 + c * KEYS);
#pragma GCC unroll 6
        for (int r = 0; r < VALUE_ROWS; r++) {
            const float w = weights[r * stride + j];
            for (int c = 0; c < VALUE_VECTORS; c++) sums[r][c] += w * x[c];
        }
    }
}

/* Causal attention of R rows' prompts, each over its own keys: row r's lengths[r] queries (consecutive tokens of
 * query, after the rows before it) see its first 1, 2, ... keys (key + r * k_r, slots of stride k_s). query[t][h]
 * at t * q_t + h * q_h, key[r][h][s] at r * k_r + h * k_h + s * k_s (value likewise), out[t][h] at t * o_t + h * o_h;
 * query head i reads key-value head i / (H / Hk); D a multiple of VALUE_VECTORS * KEYS. panels: room for the keys
 * transposed, Hk * panels_of(lengths[r]) panels of D * KEYS floats a row. A tile is PROMPT_ROWS
 * consecutive (position, head) pairs of one key-value head, scored against every key its last position sees, then
 * masked, softmaxed (two passes) and multiplied by the values. Each output depends on its row alone. */
void prompt_attention(const float *query, int64_t q_t, int64_t q_h, const float *key, int64_t k_r, int64_t k_h,
                      int64_t k_s, const float *value, int64_t v_r, int64_t v_h, int64_t v_s, float *out,
                      int64_t o_t, int64_t o_h, int64_t R, const int64_t *lengths, int64_t H, int64_t Hk, int64_t D,
                      float scale, float *panels, int threads) {
    const int64_t G = H / Hk;
    int64_t longest = 0, panel_total = 0, tasks = 0;
    int64_t *firsts = malloc(sizeof(int64_t) * (size_t)(3 * R + 1));  /* each row's first token, panels, first task */
    int64_t *panel_firsts = firsts + R, *task_firsts = firsts + 2 * R;
    for (int64_t r = 0, token = 0; r < R; r++) {
        firsts[r] = token;
        panel_firsts[r] = panel_total;
        task_firsts[r] = tasks;
        token += lengths[r];
        longest = lengths[r] > longest ? lengths[r] : longest;
        panel_total += Hk * panels_of(lengths[r]);
        tasks += Hk * ((lengths[r] * G + PROMPT_ROWS - 1) / PROMPT_ROWS);
    }
    task_firsts[R] = tasks;
    const int64_t stride = (longest + 31) / 32 * 32;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(dynamic, 16)
        for (int64_t job = 0; job < panel_total; job++) {  /* each row's keys, KEYS at a time, transposed */
            int64_t r = 0;
            while (r + 1 < R && panel_firsts[r + 1] <= job) r++;
            const int64_t count = panels_of(lengths[r]), h = (job - panel_firsts[r]) / count;
            const int64_t panel = (job - panel_firsts[r]) % count;
            float *to = panels + job * D * KEYS;
            for (int64_t i = 0; i < KEYS; i++) {
                const int64_t s = panel * KEYS + i;
                const float *from = key + r * k_r + h * k_h + s * k_s;
                for (int64_t d = 0; d < D; d++) to[d * KEYS + i] = s < lengths[r] ? from[d] : 0.0f;
            }
        }
        float *tile = room(PROMPT_ROWS * (stride + D));
        float *scores = tile, *queries = tile + PROMPT_ROWS * stride;
        float totals[PROMPT_ROWS];
        int64_t positions[PROMPT_ROWS], heads[PROMPT_ROWS];
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            int64_t r = 0;
            while (task_firsts[r + 1] <= task) r++;
            const int64_t row_tiles = (task_firsts[r + 1] - task_firsts[r]) / Hk, local = task - task_firsts[r];
            const int64_t h = local % Hk, first_pair = (row_tiles - 1 - local / Hk) * PROMPT_ROWS;  /* longest first */
            const int64_t pairs_in_row = lengths[r] * G;
            int rows = 0;
            for (int64_t pair = first_pair; pair < pairs_in_row && rows < PROMPT_ROWS; pair++, rows++) {
                positions[rows] = pair / G;
                heads[rows] = h * G + pair % G;
            }
            for (int i = 0; i < PROMPT_ROWS; i++) {
                const int pair = i < rows ? i : 0;  /* (a tile's unused queries: zeros) */
                const float *from = query + (firsts[r] + positions[pair]) * q_t + heads[pair] * q_h;
                for (int64_t d = 0; d < D; d++) queries[i * D + d] = i < rows ? from[d] * scale : 0.0f;
            }
            const int64_t keys = positions[rows - 1] + 1, pairs = (keys + 31) / 32;
            score_tile(queries, panels + (panel_firsts[r] + h * panels_of(lengths[r])) * D * KEYS, D, pairs, scores,
                       stride);
            for (int i = 0; i < rows; i++) {  /* the keys past a query's own masked, then its softmax's two passes */
                float *row = scores + i * stride;
                for (int64_t j = positions[i] + 1; j < pairs * 32; j++) row[j] = -INFINITY;
                vector most = (vector){0.0f} - INFINITY;
                for (int64_t j = 0; j < pairs * 32; j += KEYS) {
                    const vector x = load(row + j);
                    most = pick(x > most, x, most);
                }
                float maximum = most[0];
                for (int lane = 1; lane < KEYS; lane++) maximum = most[lane] > maximum ? most[lane] : maximum;
                vector sum = (vector){0.0f};
                for (int64_t j = 0; j < pairs * 32; j += KEYS) {
                    const vector p = exp_nonpositive(load(row + j) - maximum);
                    store(row + j, p);
                    sum += p;
                }
                totals[i] = sum_lanes(sum);
            }
            for (int i = rows; i < PROMPT_ROWS; i++) memset(scores + i * stride, 0, sizeof(float) * (size_t)keys);
            for (int first = 0; first < rows; first += VALUE_ROWS)
                for (int64_t c0 = 0; c0 < D; c0 += VALUE_VECTORS * KEYS) {
                    vector sums[VALUE_ROWS][VALUE_VECTORS];
                    value_tile(scores + first * stride, stride, value + r * v_r + h * v_h, v_s, keys, c0, sums);
                    for (int i = first; i < rows && i < first + VALUE_ROWS; i++) {
                        float *to = out + (firsts[r] + positions[i]) * o_t + heads[i] * o_h + c0;
                        const float inverse = 1.0f / totals[i];
                        for (int c = 0; c < VALUE_VECTORS; c++) store(to + c * KEYS, sums[i - first][c] * inverse);
                    }
                }
        }
    }
    free(firsts);
}
"""
