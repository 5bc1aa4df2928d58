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
 * - The AVX-512 path, the AVX2 path and the portable path give the same bits
 *   (tests/test_row_attention.py): a dot product adds its products in 16 lanes (input c
 *   into lane c % 16, one fused multiply-add each), then halves the lanes 8, 4, 2, 1; the
 *   softmax sum likewise over keys; exp is the polynomial below in all three (Horner's
 *   steps fused multiply-adds); the weighted sum of values adds key by key, fused. Nothing
 *   else fuses: built with -ffp-contract=off. fmaf is exact everywhere, one instruction
 *   where the CPU has FMA. AVX2's 16 lanes are two 8-lane registers: halving by 8 adds
 *   the two, 4, 2 and 1 run within one.
 * - Cost: a Qwen2.5-Coder 0.5B row of 300 keys, 14 heads, ~30-60 us on AVX-512, the AVX2
 *   path ~1-1.2x that (on the same CPU), the portable path ~2.5x with FMA (its clone), ~35x
 *   without (fmaf a call).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include "kernel_paths.h"
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

/* The AVX2 path (PATH_AVX2 and PATH_VNNI256; kernel_paths.h's AVX2 helpers): 8 lanes a
 * register and 16 registers, so its blocks are smaller than AVX-512's. */

/* halves() of 8 keys' dot products at once, from their lanes already halved by 8 (t[j]:
 * key j's lane[i] + lane[i + 8]): lane j of the result is halves(key j's lanes), in the
 * same pairs (each step adds two vectors' lane i and lane i + w, packing two into one). */
AVX2 __m256 halves_of_8(const __m256 *t) {
    __m256 b[4], c[2];
    for (int p = 0; p < 4; p++)  /* w = 4: half 0 + half 1 of each; b[p]'s half h: key 2p + h */
        b[p] = _mm256_add_ps(_mm256_permute2f128_ps(t[2 * p], t[2 * p + 1], 0x20),
                             _mm256_permute2f128_ps(t[2 * p], t[2 * p + 1], 0x31));
    for (int p = 0; p < 2; p++)  /* w = 2, within each half */
        c[p] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * p], b[2 * p + 1], 0x44),
                             _mm256_shuffle_ps(b[2 * p], b[2 * p + 1], 0xee));
    /* w = 1: lane 4 h + m holds key 2 m + h */
    __m256 e = _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], 0x88), _mm256_shuffle_ps(c[0], c[1], 0xdd));
    return _mm256_permutevar8x32_ps(e, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

AVX2 __m256i first8(int live) {  /* a mask of lanes 0 .. live - 1 */
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(live), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

AVX2 __m256 exp8(__m256 x) {  /* exp16's steps */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(LN2_HI))),
                             _mm256_mul_ps(n, _mm256_set1_ps(LN2_LO)));
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(EXP_MIN), _CMP_GE_OQ), y);
}

/* s[0 .. live - 1] = exp(s - max) in place (up to 8 of them); returns them, +0 in dead
 * lanes: added to sums of non-negative terms, those change nothing. */
AVX2 __m256 weights8(float *s, int live, __m256 max) {
    __m256i mask = first8(live);
    __m256 p = _mm256_and_ps(_mm256_castsi256_ps(mask), exp8(_mm256_sub_ps(_mm256_maskload_ps(s, mask), max)));
    _mm256_maskstore_ps(s, mask, p);
    return p;
}

/* weigh_values, 8 lanes a register. With dim 128 its 16 sums and the key's weight are one
 * register more than AVX2 has: one spilled ran faster than two passes over the values of
 * 8 sums each (each pass half of every row). */
AVX2 void weigh_values8(const float *s, const float *v, int64_t v_step, int seen, int dim, float total,
                        float *out) {
    __m256 acc[32];  /* dim <= 256 */
    for (int c = 0; c < dim / 8; c++) acc[c] = _mm256_setzero_ps();
    for (int j = 0; j < seen; j++) {
        __m256 p = _mm256_set1_ps(s[j]);
        for (int c = 0; c < dim / 8; c++)
            acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + j * v_step + c * 8), acc[c]);
    }
    for (int c = 0; c < dim / 8; c++)
        _mm256_storeu_ps(out + c * 8, _mm256_div_ps(acc[c], _mm256_set1_ps(total)));
}

/* score_keys' s[j] and max, 8 keys at a time, 4 of them side by side (their 8 sums and q's
 * two registers a step: 10 of the 16 registers). Inlined with dim a constant. */
AVX2 float score_keys8(const float *q, const float *k, int64_t k_step, int seen, int dim, float scale, float *s) {
    __m256 top = _mm256_set1_ps(-INFINITY), scale8 = _mm256_set1_ps(scale);
    for (int j0 = 0; j0 < seen; j0 += 8) {
        int live = seen - j0 < 8 ? seen - j0 : 8;
        __m256 t[8];
        for (int j1 = 0; j1 < 8; j1 += 4) {
            __m256 lo[4], hi[4];  /* a key's lanes 0-7 and 8-15 */
            const float *key[4];
            for (int j = 0; j < 4; j++) {
                key[j] = k + (j0 + (j1 + j < live ? j1 + j : 0)) * k_step;  /* a dead lane reads a live key */
                lo[j] = hi[j] = _mm256_setzero_ps();
            }
            for (int c = 0; c < dim; c += LANES) {
                __m256 q_lo = _mm256_loadu_ps(q + c), q_hi = _mm256_loadu_ps(q + c + 8);
                for (int j = 0; j < 4; j++) {
                    lo[j] = _mm256_fmadd_ps(q_lo, _mm256_loadu_ps(key[j] + c), lo[j]);
                    hi[j] = _mm256_fmadd_ps(q_hi, _mm256_loadu_ps(key[j] + c + 8), hi[j]);
                }
            }
            for (int j = 0; j < 4; j++) t[j1 + j] = _mm256_add_ps(lo[j], hi[j]);  /* w = 8 */
        }
        __m256i mask = first8(live);
        __m256 scores = _mm256_mul_ps(halves_of_8(t), scale8);
        _mm256_maskstore_ps(s + j0, mask, scores);
        top = _mm256_blendv_ps(top, _mm256_max_ps(top, scores), _mm256_castsi256_ps(mask));
    }
    return max8(top);
}

