/* A draft model's whole chain of greedy draft steps in one call (model/cpu_draft.py).
 *
 * Why: a draft step from Python is a forward (embedding, the EAGLE input projection, the layers, the final
 * norm, the head), an argmax and the bookkeeping of the next step's inputs, ~30 torch and ctypes calls: on
 * a one-layer draft that overhead was half of each draft token's time. Here every step runs the same
 * kernels (decoder.c's layers, linear.c, rms_norm.c), so a draft token is the same bits as drafted step by
 * step from Python.
 *
 * Step 0 takes the rows Python prepared (`rows` tokens of `num_seqs` sequences: each sequence's new tokens,
 * its catch-up first, with their positions and cache slots, and the attention's pieces as decoder_layers
 * wants them); each sequence with steps[i] > 0 drafts the argmax of the head at its row last_rows[i]. Step j >= 1 runs one row for
 * each sequence that still drafts (steps[i] > j): its previous draft token at the next position, and for an
 * EAGLE draft the previous step's final hidden state as its feature. out[i * max_steps + j]: the target id
 * of sequence i's draft j (vocab_map maps a reduced head's rows; -1 past steps[i]). */
#include <stdlib.h>
#include <string.h>

#include "decoder.h"

typedef struct {
    const void *embed;       /* [vocab, hidden] token embedding, the activations' type */
    LinearArgs fc;           /* EAGLE's input projection [hidden] <- [2 hidden] (w NULL: a standalone draft) */
    const LayerArgs *layers;
    int32_t num_layers;
    const void *norm;        /* final RMSNorm weight */
    float norm_eps;
    LinearArgs head;         /* [head rows] <- [hidden] */
    const int64_t *vocab_map; /* [head rows] target id of each head row, or NULL */
    const float *rope;       /* [positions, 2, D / 2]: cos then sin of each position */
    int32_t hidden, H, Hkv, D, inter, block_size, window;
    uint8_t *kv_base;
    int64_t cache_bytes;
} DraftArgs;

#define DEFINE_CHAIN(T, SUFFIX)                                                                             \
void rms_norm_##SUFFIX(const T *x, int64_t x_stride, const T *w, T *out, int32_t rows, int32_t dim, float eps, \
                       int32_t num_threads);                                                                \
int linear_##SUFFIX(const uint8_t *w, int32_t fmt, int64_t w_row_bytes, int32_t N, int32_t K, int32_t Kp,   \
                    const T *x, int64_t x_stride, int32_t rows, const float *bias, T *out, int64_t out_stride, \
                    int32_t mode, int32_t num_threads);                                                     \
int decoder_layers_##SUFFIX(const LayerArgs *layers, int32_t num_layers, T *x, int32_t tokens, int32_t hidden, \
                            T *h, T *qkv, T *qk, T *attn, T *act, int32_t H, int32_t Hkv, int32_t D,        \
                            int32_t inter, const float *cos, const float *sin, int64_t cs_stride,           \
                            uint8_t *kv_base, int64_t cache_bytes, const int64_t *slots, int32_t block_size, \
                            const int32_t *seqs, int32_t num_seqs, const int32_t *tables,                   \
                            int32_t table_stride, int32_t window, int32_t threads);                         \
                                                                                                            \
/* One forward of `rows` rows: x (embedded tokens, or EAGLE's [token embedding, feature] through fc) through  \
 * the layers and the final norm into `normed`. */                                                          \
