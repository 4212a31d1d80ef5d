/* slimroute's native kernels: the int8 decoder layer's work between its GEMMs, one pass each.

Built at first use by runtime/native.py (the C compiler, OpenMP, this CPU's vector ISA), loaded with ctypes.
Every result is a row's own: a row's numbers never depend on the other rows of a call, how many there are or which
thread runs them. Each value is computed by one fixed sequence of IEEE single-precision operations (built with
-ffp-contract=off: a multiply and an add stay two roundings unless written as fmaf), so a vectorised loop and its
scalar remainder give the same bits.

Two kinds of kernel:
- the ones that must give the bits of the torch ops they replace in the model's own modules (RMSNorm: ATen's
  cascade sum, replayed exactly for this build's vector width SR_LANES; rotary embeddings; residual adds; the
  scaling and bias of an int8 GEMM's output): runtime/native.py checks them against those ops when it loads;
- the ones the int8 model's own modules call too (row quantisation, the gated MLP's middle, attention), whose
  arithmetic is defined here.
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef SR_LANES
#define SR_LANES 8 /* the lanes of ATen's float sum kernel (runtime/native.py says why 8) */
#endif

typedef int64_t i64;

/* ---------------------------------------------------------------------------------------------------------------
   The vector ISA this is built for: VL lanes of fp32 (AVX-512: 16, AVX2: 8, plain C: 1). Each macro is one IEEE
   operation per lane, as its scalar form computes it (VMAX(a, b): a > b ? a : b, NaN giving b; VROUND: rintf). */
#if defined(__AVX512F__)
#include <immintrin.h>
#define VL 16
typedef __m512 vec;
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VSET1(x) _mm512_set1_ps(x)
#define VZERO() _mm512_setzero_ps()
#define VADD(a, b) _mm512_add_ps(a, b)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VDIV(a, b) _mm512_div_ps(a, b)
#define VMAX(a, b) _mm512_max_ps(a, b)
#define VMIN(a, b) _mm512_min_ps(a, b)
#define VABS(a) _mm512_abs_ps(a)
#define VROUND(a) _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VSCALE(p, n) _mm512_scalef_ps(p, n) /* p * 2^n for an integral n: the same rounding as a multiply */
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VL 8
typedef __m256 vec;
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VSET1(x) _mm256_set1_ps(x)
#define VZERO() _mm256_setzero_ps()
#define VADD(a, b) _mm256_add_ps(a, b)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VDIV(a, b) _mm256_div_ps(a, b)
#define VMAX(a, b) _mm256_max_ps(a, b)
#define VMIN(a, b) _mm256_min_ps(a, b)
#define VABS(a) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a)
#define VROUND(a) _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VSCALE(p, n) _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32( \
                                                  _mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23)))
#else
#define VL 1
typedef float vec;
#define VLOAD(p) (*(p))
#define VSTORE(p, v) (*(p) = (v))
#define VFMA(a, b, c) fmaf(a, b, c)
#define VSET1(x) (x)
#define VZERO() 0.0f
#define VADD(a, b) ((a) + (b))
#define VMUL(a, b) ((a) * (b))
#define VMAX(a, b) ((a) > (b) ? (a) : (b))
#endif

/* A max is exact in any order (NaNs never win): VL lanes side by side, then across them, from `top`. */
static float lanes_max(vec lanes, float top) {
    float each[VL];
    VSTORE(each, lanes);
    for (int l = 0; l < VL; ++l) top = each[l] > top ? each[l] : top;
    return top;
}

static inline float max_abs(float top, float x) { return fabsf(x) > top ? fabsf(x) : top; }

/* The largest of |x[j]| (0 for n = 0). */
static float abs_max(const float *x, i64 n) {
    vec lanes = VZERO();
    i64 j = 0;
#if VL > 1
    for (; j + VL <= n; j += VL) lanes = VMAX(VABS(VLOAD(x + j)), lanes);
#endif
    float top = 0.0f;
    for (; j < n; ++j) top = max_abs(top, x[j]);
    return lanes_max(lanes, top);
}

/* ---------------------------------------------------------------------------------------------------------------
   ATen's sum over a contiguous row (aten/src/ATen/native/cpu/SumKernel.cpp: vectorized_inner_sum -> row_sum with 4
   accumulators -> multi_row_sum's cascade of 4 levels), of x[j] * x[j]: what `x.pow(2).mean(-1)` adds up. */
static i64 ceil_log2(i64 x) {
    if (x <= 2) return 1;
    i64 v = x - 1, bit = 0;
    while (v >>= 1) bit++;
    return bit + 1;
}

