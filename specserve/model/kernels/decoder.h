/* The argument structures of a decoder step (decoder.c) and of a draft chain (draft_chain.c), mirrored by
 * ctypes Structures in model/cpu_forward.py and model/cpu_draft.py. */
#ifndef SPECSERVE_DECODER_H
#define SPECSERVE_DECODER_H
#include <stdint.h>

typedef struct LinearArgs { /* one KernelLinear: the leading arguments of linear_* */
    const uint8_t *w;
    int64_t row_bytes;
    const float *bias;
    int32_t fmt, n, k, kp;
    const struct LinearArgs *next; /* the next outputs' rows in another format (a stacked projection), or NULL */
} LinearArgs;

typedef struct {
    const void *norm1, *norm2;
    float eps1, eps2, scale;
    LinearArgs qkv, o, gate_up, down;
} LayerArgs;

enum { MODE_STORE = 0, MODE_ADD = 1, MODE_SWIGLU = 2 };

#endif
