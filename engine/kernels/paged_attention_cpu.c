/* exspec: paged attention on the CPU, read in place from the block pools (engine/kernels/native.py builds and
 * loads this file; engine/backends/native.py is its backend).
 *
 * For each row b and kv head kh, the GROUP x Q query rows that share kh walk the row's blocks once, in block-table
 * order, with an online softmax per query row (fp32 accumulation, as SDPA). Query row (g, qi) sits at position
 * p = seq_lens[b] - Q + qi and sees keys j with max(0, p - window + 1) <= j <= p (no window: 0 <= j <= p).
 *
 *   query   [B, heads, Q, head_dim] fp32, contiguous
 *   keys    the pool, in its dtype: token n = block * block_size + offset of kv head h at keys + h * s_head + n * s_tok
 *           (n < tokens = (num_blocks + 1) x block_size), head_dim contiguous; the pools' head-major storage has
 *           s_head = tokens x head_dim, s_tok = head_dim. Position pos of row b is token
 *           block_tables[b][pos / block_size] * block_size + pos % block_size.
 *   values  likewise, same strides
 *   tables  [B, max_blocks] int32;  seq_lens [B] int32 (0: a padding row, whose output is zeros)
 *   out     [B, Q, heads, head_dim] fp32, contiguous
 * Returns 0, or 1 (inconsistent sizes), 2 (out of memory), 3 (a block id outside the pool), 4 (a dtype this compiler
 * cannot read). Any head_dim (eight lanes at a time, the rest one by one), any number of queries. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define EXSPEC_PAGED_ABI 2

typedef float v8 __attribute__((vector_size(32), aligned(4))); /* eight floats at any 4-byte alignment */
typedef uint16_t v8u16 __attribute__((vector_size(16), aligned(2)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));
typedef int32_t v8i32 __attribute__((vector_size(32)));

int exspec_paged_abi(void) { return EXSPEC_PAGED_ABI; }

static inline v8 load_f32(const float* p) { return *(const v8*)p; }
static inline float load1_f32(const float* p) { return *p; }
static inline v8 load_bf16(const uint16_t* p) { /* bf16 is the top half of an fp32 */
    v8u32 w = __builtin_convertvector(*(const v8u16*)p, v8u32) << 16;
    return (v8)w;
}
static inline float load1_bf16(const uint16_t* p) {
    uint32_t w = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}
#ifdef __FLT16_MAX__
typedef _Float16 v8f16 __attribute__((vector_size(16), aligned(2)));
static inline v8 load_f16(const _Float16* p) { return __builtin_convertvector(*(const v8f16*)p, v8); }
static inline float load1_f16(const _Float16* p) { return (float)*p; }
#endif

/* e^x for x <= 0 (a score minus its row's running maximum), eight at a time: Cephes' expf (x = n ln2 + r,
 * |r| <= ln2 / 2, a degree-6 polynomial for e^r, 2^n from the exponent bits), within 2 ulp of libm's; x below
 * -87.3 (e^x under FLT_MIN) gives 2^-126 e^r, a denormal-free speck the caller masks where it must be zero. */
static inline v8 exp8(v8 x) {
    const v8 lo = {-87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f};
    const v8i32 below = x < lo;
    x = (v8)(((v8i32)x & ~below) | ((v8i32)lo & below));
    v8 fx = x * 1.44269504088896341f + 0.5f;
    v8i32 n = __builtin_convertvector(fx, v8i32); /* toward zero: one less where that rounded up (fx < 0) */
    n += (v8i32)(__builtin_convertvector(n, v8) > fx);
    const v8 nf = __builtin_convertvector(n, v8);
    const v8 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    v8 p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return (v8)((v8i32)p + ((n) << 23)); /* p x 2^n */
}

/* Both pools' rows of one block into the cache, 64-byte lines (a read, kept in all levels). */
static inline void prefetch_block(const void* kb, const void* vb, int64_t bs, int64_t row_bytes, int64_t bytes) {
    for (int64_t t = 0; t < bs; t++)
        for (int64_t o = 0; o < bytes; o += 64) {
            __builtin_prefetch((const char*)kb + t * row_bytes + o, 0, 3);
            __builtin_prefetch((const char*)vb + t * row_bytes + o, 0, 3);
        }
}

static inline float hmax(v8 a) {
    float s = a[0];
    for (int l = 1; l < 8; l++) s = a[l] > s ? a[l] : s;
    return s;
}

static inline float hsum(v8 a) {
    float s = 0.f;
    for (int l = 0; l < 8; l++) s += a[l];
    return s;
}