static float sum_of_squares(const float *x, i64 n) {
    enum { W = SR_LANES, ILP = 4, LEVELS = 4 };
    const i64 vecs = n / W, rows = vecs / ILP;
    const i64 power = ceil_log2(rows) / LEVELS > 4 ? ceil_log2(rows) / LEVELS : 4;
    const i64 step = (i64)1 << power, mask = step - 1;
    float acc[LEVELS][ILP][W];
    memset(acc, 0, sizeof(acc));
    i64 i = 0;
    for (; i + step <= rows;) {
        for (i64 j = 0; j < step; ++j, ++i)
            for (int k = 0; k < ILP; ++k)
                for (int l = 0; l < W; ++l) {
                    float v = x[(i * ILP + k) * W + l];
                    acc[0][k][l] += v * v;
                }
        for (int j = 1; j < LEVELS; ++j) {
            for (int k = 0; k < ILP; ++k)
                for (int l = 0; l < W; ++l) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if ((i & (mask << (j * power))) != 0) break;
        }
    }
    for (; i < rows; ++i)
        for (int k = 0; k < ILP; ++k)
            for (int l = 0; l < W; ++l) {
                float v = x[(i * ILP + k) * W + l];
                acc[0][k][l] += v * v;
            }
    for (int j = 1; j < LEVELS; ++j)
        for (int k = 0; k < ILP; ++k)
            for (int l = 0; l < W; ++l) acc[0][k][l] += acc[j][k][l];
    for (i64 v = rows * ILP; v < vecs; ++v) /* vectors left over by the 4 accumulators go to the first */
        for (int l = 0; l < W; ++l) {
            float e = x[v * W + l];
            acc[0][0][l] += e * e;
        }
    for (int k = 1; k < ILP; ++k)
        for (int l = 0; l < W; ++l) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (i64 j = vecs * W; j < n; ++j) total += x[j] * x[j];
    for (int l = 0; l < W; ++l) total += acc[0][0][l];
    return total;
}

/* ---------------------------------------------------------------------------------------------------------------
   Row quantisation (int8.py's _to_ints): scale = max |x| / act_max (1 where that is not > 0), q = round-half-even(x /
   scale); written as floats (fbgemm adds its zero point itself) or as uint8 q + shift (oneDNN). */
static inline float scale_for(float top, float act_max) { /* top / act_max, 1 where that is not > 0 */
    const float s = top / act_max;
    return s > 0.0f ? s : 1.0f;
}

static void quantize_with(const float *x, i64 n, float top, float act_max, int shift, void *q, i64 q_offset,
                          float *scale) {
    const float s = scale_for(top, act_max);
    *scale = s;
    if (shift) {
        uint8_t *out = (uint8_t *)q + q_offset;
        for (i64 j = 0; j < n; ++j) out[j] = (uint8_t)(int)(rintf(x[j] / s) + (float)shift);
    } else {
        float *out = (float *)q + q_offset;
        for (i64 j = 0; j < n; ++j) out[j] = rintf(x[j] / s);
    }
}

static void quantize_row(const float *x, i64 n, float act_max, int shift, void *q, i64 q_offset, float *scale) {
    quantize_with(x, n, abs_max(x, n), act_max, shift, q, q_offset, scale);
}

void sr_quantize(i64 rows, i64 n, const float *x, float act_max, int shift, void *q, float *scales, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (i64 r = 0; r < rows; ++r) quantize_row(x + r * n, n, act_max, shift, q, r * n, scales + r);
}

/* ---------------------------------------------------------------------------------------------------------------
   The residual add folded into the next RMSNorm: x += delta * delta_scale (+ delta_bias) where delta is given (an
   int8 GEMM's products and their row scale: the layer's output), then the model's RMSNorm of x,
   w * (x * (1 / sqrt(sum(x * x) / n + eps))), quantised per row (act_max > 0) or written as floats to out. */
void sr_add_norm_quantize(i64 rows, i64 n, float *x, const float *delta, const float *delta_scale,
                          const float *delta_bias, const float *weight, float eps, float act_max, int shift, void *q,
                          float *scales, float *out, int threads) {
#pragma omp parallel num_threads(threads)
    {
        float *normed = act_max > 0.0f ? (float *)malloc(sizeof(float) * n) : NULL;
#pragma omp for schedule(static)
        for (i64 r = 0; r < rows; ++r) {
            float *row = x + r * n;
            if (delta) {
                const float *d = delta + r * n;
                const float s = delta_scale[r];
                if (delta_bias)
                    for (i64 j = 0; j < n; ++j) row[j] = row[j] + (d[j] * s + delta_bias[j]);
                else
                    for (i64 j = 0; j < n; ++j) row[j] = row[j] + d[j] * s;
            }
            const float var = sum_of_squares(row, n) / (float)n;
            const float inv = 1.0f / sqrtf(var + eps);
            float *dst = normed ? normed : out + r * n;
            vec top = VZERO(); /* max |dst|, found on the way */
            i64 j = 0;
#if VL > 1
            const vec iv = VSET1(inv);
            for (; j + VL <= n; j += VL) {
                const vec value = VMUL(VLOAD(weight + j), VMUL(VLOAD(row + j), iv));
                VSTORE(dst + j, value);
                top = VMAX(VABS(value), top);
            }
#endif
            float tail = 0.0f;
            for (; j < n; ++j) {
                dst[j] = weight[j] * (row[j] * inv);
                tail = max_abs(tail, dst[j]);
            }
            if (normed) quantize_with(normed, n, lanes_max(top, tail), act_max, shift, q, r * n, scales + r);
        }
        free(normed);
    }
}

