/* Causal attention whose rows never mix, for rakv/row_attention.py (built into the same
 * library as int4_kernel.c).
 *
 * out[i, h] = sum_j p[j] v[g, j] / sum_j p[j],  p[j] = exp(s[j] - max s),
 * s[j] = scale * (q[h, i] . k[g, j]),  j < seen(i) = kv_length - rows + 1 + i,
 * g = h / (heads / kv_heads): batch 1, T = rows queries after kv_length - rows cached
 * positions, grouped heads.
 *
 * Invariants:
 * - A row's result never depends on the other rows: each (row, head) pair runs the same
 *   operations in the same order over its own keys, whatever the number of rows and
 *   threads. So a forward over T tokens gives each token the bits a one-token forward
 *   gives it, which exact speculation needs; PyTorch's attention blocks its sums by T.
 * - The AVX-512 path and the portable path give the same bits (tests/test_row_attention.py):
 *   a dot product adds its products in 16 lanes (input c into lane c % 16, one fused
 *   multiply-add each), then halves the lanes 8, 4, 2, 1; the softmax sum likewise over
 *   keys; exp is the polynomial below in both (Horner's steps fused multiply-adds); the
 *   weighted sum of values adds key by key, fused. Nothing else fuses: built with
 *   -ffp-contract=off. fmaf is exact everywhere, one instruction where the CPU has FMA.
 * - Cost: a Qwen2.5-Coder 0.5B row of 300 keys, 14 heads, ~30-60 us on AVX-512, the
 *   portable path ~2.5x that with FMA (its clone), ~35x without (fmaf a call).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include "lane_sums.h"

#define EXP_MIN -87.0f  /* below this exp(x) is taken as 0: 2^n stays a normal float */
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693145751953125f  /* ln 2 in two parts, the first exact in few bits: n * LN2_HI is exact */
#define LN2_LO 1.42860682030941723212e-6f

/* exp(x) for x <= 0: 2^n * P(r), n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2],
 * P Taylor's to degree 7 (error under 6e-9, below a float's half ulp). */
__attribute__((always_inline)) static inline float exp_portable(float x) {
    if (x < EXP_MIN) return 0.0f;
    float n = nearbyintf(x * LOG2E);
    float r = (x - n * LN2_HI) - n * LN2_LO;
    float p = 1.0f / 5040;
    p = fmaf(p, r, 1.0f / 720);
    p = fmaf(p, r, 1.0f / 120);
    p = fmaf(p, r, 1.0f / 24);
    p = fmaf(p, r, 1.0f / 6);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, 4);
    return p * two_n;
}

/* One (row, head): out[dim] from q[dim], the keys and values of its kv head (rows of
 * k_step and v_step floats), its first `seen` keys; s: scratch for `seen` floats. */
#if defined(__x86_64__)
__attribute__((target_clones("fma", "default")))  /* fmaf as one instruction where the CPU has it */
#endif
static void row_portable(const float *q, const float *k, const float *v, int64_t k_step, int64_t v_step,
                         int seen, int dim, float scale, float *s, float *out) {
    float top = -INFINITY;
    for (int j = 0; j < seen; j++) {
        s[j] = dot_portable(q, k + j * k_step, dim) * scale;
        if (s[j] > top) top = s[j];
    }
    float lane[LANES] = {0};
    for (int j = 0; j < seen; j++) s[j] = exp_portable(s[j] - top);
    for (int j0 = 0; j0 < seen; j0 += LANES)  /* key j into lane j % 16 */
        for (int i = 0; i < LANES && j0 + i < seen; i++) lane[i] = lane[i] + s[j0 + i];
    float total = halves(lane);
    for (int d = 0; d < dim; d++) out[d] = 0.0f;
    for (int j = 0; j < seen; j++)
        for (int d = 0; d < dim; d++) out[d] = fmaf(s[j], v[j * v_step + d], out[d]);
    for (int d = 0; d < dim; d++) out[d] = out[d] / total;
}

#if defined(__x86_64__)
#define AVX512 __attribute__((target("avx512f,avx512dq,fma"), always_inline)) static inline

/* halves() of 16 vectors at once: lane j of the result is halves(a[j]), in the same pairs
 * (each step adds two vectors' lane i and lane i + w, packing two vectors into one). */
AVX512 __m512 halves_of_16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int p = 0; p < 8; p++)  /* w = 8: quarters 0 + 2 and 1 + 3 of each */
        b[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xee));
    for (int p = 0; p < 4; p++)  /* w = 4: quarter 0 + quarter 1 of each; c[p]'s quarter q: vector 4p + q */
        c[p] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], 0xdd));
    for (int p = 0; p < 2; p++)  /* w = 2, within each quarter */
        d[p] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * p], c[2 * p + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * p], c[2 * p + 1], 0xee));
    /* w = 1: lane 4 q + m holds vector 4 m + q */
    __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xdd));
    return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), e);
}

AVX512 __m512 exp16(__m512 x) {
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(LN2_HI))),
                             _mm512_mul_ps(n, _mm512_set1_ps(LN2_LO)));
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_MIN), _CMP_GE_OQ), y);
}

/* out[dim] = sum_j s[j] v[j] / total, key by key. Inlined with dim a constant (64, 128),
 * its dim / 16 sums stay in registers and run side by side: one at a time, each waited
 * for its previous add. */