static int chain_forward_##SUFFIX(const DraftArgs *m, const int64_t *ids, const T *feats, int32_t rows,     \
                                  const int64_t *positions, const int64_t *slots, const int32_t *seqs,      \
                                  int32_t num_seqs, const int32_t *tables, int32_t table_stride, T *buf,    \
                                  T *normed, float *cs, int32_t threads) {                                  \
    const int32_t hid = m->hidden, D = m->D, qkv_size = (m->H + 2 * m->Hkv) * D;                            \
    T *x = buf, *cat = x + (int64_t)rows * hid, *h = cat + 2 * (int64_t)rows * hid;                         \
    T *qkv = h + (int64_t)rows * hid, *qk = qkv + (int64_t)rows * qkv_size;                                 \
    T *attn = qk + (int64_t)rows * (m->H + m->Hkv) * D, *act = attn + (int64_t)rows * m->H * D;             \
    const T *embed = (const T *)m->embed;                                                                   \
    int status = 0;                                                                                         \
    for (int32_t r = 0; r < rows; r++) {                                                                    \
        memcpy(m->fc.w ? cat + 2 * (int64_t)r * hid : x + (int64_t)r * hid, embed + ids[r] * hid, hid * sizeof(T)); \
        if (m->fc.w) memcpy(cat + (2 * (int64_t)r + 1) * hid, feats + (int64_t)r * hid, hid * sizeof(T));   \
        memcpy(cs + (int64_t)r * D, m->rope + (int64_t)positions[r] * D, D * sizeof(float));                 \
    }                                                                                                       \
    if (m->fc.w)                                                                                            \
        status |= linear_##SUFFIX(m->fc.w, m->fc.fmt, m->fc.row_bytes, m->fc.n, m->fc.k, m->fc.kp, cat, 2 * hid, \
                                  rows, m->fc.bias, x, hid, MODE_STORE, threads);                           \
    status |= decoder_layers_##SUFFIX(m->layers, m->num_layers, x, rows, hid, h, qkv, qk, attn, act, m->H,   \
                                      m->Hkv, D, m->inter, cs, cs + D / 2, D, m->kv_base, m->cache_bytes,   \
                                      slots, m->block_size, seqs, num_seqs, tables, table_stride, m->window, \
                                      threads);                                                             \
    rms_norm_##SUFFIX(x, hid, (const T *)m->norm, normed, rows, hid, m->norm_eps, threads);                  \
    return status;                                                                                          \
}                                                                                                           \
                                                                                                            \
/* Greedy tokens of `n` normed rows (row r at normed + rows_at[r] * hidden) through the head. */            \
static int chain_argmax_##SUFFIX(const DraftArgs *m, const T *normed, const int32_t *rows_at, int32_t n,    \
                                 T *gathered, T *logits, int64_t *tokens, int32_t threads) {                \
    const int32_t hid = m->hidden, V = m->head.n;                                                           \
    for (int32_t r = 0; r < n; r++)                                                                         \
        memcpy(gathered + (int64_t)r * hid, normed + (int64_t)rows_at[r] * hid, hid * sizeof(T));            \
    int status = linear_##SUFFIX(m->head.w, m->head.fmt, m->head.row_bytes, V, m->head.k, m->head.kp,       \
                                 gathered, hid, n, m->head.bias, logits, V, MODE_STORE, threads);            \
    for (int32_t r = 0; r < n; r++) {                                                                       \
        const T *row = logits + (int64_t)r * V;                                                             \
        int32_t best = 0;                                                                                   \
        float top = TO_FLOAT_##SUFFIX(row[0]);                                                              \
        for (int32_t i = 1; i < V; i++) {                                                                   \
            float v = TO_FLOAT_##SUFFIX(row[i]);                                                            \
            if (v > top) top = v, best = i;                                                                 \
        }                                                                                                   \
        tokens[r] = m->vocab_map ? m->vocab_map[best] : best;                                               \
    }                                                                                                       \
    return status;                                                                                          \
}                                                                                                           \
                                                                                                            \