/* x += delta * delta_scale (+ delta_bias): a layer's last residual add, where no norm follows in this pass. */
void sr_add(i64 rows, i64 n, float *x, const float *delta, const float *delta_scale, const float *delta_bias,
            int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (i64 r = 0; r < rows; ++r) {
        float *row = x + r * n;
        const float *d = delta + r * n;
        const float s = delta_scale[r];
        if (delta_bias)
            for (i64 j = 0; j < n; ++j) row[j] = row[j] + (d[j] * s + delta_bias[j]);
        else
            for (i64 j = 0; j < n; ++j) row[j] = row[j] + d[j] * s;
    }
}

/* ---------------------------------------------------------------------------------------------------------------
   exp for x in [-87, 88] (clamped there): Cody-Waite reduction by ln 2 and Cephes' degree-6 polynomial, every step
   one fmaf or one rounding, so the same bits in a vector lane and in scalar code. */
static inline float sr_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = rintf(x * 1.44269504088896341f);
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    union { float f; int32_t i; } two = {.i = ((int32_t)n + 127) << 23};
    return p * two.f;
}

/* sr_exp on VL lanes at once: the same operations, so the same bits in each lane. */
#if VL > 1
static inline vec sr_vexp(vec x) {
    x = VMIN(VSET1(88.0f), VMAX(VSET1(-87.0f), x));
    const vec n = VROUND(VMUL(x, VSET1(1.44269504088896341f)));
    vec r = VFMA(n, VSET1(-0.693359375f), x);
    r = VFMA(n, VSET1(2.12194440e-4f), r);
    vec p = VSET1(1.9875691500e-4f);
    p = VFMA(p, r, VSET1(1.3981999507e-3f));
    p = VFMA(p, r, VSET1(8.3334519073e-3f));
    p = VFMA(p, r, VSET1(4.1665795894e-2f));
    p = VFMA(p, r, VSET1(1.6666665459e-1f));
    p = VFMA(p, r, VSET1(5.0000001201e-1f));
    p = VADD(VFMA(p, VMUL(r, r), r), VSET1(1.0f));
    return VSCALE(p, n);
}
#endif

/* The gated MLP's middle (int8.py's _gated_to_ints): from the gate and up projections' products (rows of [gate |
   up], 2 * n wide) and their input rows' scales, h = silu(gate * s) * (up * s), silu(g) = g / (1 + exp(-g)),
   quantised per row for the down projection. */
void sr_gated_quantize(i64 rows, i64 n, const float *gate_up, i64 gate_stride, const float *up_ptr, i64 up_stride,
                       const float *scale, float act_max, int shift, void *q, float *scales, int threads) {
#pragma omp parallel num_threads(threads)
    {
        float *h = (float *)malloc(sizeof(float) * n);
#pragma omp for schedule(static)
        for (i64 r = 0; r < rows; ++r) {
            const float *g = gate_up + r * gate_stride;
            const float *u = up_ptr + r * up_stride;
            const float s = scale[r];
            vec top = VZERO(); /* max |h|, found on the way */
            i64 j = 0;
#if VL > 1
            const vec sv = VSET1(s), one = VSET1(1.0f), minus = VSET1(-1.0f);
            for (; j + VL <= n; j += VL) {
                const vec a = VMUL(VLOAD(g + j), sv);
                const vec value = VMUL(VDIV(a, VADD(one, sr_vexp(VMUL(a, minus)))), VMUL(VLOAD(u + j), sv));
                VSTORE(h + j, value);
                top = VMAX(VABS(value), top);
            }
#endif
            float tail = 0.0f;
            for (; j < n; ++j) {
                const float a = g[j] * s;
                h[j] = (a / (1.0f + sr_exp(-a))) * (u[j] * s);
                tail = max_abs(tail, h[j]);
            }
            quantize_with(h, n, lanes_max(top, tail), act_max, shift, q, r * n, scales + r);
        }
        free(h);
    }
}

/* ---------------------------------------------------------------------------------------------------------------
   q/k/v after their fused GEMM, for a pass's tokens (packed: no padding; token m belongs to row row_of[m] and goes to
   position slot[row] + step_of[m] of it): v = products * row scale (+ bias), then the rotary embedding on q's and k's
   heads, (x * cos) + (rotate_half(x) * sin) with rotate_half(x) = (-x2, x1), as the model computes it. Queries go to
   queries (tokens, heads, d); keys (transposed: [row][kv head][d][capacity]) and values ([row][kv head][capacity][d])
   into the rows' buffers. */