/* One kernel per pool dtype T, its 8-lane load LOAD and its one-lane load LOAD1. */
#define PAGED_KERNEL(NAME, T, LOAD, LOAD1)                                                                             \
int NAME(const float* q, const T* k, const T* v, const int32_t* tables, int64_t max_blocks, const int32_t* seq_lens,   \
         float* out, int64_t B, int64_t H, int64_t KVH, int64_t Q, int64_t D, int64_t bs, int64_t ntok,                \
         int64_t s_head, int64_t s_tok, int64_t window, float scale, int nthreads) {                                   \
    if (D <= 0 || bs <= 0 || KVH <= 0 || H % KVH || Q <= 0) return 1;                                                  \
    const int64_t G = H / KVH, R = G * Q, D8 = D - D % 8;                                                              \
    int err = 0;                                                                                                       \
    _Pragma("omp parallel for num_threads(nthreads) schedule(static) if(nthreads > 1 && B * KVH > 1)")                 \
    for (int64_t task = 0; task < B * KVH; task++) {                                                                   \
        const int64_t b = task / KVH, kh = task % KVH;                                                                 \
        int64_t* hi = (int64_t*)malloc(sizeof(int64_t) * 2 * Q); /* per query: its keys [lo, hi) */                    \
        const int64_t bs8 = (bs + 7) / 8 * 8; /* the scores of a block, in whole vectors */                            \
        float* acc = (float*)malloc(sizeof(float) * (R * D + 2 * R + bs8 + 8));                                        \
        if (!acc || !hi) { free(acc); free(hi); err = 2; continue; }                                                   \
        int64_t* lo = hi + Q;                                                                                          \
        float *m = acc + R * D, *l = m + R;                                                                            \
        float* s = (float*)(((uintptr_t)(l + R) + 31) & ~(uintptr_t)31); /* 32-byte aligned */                         \
        const int64_t len = seq_lens[b] < max_blocks * bs ? seq_lens[b] : max_blocks * bs;                             \
        int64_t first = len, last = 0;                                                                                 \
        for (int64_t qi = 0; qi < Q; qi++) { /* query qi sits at position p */                                         \
            const int64_t p = len - Q + qi;                                                                            \
            hi[qi] = p + 1 > 0 ? p + 1 : 0;                                                                            \
            lo[qi] = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;                                            \
            if (lo[qi] < first) first = lo[qi];                                                                        \
            if (hi[qi] > last) last = hi[qi];                                                                          \
        }                                                                                                              \
        for (int64_t r = 0; r < R; r++) { m[r] = -INFINITY; l[r] = 0.f; } /* query row r = g * Q + qi */               \
        memset(acc, 0, sizeof(float) * R * D);                                                                         \
        for (int64_t j = first / bs; j * bs < last; j++) {                                                             \
            const int64_t id = tables[b * max_blocks + j];                                                             \
            if (id < 0 || (id + 1) * bs > ntok) { err = 3; break; }                                                    \
            const T* kb = k + kh * s_head + id * bs * s_tok;                                                           \
            const T* vb = v + kh * s_head + id * bs * s_tok;                                                           \
            if ((j + 1) * bs < last) { /* the next block: the hardware does not prefetch across pages */               \
                const int64_t nid = tables[b * max_blocks + j + 1];                                                    \
                if (nid >= 0 && (nid + 1) * bs <= ntok) prefetch_block(k + kh * s_head + nid * bs * s_tok,             \
                                                                     v + kh * s_head + nid * bs * s_tok,               \
                                                                     bs, s_tok * (int64_t)sizeof(T),                   \
                                                                     D * (int64_t)sizeof(T));                          \
            }                                                                                                          \
            const int64_t p0 = j * bs;                                                                                 \
            for (int64_t r = 0; r < R; r++) {                                                                          \
                const int64_t qi = r % Q, t0 = lo[qi] > p0 ? lo[qi] - p0 : 0;                                          \
                const int64_t t1 = hi[qi] - p0 < bs ? hi[qi] - p0 : bs;                                                \
                if (t1 <= t0) continue;                                                                                \
                const float* qr = q + ((b * H + kh * G + r / Q) * Q + qi) * D;                                         \
                float mx = m[r];                                                                                       \
                int64_t t = t0;                                                                                        \
                for (; t + 4 <= t1; t += 4) { /* four keys at once: four independent accumulators */                   \
                    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                                         \
                    const T *k0 = kb + t * s_tok, *k1 = k0 + s_tok, *k2 = k1 + s_tok, *k3 = k2 + s_tok;                \
                    int64_t d = 0;                                                                                     \
                    for (; d < D8; d += 8) {                                                                           \
                        const v8 qv = load_f32(qr + d);                                                                \
                        a0 += qv * LOAD(k0 + d); a1 += qv * LOAD(k1 + d);                                              \
                        a2 += qv * LOAD(k2 + d); a3 += qv * LOAD(k3 + d);                                              \
                    }                                                                                                  \
                    float s0 = hsum(a0), s1 = hsum(a1), s2 = hsum(a2), s3 = hsum(a3);                                  \
                    for (; d < D; d++) {                                                                               \
                        s0 += qr[d] * LOAD1(k0 + d); s1 += qr[d] * LOAD1(k1 + d);                                      \
                        s2 += qr[d] * LOAD1(k2 + d); s3 += qr[d] * LOAD1(k3 + d);                                      \
                    }                                                                                                  \
                    s[t] = s0 * scale; s[t + 1] = s1 * scale; s[t + 2] = s2 * scale; s[t + 3] = s3 * scale;            \
                }                                                                                                      \
                for (; t < t1; t++) {                                                                                  \
                    v8 a0 = {0};                                                                                       \
                    int64_t d = 0;                                                                                     \
                    for (; d < D8; d += 8) a0 += load_f32(qr + d) * LOAD(kb + t * s_tok + d);                          \
                    float s0 = hsum(a0);                                                                               \
                    for (; d < D; d++) s0 += qr[d] * LOAD1(kb + t * s_tok + d);                                        \
                    s[t] = s0 * scale;                                                                                 \
                }                                                                                                      \
                for (t = 0; t < t0; t++) s[t] = -INFINITY; /* keys this query row does not see */                      \
                for (t = t1; t < bs8; t++) s[t] = -INFINITY;                                                           \
                for (t = 0; t < bs8; t += 8) mx = fmaxf(mx, hmax(*(v8*)(s + t)));                                      \
                const float alpha = expf(m[r] - mx); /* 0 at a query row's first block (m = -inf) */                   \
                v8 sum = {0};                                                                                          \
                for (t = 0; t < bs8; t += 8) {                                                                         \
                    const v8 x = *(v8*)(s + t);                                                                        \
                    const v8 p = (v8)((v8i32)exp8(x - mx) & (x != -INFINITY)); /* unseen keys: exactly 0 */            \
                    *(v8*)(s + t) = p;                                                                                 \
                    sum += p;                                                                                          \
                }                                                                                                      \
                l[r] = l[r] * alpha + hsum(sum);                                                                       \
                m[r] = mx;                                                                                             \
                float* o = acc + r * D;                                                                                \
                int64_t d = 0;                                                                                         \
                for (; d < D8; d += 8) {                                                                               \
                    v8 a = load_f32(o + d) * alpha;                                                                    \
                    for (t = t0; t < t1; t++) a += s[t] * LOAD(vb + t * s_tok + d);                                    \
                    *(v8*)(o + d) = a;                                                                                 \
                }                                                                                                      \
                for (; d < D; d++) {                                                                                   \
                    float a = o[d] * alpha;                                                                            \
                    for (t = t0; t < t1; t++) a += s[t] * LOAD1(vb + t * s_tok + d);                                   \
                    o[d] = a;                                                                                          \
                }                                                                                                      \
            }                                                                                                          \
        }                                                                                                              \
        for (int64_t r = 0; r < R; r++) {                                                                              \
            const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;                                                           \
            float* dst = out + ((b * Q + r % Q) * H + kh * G + r / Q) * D;                                             \
            for (int64_t d = 0; d < D; d++) dst[d] = acc[r * D + d] * inv;                                             \
        }                                                                                                              \
        free(acc);                                                                                                     \
        free(hi);                                                                                                      \
    }                                                                                                                  \
    return err;                                                                                                        \
}

PAGED_KERNEL(exspec_paged_f32, float, load_f32, load1_f32)
PAGED_KERNEL(exspec_paged_bf16, uint16_t, load_bf16, load1_bf16)
#ifdef __FLT16_MAX__
PAGED_KERNEL(exspec_paged_f16, _Float16, load_f16, load1_f16)
#else
int exspec_paged_f16(const float* q, const void* k, const void* v, const int32_t* tables, int64_t max_blocks,
                     const int32_t* seq_lens, float* out, int64_t B, int64_t H, int64_t KVH, int64_t Q, int64_t D,
                     int64_t bs, int64_t ntok, int64_t s_head, int64_t s_tok, int64_t window, float scale,
                     int nthreads) { return 4; }
#endif