int draft_chain_##SUFFIX(const DraftArgs *m, int32_t rows, const int64_t *ids, const void *feats,          \
                         const int64_t *positions, const int64_t *slots, int32_t num_pieces, const int32_t *pieces, \
                         const int32_t *piece_tables, int32_t piece_stride, int32_t num_seqs,               \
                         const int32_t *last_rows, const int32_t *tables, int32_t table_stride,             \
                         const int32_t *steps, int32_t max_steps, int64_t *out, int32_t threads) {          \
    const int32_t hid = m->hidden, D = m->D, S = num_seqs;                                                  \
    const int64_t per_row = 5 * (int64_t)hid + (m->H + 2 * m->Hkv) * D + (m->H + m->Hkv) * D + m->H * D    \
                            + m->inter;                                                                     \
    const int32_t most = rows > S ? rows : S;                                                               \
    T *buf = malloc(sizeof(T) * (per_row * most + 3 * (int64_t)most * hid + (int64_t)S * m->head.n));       \
    float *cs = malloc(sizeof(float) * (int64_t)most * D);                                                  \
    int32_t *meta = malloc(sizeof(int32_t) * ((int64_t)S * (6 + table_stride)));                            \
    int64_t *next = malloc(sizeof(int64_t) * 4 * (int64_t)S);                                               \
    if (!buf || !cs || !meta || !next) {                                                                    \
        free(buf); free(cs); free(meta); free(next);                                                        \
        return 1;                                                                                           \
    }                                                                                                       \
    T *normed = buf + per_row * most, *feat = normed + (int64_t)most * hid, *gathered = feat + (int64_t)most * hid; \
    T *logits = gathered + (int64_t)most * hid;                                                             \
    /* per drafting sequence: its row in `normed`, its index, its position; seqs_j [3, n]; tables_j [n, stride] */ \
    int32_t *rows_at = meta, *active = meta + S, *seqs_j = meta + 3 * S, *tables_j = meta + 6 * S;         \
    int64_t *tokens = next, *slots_j = next + S, *ids_j = next + 2 * S, *pos = next + 3 * S;                \
    for (int64_t i = 0; i < (int64_t)S * max_steps; i++) out[i] = -1;                                       \
    /* Step 0: Python's rows (the pieces: decoder_layers' sequences, a long catch-up in several). */        \
    int status = chain_forward_##SUFFIX(m, ids, (const T *)feats, rows, positions, slots, pieces, num_pieces, \
                                        piece_tables, piece_stride, buf, normed, cs, threads);              \
    int32_t n = 0;  /* sequences drafting at this step */                                                   \
    for (int32_t i = 0; i < S; i++)                                                                         \
        if (steps[i] > 0) {                                                                                 \
            active[n] = i, rows_at[n] = last_rows[i], pos[n] = positions[last_rows[i]];                     \
            n++;                                                                                            \
        }                                                                                                   \
    for (int32_t j = 0; n > 0 && status == 0; j++) {                                                        \
        status |= chain_argmax_##SUFFIX(m, normed, rows_at, n, gathered, logits, tokens, threads);          \
        for (int32_t r = 0; r < n; r++) {                                                                   \
            out[(int64_t)active[r] * max_steps + j] = tokens[r];                                            \
            memcpy(feat + (int64_t)r * hid, normed + (int64_t)rows_at[r] * hid, hid * sizeof(T));            \
        }                                                                                                   \
        int32_t kept = 0;  /* those that draft step j + 1: one row each, at the next position */          \
        for (int32_t r = 0; r < n; r++) {                                                                   \
            const int32_t i = active[r];                                                                    \
            if (steps[i] <= j + 1) continue;                                                                \
            const int64_t p = pos[r] + 1;                                                                   \
            const int32_t *table = tables + (int64_t)i * table_stride;                                      \
            active[kept] = i, pos[kept] = p, ids_j[kept] = tokens[r];  /* target ids: the embedding's */ \
            slots_j[kept] = (int64_t)table[p / m->block_size] * m->block_size + p % m->block_size;           \
            memmove(feat + (int64_t)kept * hid, feat + (int64_t)r * hid, hid * sizeof(T));                   \
            memcpy(tables_j + (int64_t)kept * table_stride, table, table_stride * sizeof(int32_t));          \
            kept++;                                                                                         \
        }                                                                                                   \
        n = kept;                                                                                           \
        if (n == 0) break;                                                                                  \
        for (int32_t r = 0; r < n; r++) {                                                                   \
            seqs_j[r] = r, seqs_j[n + r] = 1, seqs_j[2 * n + r] = (int32_t)pos[r] + 1;                      \
            rows_at[r] = r;                                                                                 \
        }                                                                                                   \
        status |= chain_forward_##SUFFIX(m, ids_j, feat, n, pos, slots_j, seqs_j, n, tables_j, table_stride, \
                                         buf, normed, cs, threads);                                         \
    }                                                                                                       \
    free(buf); free(cs); free(meta); free(next);                                                            \
    return status;                                                                                          \
}

static inline float TO_FLOAT_bf16(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
static inline float TO_FLOAT_f32(float v) { return v; }

DEFINE_CHAIN(uint16_t, bf16)
DEFINE_CHAIN(float, f32)