static inline void rotate(const float *x, const float *c, const float *s, float *out, i64 d) {
    const i64 half = d / 2;
    for (i64 j = 0; j < half; ++j) out[j] = x[j] * c[j] + (-x[j + half]) * s[j];
    for (i64 j = half; j < d; ++j) out[j] = x[j] * c[j] + x[j - half] * s[j];
}

void sr_qkv_rotary(i64 tokens, i64 heads, i64 kv_heads, i64 d, const float *products, const float *scale,
                   const float *bias, const float *cos, const float *sin, const i64 *row_of, const i64 *step_of,
                   float *queries, float *keys_t, float *values, i64 capacity, const i64 *slot, int threads) {
    const i64 width = (heads + 2 * kv_heads) * d;
#pragma omp parallel num_threads(threads)
    {
        float *v = (float *)malloc(sizeof(float) * width);
        float *k = (float *)malloc(sizeof(float) * d);
#pragma omp for schedule(static)
        for (i64 m = 0; m < tokens; ++m) {
            const i64 r = row_of[m], pos = slot[r] + step_of[m];
            const float *p = products + m * width;
            const float s = scale[m];
            if (bias)
                for (i64 j = 0; j < width; ++j) v[j] = p[j] * s + bias[j];
            else
                for (i64 j = 0; j < width; ++j) v[j] = p[j] * s;
            const float *c = cos + m * d, *sn = sin + m * d;
            for (i64 h = 0; h < heads; ++h) rotate(v + h * d, c, sn, queries + (m * heads + h) * d, d);
            for (i64 h = 0; h < kv_heads; ++h) {
                rotate(v + (heads + h) * d, c, sn, k, d);
                float *kt = keys_t + (r * kv_heads + h) * d * capacity + pos;
                for (i64 j = 0; j < d; ++j) kt[j * capacity] = k[j];
                memcpy(values + ((r * kv_heads + h) * capacity + pos) * d, v + (heads + kv_heads + h) * d,
                       sizeof(float) * d);
            }
        }
        free(v);
        free(k);
    }
}

/* ---------------------------------------------------------------------------------------------------------------
   Attention, one query at a time, its keys in position order, with one fixed order of operations per query:
   score_k = sum over the head dimension, in order, of q * key_k (fmaf), times `scaling`; m = max_k score_k;
   e_k = exp(score_k - m); total = the 16 partial sums of the e_k with k = l mod 16 (each in order of k), added in
   order of l; out = (sum over k, in order, of e_k * value_k (fmaf)) * (1 / total). Nothing in a query's output depends on
   the other queries, the batch, the padding, where its keys are stored, or the vector ISA this was built for.

   A query's keys are up to three runs, one after another: a: the shared prefix's (count_a for every query; its
   keys_t [kv head][d][cap_a], values [kv head][cap_a][d]); b: its row's (row r % rows_b of a [row][kv head][d][cap_b]
   buffer, the first count_b[query] of them); c: the pass's own, in rows of their own (the first count_c[query]).
   Every cap must be a multiple of 16 (keys are read 16 at a time; those past a run's count are never used).
   Queries are a pass's tokens, packed (tokens, heads, d): row r's are [row_start[r], row_start[r + 1]); out (tokens,
   heads * d), then each out row quantised for o_proj when act_max > 0 (into q / scales). Grouped-query attention:
   query head h reads kv head h / (heads / kv_heads). */
#define BLOCK 16 /* keys per block: the softmax total's partial sums, and the caps' multiple */
#define GROUPS_AT_ONCE 8

typedef struct {
    const float *keys_t, *values;
    i64 cap;
} Run;

/* scores[g][k] for the first `count` keys of a run (rounded up to BLOCK: the extra lanes are never read) and the
   groups' queries q[g][d]: sequential fmaf over the head dimension per key, the keys' lanes side by side, times
   scaling. */
#define SCORES(G)                                                                                                  \
    static void scores_##G(const float *kt, i64 cap, i64 d, i64 count, const float *q, const vec scale,           \
                           float *scores, i64 stride) {                                                            \
        for (i64 k0 = 0; k0 < count; k0 += VL) {                                                                   \
            vec acc[G];                                                                                            \
            for (int i = 0; i < G; ++i) acc[i] = VZERO();                                                          \
            for (i64 j = 0; j < d; ++j) {                                                                          \
                const vec key = VLOAD(kt + j * cap + k0);                                                          \
                for (int i = 0; i < G; ++i) acc[i] = VFMA(VSET1(q[i * d + j]), key, acc[i]);                       \
            }                                                                                                      \
            for (int i = 0; i < G; ++i) VSTORE(scores + i * stride + k0, VMUL(acc[i], scale));                     \
        }                                                                                                          \
    }
