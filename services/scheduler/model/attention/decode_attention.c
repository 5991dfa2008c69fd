/* Decode attention over the paged KV pool, fp32, one thread: the CPU backend's kernel (cpu.py).
   Compiled on first use with the system C compiler and loaded with ctypes. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* A request's rows sit in pages scattered over the pool; the hardware prefetcher does not follow
   the jumps between them (nor across 4 KiB boundaries), so ask for the row AHEAD slots on. */
#define AHEAD 4
static inline void prefetch(const float *r, int64_t n)
{
    for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(r + i, 0, 3);
}

/* exp(x) for x <= 0 (softmax after subtracting the max), to about 2 ulp: x = n ln2 + r, |r| <=
   ln2 / 2, exp(r) by a degree-6 polynomial, times 2^n. glibc's expf does not vectorize without
   -ffast-math, which would also reorder every sum here. */
static inline float exp_neg(float x)
{
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_roundf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float e = 1.0f / 720.0f;
    e = e * r + 1.0f / 120.0f;
    e = e * r + 1.0f / 24.0f;
    e = e * r + 1.0f / 6.0f;
    e = e * r + 0.5f;
    e = e * r + 1.0f;
    e = e * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale2n;
    __builtin_memcpy(&scale2n, &bits, 4);
    return e * scale2n;
}

/* One request: q, out [H, D]; query head h reads KV head h / group. Each slot's K row (every KV
   head, KVH * D floats) is read once for all heads, then each V row: the context streams through
   the cache once, page by page. Inlined into call sites with a constant D (loops unroll). */
static inline __attribute__((always_inline)) void attend(
    const float *q, const float *k, const float *v, const int64_t *sl, int64_t n, int64_t H,
    int64_t group, int64_t row, const int64_t D, float scale, float *p, float *out)
{
    for (int64_t j = 0; j < n; j++) {  /* scores: p[h * n + j] */
        if (j + AHEAD < n) prefetch(k + sl[j + AHEAD] * row, row);
        const float *kr = k + sl[j] * row;
        for (int64_t h = 0; h < H; h++) {
            const float *kj = kr + (h / group) * D, *qh = q + h * D;
            float acc = 0.0f;
            #pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < D; d++) acc += qh[d] * kj[d];
            p[h * n + j] = acc * scale;
        }
    }
    float sum[H];
    for (int64_t h = 0; h < H; h++) {
        float *ph = p + h * n, mh = -INFINITY, s = 0.0f;
        #pragma omp simd reduction(max : mh)
        for (int64_t j = 0; j < n; j++) mh = ph[j] > mh ? ph[j] : mh;
        #pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < n; j++) {
            ph[j] = exp_neg(ph[j] - mh);
            s += ph[j];
        }
        sum[h] = s;
    }
    for (int64_t i = 0; i < H * D; i++) out[i] = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        if (j + AHEAD < n) prefetch(v + sl[j + AHEAD] * row, row);
        const float *vr = v + sl[j] * row;
        for (int64_t h = 0; h < H; h++) {
            const float *vj = vr + (h / group) * D, w = p[h * n + j];
            float *oh = out + h * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) oh[d] += w * vj[d];
        }
    }
    for (int64_t h = 0; h < H; h++) {
        const float inv = 1.0f / sum[h];
        for (int64_t d = 0; d < D; d++) out[h * D + d] *= inv;
    }
}

/* q: [B, H, D]; k, v: [num_slots, KVH, D]; slots: every request's context, concatenated;
   starts: [B + 1] offsets into slots; out: [B, H, D]. Query head h reads KV head h / (H / KVH).
   Returns 0, or -1 if out of memory. */
int decode_attention_f32(const float *q, const float *k, const float *v, const int64_t *slots,
                         const int64_t *starts, float *out, int64_t B, int64_t H, int64_t KVH,
                         int64_t D, float scale)
{
    const int64_t group = H / KVH, row = KVH * D;
    int64_t longest = 1;
    for (int64_t b = 0; b < B; b++)
        if (starts[b + 1] - starts[b] > longest) longest = starts[b + 1] - starts[b];
    float *p = (float *)malloc(sizeof(float) * H * longest);
    if (!p) return -1;
    for (int64_t b = 0; b < B; b++) {
        const int64_t *sl = slots + starts[b];
        const int64_t n = starts[b + 1] - starts[b];
        const float *qb = q + b * H * D;
        float *ob = out + b * H * D;
        if (D == 64)
            attend(qb, k, v, sl, n, H, group, row, 64, scale, p, ob);
        else if (D == 128)
            attend(qb, k, v, sl, n, H, group, row, 128, scale, p, ob);
        else
            attend(qb, k, v, sl, n, H, group, row, D, scale, p, ob);
    }
    free(p);
    return 0;
}