/* row_portable's bits, dim a multiple of 16, at most 256. */
__attribute__((target("avx2,fma,f16c")))
static void row_avx2(const float *q, const float *k, const float *v, int64_t k_step, int64_t v_step,
                     int seen, int dim, float scale, float *s, float *out) {
    float top = dim == 64 ? score_keys8(q, k, k_step, seen, 64, scale, s)
              : dim == 128 ? score_keys8(q, k, k_step, seen, 128, scale, s)
              : score_keys8(q, k, k_step, seen, dim, scale, s);
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps(), max = _mm256_set1_ps(top);
    for (int j = 0; j < seen; j += LANES) {  /* key j into lane j % 16: lanes 0-7 in lo, 8-15 in hi */
        lo = _mm256_add_ps(lo, weights8(s + j, seen - j, max));
        if (seen - j > 8) hi = _mm256_add_ps(hi, weights8(s + j + 8, seen - j - 8, max));
    }
    float sums[LANES];
    _mm256_storeu_ps(sums, lo);
    _mm256_storeu_ps(sums + 8, hi);
    float total = halves(sums);
    if (dim == 64)
        weigh_values8(s, v, v_step, seen, 64, total, out);
    else if (dim == 128)
        weigh_values8(s, v, v_step, seen, 128, total, out);
    else
        weigh_values8(s, v, v_step, seen, dim, total, out);
}

#endif

/* out [rows, heads, dim] (contiguous) from q [heads, rows, dim], k and v [kv_heads,
 * kv_length, dim], each given by its head and position strides in floats (a position's
 * dim floats contiguous). path: kernel_paths.h's (-1: the fastest allowed; the AVX-512
 * path from PATH_AVX512 on, the AVX2 one from PATH_AVX2, else the portable one). Returns
 * 0, or -1 where a thread's scratch (kv_length floats) cannot be allocated. */
int rakv_attention(const float *q, int64_t q_head, int64_t q_row, const float *k, int64_t k_head, int64_t k_row,
                   const float *v, int64_t v_head, int64_t v_row, float *out, int rows, int heads, int kv_heads,
                   int kv_length, int dim, float scale, int num_threads, int path) {
    int chosen = PATH_PORTABLE;  /* the path this call runs */
#if defined(__x86_64__)
    if (dim % LANES == 0 && dim <= 16 * LANES) chosen = rakv_path(path);
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
                if (chosen >= PATH_AVX512) {
                    row_vector(qi, kg, vg, k_row, v_row, seen, dim, scale, s, o);
                    continue;
                }
                if (chosen >= PATH_AVX2) {
                    row_avx2(qi, kg, vg, k_row, v_row, seen, dim, scale, s, o);
                    continue;
                }
#endif
                row_portable(qi, kg, vg, k_row, v_row, seen, dim, scale, s, o);
            }
        free(s);
    }
    return failed ? -1 : 0;
}

/* rakv_attention for several requests' rows in one call (a batched forward's layer):
 * request p's rows first[p] .. first[p] + rows[p] - 1 of q, new_k and new_v are first
 * appended to its cache, positions length[p] on of its key and value buffers k[p], v[p]
 * ([kv_heads, capacity, dim] floats, head stride kv_head[p], row stride dim, with room for
 * them), then attend as rakv_attention's call for that request alone does (kv_length =
 * length[p] + rows[p]; out at row first[p] of out [N, heads, dim]): the very same call, so
 * each request's bits are its own forward's. One call instead of a cache update and an
 * attention call per request and layer from Python (SmolLM2, 8 requests: 30 of a 55 ms
 * step). Returns 0, or -1 where scratch memory ran out. */
int rakv_attention_many(const float *q, int64_t q_head, int64_t q_row, const float *new_k, int64_t nk_head,
                        int64_t nk_row, const float *new_v, int64_t nv_head, int64_t nv_row, int num_requests,
                        const int32_t *first, const int32_t *rows, const int32_t *length, float *const *k,
                        float *const *v, const int64_t *kv_head, float *out, int heads, int kv_heads, int dim,
                        float scale, int num_threads, int path) {
    for (int p = 0; p < num_requests; p++) {
        for (int g = 0; g < kv_heads; g++)
            for (int i = 0; i < rows[p]; i++) {
                int64_t at = g * kv_head[p] + (int64_t)(length[p] + i) * dim;
                memcpy(k[p] + at, new_k + g * nk_head + (first[p] + i) * nk_row, sizeof(float) * dim);
                memcpy(v[p] + at, new_v + g * nv_head + (first[p] + i) * nv_row, sizeof(float) * dim);
            }
        if (rakv_attention(q + first[p] * q_row, q_head, q_row, k[p], kv_head[p], dim, v[p], kv_head[p], dim,
                           out + (int64_t)first[p] * heads * dim, rows[p], heads, kv_heads, length[p] + rows[p],
                           dim, scale, num_threads, path))
            return -1;
    }
    return 0;
}