SCORES(1)
SCORES(2)
SCORES(3)
SCORES(4)
SCORES(5)
SCORES(6)
SCORES(7)
SCORES(8)

static void scores_of(const Run *run, i64 row, i64 kv_heads, i64 h, i64 d, i64 count, const float *q, i64 groups,
                      float scaling, float *scores, i64 stride) {
    if (count <= 0) return;
    const float *kt = run->keys_t + (row * kv_heads + h) * d * run->cap;
    const vec scale = VSET1(scaling);
    for (i64 g0 = 0; g0 < groups; g0 += GROUPS_AT_ONCE) {
        const float *qg = q + g0 * d;
        float *sg = scores + g0 * stride;
        switch (groups - g0 < GROUPS_AT_ONCE ? groups - g0 : GROUPS_AT_ONCE) {
        case 1: scores_1(kt, run->cap, d, count, qg, scale, sg, stride); break;
        case 2: scores_2(kt, run->cap, d, count, qg, scale, sg, stride); break;
        case 3: scores_3(kt, run->cap, d, count, qg, scale, sg, stride); break;
        case 4: scores_4(kt, run->cap, d, count, qg, scale, sg, stride); break;
        case 5: scores_5(kt, run->cap, d, count, qg, scale, sg, stride); break;
        case 6: scores_6(kt, run->cap, d, count, qg, scale, sg, stride); break;
        case 7: scores_7(kt, run->cap, d, count, qg, scale, sg, stride); break;
        default: scores_8(kt, run->cap, d, count, qg, scale, sg, stride); break;
        }
    }
}

/* o[g][j] = sum over the keys k of runs a, b, c in that order of e[g][k] * value_k[j], one fmaf after the other from
   0, for G groups at once (each value vector is loaded once for all of them): G x PARTS vectors of o in registers. */
#define WEIGHTED_SUM(G, PARTS)                                                                                     \
    static void weighted_sum_##G##_##PARTS(const float *const *v, const i64 *count, const float *e, i64 stride,    \
                                           i64 d, float *o) {                                                      \
        vec acc[G][PARTS];                                                                                         \
        for (int g = 0; g < G; ++g)                                                                                \
            for (int p = 0; p < PARTS; ++p) acc[g][p] = VZERO();                                                   \
        for (int r = 0, base = 0; r < 3; base += (int)count[r], ++r)                                              \
            for (i64 k = 0; k < count[r]; ++k) {                                                                   \
                vec value[PARTS];                                                                                  \
                for (int p = 0; p < PARTS; ++p) value[p] = VLOAD(v[r] + k * d + p * VL);                           \
                for (int g = 0; g < G; ++g) {                                                                      \
                    const vec w = VSET1(e[g * stride + base + k]);                                                 \
                    for (int p = 0; p < PARTS; ++p) acc[g][p] = VFMA(w, value[p], acc[g][p]);                      \
                }                                                                                                  \
            }                                                                                                      \
        for (int g = 0; g < G; ++g)                                                                                \
            for (int p = 0; p < PARTS; ++p) VSTORE(o + g * d + p * VL, acc[g][p]);                                 \
    }
WEIGHTED_SUM(1, 1)
WEIGHTED_SUM(2, 1)
WEIGHTED_SUM(4, 1)
WEIGHTED_SUM(1, 2)
WEIGHTED_SUM(2, 2)
WEIGHTED_SUM(4, 2)
WEIGHTED_SUM(1, 4)
WEIGHTED_SUM(2, 4)
WEIGHTED_SUM(3, 4)
WEIGHTED_SUM(4, 4)
WEIGHTED_SUM(1, 8)
WEIGHTED_SUM(2, 8)

/* The weighted sums of `groups` groups whose softmax terms are e[g * stride + k] (keys of runs a, b, c side by
   side), over the runs' values v[r] (d wide) into o[g * d + j]: as many groups at once as registers allow. */