AVX512 void weigh_values(const float *s, const float *v, int64_t v_step, int seen, int dim, float total,
                         float *out) {
    __m512 acc[16];  /* dim <= 256 */
    for (int c = 0; c < dim / LANES; c++) acc[c] = _mm512_setzero_ps();
    for (int j = 0; j < seen; j++) {
        __m512 p = _mm512_set1_ps(s[j]);
        for (int c = 0; c < dim / LANES; c++)
            acc[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + j * v_step + c * LANES), acc[c]);
    }
    for (int c = 0; c < dim / LANES; c++)
        _mm512_storeu_ps(out + c * LANES, _mm512_div_ps(acc[c], _mm512_set1_ps(total)));
}

/* s[j] = scale * (q . k[j]) for j < seen, 16 keys at a time (each key's dot in 16 lanes,
 * then halves_of_16); returns their max. Inlined with dim a constant, q stays in registers. */
AVX512 float score_keys(const float *q, const float *k, int64_t k_step, int seen, int dim, float scale, float *s) {
    __m512 qv[16], top = _mm512_set1_ps(-INFINITY), scale16 = _mm512_set1_ps(scale);
    for (int c = 0; c < dim / LANES; c++) qv[c] = _mm512_loadu_ps(q + c * LANES);
    for (int j0 = 0; j0 < seen; j0 += LANES) {
        int live = seen - j0 < LANES ? seen - j0 : LANES;
        __m512 lanes[LANES];
        for (int j = 0; j < LANES; j++) {
            const float *key = k + (j0 + (j < live ? j : 0)) * k_step;  /* a dead lane reads a live key */
            lanes[j] = _mm512_setzero_ps();
            for (int c = 0; c < dim / LANES; c++)
                lanes[j] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(key + c * LANES), lanes[j]);
        }
        __mmask16 mask = (__mmask16)((1u << live) - 1);
        __m512 scores = _mm512_mul_ps(halves_of_16(lanes), scale16);
        _mm512_mask_storeu_ps(s + j0, mask, scores);
        top = _mm512_mask_max_ps(top, mask, top, scores);
    }
    return _mm512_reduce_max_ps(top);
}

/* row_portable's bits, dim a multiple of 16, at most 256. */
__attribute__((target("avx512f,avx512dq,fma")))
static void row_vector(const float *q, const float *k, const float *v, int64_t k_step, int64_t v_step,
                       int seen, int dim, float scale, float *s, float *out) {
    float top = dim == 64 ? score_keys(q, k, k_step, seen, 64, scale, s)
              : dim == 128 ? score_keys(q, k, k_step, seen, 128, scale, s)
              : score_keys(q, k, k_step, seen, dim, scale, s);
    __m512 lane = _mm512_setzero_ps(), max = _mm512_set1_ps(top);
    for (int j = 0; j < seen; j += LANES) {
        __mmask16 live = seen - j >= LANES ? 0xffff : (__mmask16)((1u << (seen - j)) - 1);
        __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + j), max)));
        _mm512_mask_storeu_ps(s + j, live, p);
        lane = _mm512_add_ps(lane, p);  /* dead lanes add +0 to sums of non-negative terms: no change */
    }
    float sums[LANES];
    _mm512_storeu_ps(sums, lane);
    float total = halves(sums);
    if (dim == 64)
        weigh_values(s, v, v_step, seen, 64, total, out);
    else if (dim == 128)
        weigh_values(s, v, v_step, seen, 128, total, out);
    else
        weigh_values(s, v, v_step, seen, dim, total, out);
}

static int vector_usable(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
}
#endif

/* out [rows, heads, dim] (contiguous) from q [heads, rows, dim], k and v [kv_heads,
 * kv_length, dim], each given by its head and position strides in floats (a position's
 * dim floats contiguous). portable: 1 forces the portable path. Returns 0, or -1 where
 * a thread's scratch (kv_length floats) cannot be allocated. */
int rakv_attention(const float *q, int64_t q_head, int64_t q_row, const float *k, int64_t k_head, int64_t k_row,
                   const float *v, int64_t v_head, int64_t v_row, float *out, int rows, int heads, int kv_heads,
                   int kv_length, int dim, float scale, int num_threads, int portable) {
    int vector = 0;
#if defined(__x86_64__)
    vector = !portable && dim % LANES == 0 && dim <= 16 * LANES && vector_usable();
#endif
    int group = heads / kv_heads, failed = 0;
    #pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        float *s = malloc(sizeof(float) * (kv_length > 0 ? kv_length : 1));
        if (!s) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for collapse(2) schedule(static)
        for (int i = 0; i < rows; i++)
            for (int h = 0; h < heads; h++) {
                if (!s) continue;
                int g = h / group, seen = kv_length - rows + 1 + i;
                const float *qi = q + h * q_head + i * q_row, *kg = k + g * k_head, *vg = v + g * v_head;
                float *o = out + ((int64_t)i * heads + h) * dim;
#if defined(__x86_64__)
                if (vector) {
                    row_vector(qi, kg, vg, k_row, v_row, seen, dim, scale, s, o);
                    continue;
                }
#endif
                row_portable(qi, kg, vg, k_row, v_row, seen, dim, scale, s, o);
            }
        free(s);
    }
    return failed ? -1 : 0;
}