static void weighted_sums(const float *const *v, const i64 *count, const float *e, i64 stride, i64 groups, i64 d,
                          float *o) {
    const i64 parts = d % VL == 0 ? d / VL : 0;
    for (i64 g0 = 0; g0 < groups;) {
        const i64 left = groups - g0;
        const float *eg = e + g0 * stride;
        float *og = o + g0 * d;
        i64 done = 1;
        switch (parts) {
        case 1: done = left >= 4 ? 4 : left >= 2 ? 2 : 1;
            if (done == 4) weighted_sum_4_1(v, count, eg, stride, d, og);
            else if (done == 2) weighted_sum_2_1(v, count, eg, stride, d, og);
            else weighted_sum_1_1(v, count, eg, stride, d, og);
            break;
        case 2: done = left >= 4 ? 4 : left >= 2 ? 2 : 1;
            if (done == 4) weighted_sum_4_2(v, count, eg, stride, d, og);
            else if (done == 2) weighted_sum_2_2(v, count, eg, stride, d, og);
            else weighted_sum_1_2(v, count, eg, stride, d, og);
            break;
        case 4: done = left >= 4 ? 4 : left;
            if (done == 4) weighted_sum_4_4(v, count, eg, stride, d, og);
            else if (done == 3) weighted_sum_3_4(v, count, eg, stride, d, og);
            else if (done == 2) weighted_sum_2_4(v, count, eg, stride, d, og);
            else weighted_sum_1_4(v, count, eg, stride, d, og);
            break;
        case 8: done = left >= 2 ? 2 : 1;
            if (done == 2) weighted_sum_2_8(v, count, eg, stride, d, og);
            else weighted_sum_1_8(v, count, eg, stride, d, og);
            break;
        default: /* any other head size: one group at a time, scalar */
            for (i64 j = 0; j < d; ++j) og[j] = 0.0f;
            for (int r = 0, base = 0; r < 3; base += (int)count[r], ++r)
                for (i64 k = 0; k < count[r]; ++k)
                    for (i64 j = 0; j < d; ++j) og[j] = fmaf(eg[base + k], v[r][k * d + j], og[j]);
        }
        g0 += done;
    }
}

static const float *run_values(const Run *run, i64 row, i64 kv_heads, i64 h, i64 d) {
    return run->values ? run->values + (row * kv_heads + h) * run->cap * d : NULL;
}

/* The softmax of one group's n scaled scores in place (e_k, the tail up to BLOCK zeroed) and its total. */
static float softmax_terms(float *s, i64 n) {
    const i64 padded = (n + BLOCK - 1) / BLOCK * BLOCK;
    for (i64 k = n; k < padded; ++k) s[k] = -INFINITY;
    vec high = VSET1(-INFINITY); /* the max, lanes side by side (exact in any order) */
    for (i64 k = 0; k < padded; k += VL) high = VMAX(VLOAD(s + k), high);
    const float top = lanes_max(high, -INFINITY);
    for (i64 k = 0; k < padded; ++k) s[k] = sr_exp(s[k] - top);
    for (i64 k = n; k < padded; ++k) s[k] = 0.0f;
    float partial[BLOCK];
#if VL > 1
    vec lanes[BLOCK / VL];
    for (int l = 0; l < BLOCK / VL; ++l) lanes[l] = VZERO();
    for (i64 k0 = 0; k0 < padded; k0 += BLOCK)
        for (int l = 0; l < BLOCK / VL; ++l) lanes[l] = VADD(lanes[l], VLOAD(s + k0 + l * VL));
    for (int l = 0; l < BLOCK / VL; ++l) VSTORE(partial + l * VL, lanes[l]);
#else
    for (int l = 0; l < BLOCK; ++l) partial[l] = 0.0f;
    for (i64 k0 = 0; k0 < padded; k0 += BLOCK)
        for (int l = 0; l < BLOCK; ++l) partial[l] += s[k0 + l];
#endif
    float total = 0.0f;
    for (int l = 0; l < BLOCK; ++l) total += partial[l];
    return total;
}

void sr_attention(i64 rows, const i64 *row_start, i64 heads, i64 kv_heads, i64 d, const float *queries, float scaling,
                  const float *a_keys_t, const float *a_values, i64 cap_a, i64 count_a,
                  const float *b_keys_t, const float *b_values, i64 cap_b, i64 rows_b, const i64 *count_b,
                  const float *c_keys_t, const float *c_values, i64 cap_c, const i64 *count_c,
                  float *out, float act_max, int shift, void *q, float *scales, int threads) {
    const i64 groups = heads / kv_heads, width = heads * d;
    const Run a = {a_keys_t, a_values, cap_a}, b = {b_keys_t, b_values, cap_b}, c = {c_keys_t, c_values, cap_c};
    const i64 tokens = row_start[rows];
    i64 most = 0;
    for (i64 m = 0; m < tokens; ++m) {
        const i64 n = count_a + (count_b ? count_b[m] : 0) + (count_c ? count_c[m] : 0);
        most = n > most ? n : most;
    }
    const i64 stride = (most + 2 * BLOCK) / BLOCK * BLOCK; /* room for each run's last block of lanes */
#pragma omp parallel num_threads(threads)
    {
        float *scores = (float *)malloc(sizeof(float) * stride * groups);
        float *totals = (float *)malloc(sizeof(float) * groups);
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (i64 r = 0; r < rows; ++r)
            for (i64 h = 0; h < kv_heads; ++h)
                for (i64 m = row_start[r]; m < row_start[r + 1]; ++m) {
                    const i64 na = count_a, nb = count_b ? count_b[m] : 0, nc = count_c ? count_c[m] : 0;
                    const i64 n = na + nb + nc;
                    const float *qh = queries + (m * heads + h * groups) * d;
                    if (n == 0) {
                        memset(out + m * width + h * groups * d, 0, sizeof(float) * groups * d);
                        continue;
                    }
                    scores_of(&a, 0, kv_heads, h, d, na, qh, groups, scaling, scores, stride);
                    scores_of(&b, r % rows_b, kv_heads, h, d, nb, qh, groups, scaling, scores + na, stride);
                    scores_of(&c, r, kv_heads, h, d, nc, qh, groups, scaling, scores + na + nb, stride);
                    for (i64 g = 0; g < groups; ++g) totals[g] = softmax_terms(scores + g * stride, n);
                    const float *values[3] = {run_values(&a, 0, kv_heads, h, d), run_values(&b, r % rows_b, kv_heads,
                                              h, d), run_values(&c, r, kv_heads, h, d)};
                    const i64 counts[3] = {na, nb, nc};
                    float *o = out + m * width + h * groups * d;
                    weighted_sums(values, counts, scores, stride, groups, d, o);
                    for (i64 g = 0; g < groups; ++g) {
                        const float inverse = 1.0f / totals[g];
                        for (i64 j = 0; j < d; ++j) o[g * d + j] *= inverse;
                    }
                }
        if (act_max > 0.0f) {
#pragma omp for schedule(static)
            for (i64 m = 0; m < tokens; ++m)
                quantize_row(out + m * width, width, act_max, shift, q, m * width, scales + m);
        }
        free(scores);
        free(totals);
    }
}

/* ---------------------------------------------------------------------------------------------------------------
   The output head of a Q8_0 checkpoint (output_head.Q8Head): logits = x @ W^T with W's blocks of 32 int8 values q
   times one scale w_b each. x's blocks of 32 become int16 too (scale x_b = max |x| / 32767, 1 where that is not > 0;
   x16 = round-half-even(x / x_b)), each block's dot product is an exact integer I_b (|I_b| < 2^27: any order, any
   ISA gives it), and logit = sum over the blocks b, in order from 0, of (float)I_b * (w_b * x_b), one rounding per
   operation. Vocabulary rows come in tiles of HEAD_LANES, the weights packed [tile][pair of columns][lane][2] (the
   int16 pairs a dot-product instruction takes: vpdpwssd / vpmaddwd) and the scales [tile][block][lane]. */
#define HEAD_LANES 16
#define HEAD_QBLOCK 32
#define HEAD_PAIRS (HEAD_QBLOCK / 2)
#define HEAD_HV (HEAD_LANES / VL) /* vectors per tile */

static inline int32_t pair_of(const int16_t *p) { /* two int16 side by side, as one int32 to broadcast */
    int32_t v;
    memcpy(&v, p, sizeof(v));
    return v;
}

#if VL == 16 && defined(__AVX512BW__)
typedef __m512i ivec;
#define IZERO() _mm512_setzero_si512()
#define IW_LOAD(p) _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p))) /* 2 * VL int8 -> int16 */
#define IPAIR(p) _mm512_set1_epi32(pair_of(p))
#define ITOF(a) _mm512_cvtepi32_ps(a)
#if defined(__AVX512VNNI__)
#define IDOT(acc, w, x) _mm512_dpwssd_epi32(acc, w, x)
#else
#define IDOT(acc, w, x) _mm512_add_epi32(acc, _mm512_madd_epi16(w, x))
#endif
#define HEAD_ROWS 8
#elif VL == 8
typedef __m256i ivec;
#define IZERO() _mm256_setzero_si256()
#define IW_LOAD(p) _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p)))
#define IPAIR(p) _mm256_set1_epi32(pair_of(p))
#define ITOF(a) _mm256_cvtepi32_ps(a)
#define IDOT(acc, w, x) _mm256_add_epi32(acc, _mm256_madd_epi16(w, x))
#define HEAD_ROWS 3
#elif VL == 1 /* plain C, one lane per vector: a pair of columns at a time, as the instructions do */
#undef HEAD_HV
#define HEAD_HV HEAD_LANES
typedef int32_t ivec;
#define IZERO() 0
#define IW_LOAD(p) (p)
#define IPAIR(p) (p)
#define ITOF(a) ((float)(a))
#define IDOT(acc, w, x) ((acc) + (int32_t)(w)[0] * (x)[0] + (int32_t)(w)[1] * (x)[1])
#define HEAD_ROWS 4
#else
#error "an AVX-512 build needs AVX512BW (runtime/native.py's flags)"
#endif

/* x's row as int16 blocks and their scales. */
static void head_quantize(const float *x, i64 k, int16_t *x16, float *scales) {
    for (i64 b = 0; b < k / HEAD_QBLOCK; ++b) {
        const float *xb = x + b * HEAD_QBLOCK;
        const float s = scale_for(abs_max(xb, HEAD_QBLOCK), 32767.0f);
        scales[b] = s;
        for (i64 j = 0; j < HEAD_QBLOCK; ++j) x16[b * HEAD_QBLOCK + j] = (int16_t)rintf(xb[j] / s);
    }
}

/* R rows (x16, x_scales: k / 32 each) by one tile of vocabulary rows (w, w_scales packed as above) into out. */
#define HEAD_TILE(R)                                                                                               \
    static void head_tile_##R(i64 k, const int8_t *w, const float *ws, const int16_t *x16, const float *xs,       \
                              float *out, i64 out_stride) {                                                        \
        const i64 blocks = k / HEAD_QBLOCK;                                                                        \
        vec f[R][HEAD_HV];                                                                                         \
        for (int r = 0; r < R; ++r)                                                                                \
            for (int h = 0; h < HEAD_HV; ++h) f[r][h] = VZERO();                                                   \
        for (i64 b = 0; b < blocks; ++b) {                                                                         \
            ivec acc[R][HEAD_HV];                                                                                  \
            for (int r = 0; r < R; ++r)                                                                            \
                for (int h = 0; h < HEAD_HV; ++h) acc[r][h] = IZERO();                                             \
            for (int p = 0; p < HEAD_PAIRS; ++p) {                                                                 \
                const int8_t *wp = w + (b * HEAD_PAIRS + p) * HEAD_LANES * 2;                                      \
                for (int r = 0; r < R; ++r) {                                                                      \
                    const int16_t *xp = x16 + r * k + b * HEAD_QBLOCK + 2 * p;                                     \
                    for (int h = 0; h < HEAD_HV; ++h)                                                              \
                        acc[r][h] = IDOT(acc[r][h], IW_LOAD(wp + h * 2 * (HEAD_LANES / HEAD_HV)), IPAIR(xp));      \
                }                                                                                                  \
            }                                                                                                      \
            for (int h = 0; h < HEAD_HV; ++h) {                                                                    \
                const vec scale = VLOAD(ws + b * HEAD_LANES + h * (HEAD_LANES / HEAD_HV));                         \
                for (int r = 0; r < R; ++r)                                                                        \
                    f[r][h] = VADD(f[r][h], VMUL(ITOF(acc[r][h]), VMUL(scale, VSET1(xs[r * blocks + b]))));        \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < R; ++r)                                                                                \
            for (int h = 0; h < HEAD_HV; ++h) VSTORE(out + r * out_stride + h * (HEAD_LANES / HEAD_HV), f[r][h]); \
    }
HEAD_TILE(1)
HEAD_TILE(2)
HEAD_TILE(3)
#if HEAD_ROWS >= 4
HEAD_TILE(4)
#endif
#if HEAD_ROWS >= 8
HEAD_TILE(5)
HEAD_TILE(6)
HEAD_TILE(7)
HEAD_TILE(8)
#endif

static void head_tile(int rows, i64 k, const int8_t *w, const float *ws, const int16_t *x16, const float *xs,
                      float *out, i64 out_stride) {
    switch (rows) {
    case 1: head_tile_1(k, w, ws, x16, xs, out, out_stride); break;
    case 2: head_tile_2(k, w, ws, x16, xs, out, out_stride); break;
    case 3: head_tile_3(k, w, ws, x16, xs, out, out_stride); break;
#if HEAD_ROWS >= 4
    case 4: head_tile_4(k, w, ws, x16, xs, out, out_stride); break;
#endif
#if HEAD_ROWS >= 8
    case 5: head_tile_5(k, w, ws, x16, xs, out, out_stride); break;
    case 6: head_tile_6(k, w, ws, x16, xs, out, out_stride); break;
    case 7: head_tile_7(k, w, ws, x16, xs, out, out_stride); break;
    case 8: head_tile_8(k, w, ws, x16, xs, out, out_stride); break;
#endif
    }
}

/* out (rows, tiles * HEAD_LANES) = the logits of x (rows, k) for packed weights of `tiles` tiles; k a multiple of 32. */
void sr_q8_head(i64 rows, i64 k, const float *x, i64 tiles, const int8_t *w, const float *w_scales, float *out,
                int threads) {
    const i64 blocks = k / HEAD_QBLOCK, width = tiles * HEAD_LANES;
    int16_t *x16 = (int16_t *)malloc(sizeof(int16_t) * rows * k);
    float *xs = (float *)malloc(sizeof(float) * rows * blocks);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (i64 r = 0; r < rows; ++r) head_quantize(x + r * k, k, x16 + r * k, xs + r * blocks);
#pragma omp for schedule(static)
        for (i64 t = 0; t < tiles; ++t)
            for (i64 r0 = 0; r0 < rows; r0 += HEAD_ROWS) {
                const int n = rows - r0 < HEAD_ROWS ? (int)(rows - r0) : HEAD_ROWS;
                head_tile(n, k, w + t * k * HEAD_LANES, w_scales + t * blocks * HEAD_LANES, x16 + r0 * k,
                          xs + r0 * blocks, out + r0 * width + t * HEAD_LANES, width);
            }
    }
    free(x16);
    free(xs);
}
