/* A decoder layer's small ops in one call each, for rakv/layer_kernel.py (built into the
 * library of int4_kernel.c): rotary embedding and RMSNorm. In torch each is 5-8 ops of
 * 5-25 us on a one-token row; here one call of a few.
 *
 * Invariants:
 * - Rotary embedding gives Hugging Face's bits: out = x cos + rotate_half(x) sin, the
 *   same three roundings per element (two products, one sum; nothing fuses: built with
 *   -ffp-contract=off), so it may stand in for HF's in any float32 model.
 * - RMSNorm is the quantized modes' own (another arithmetic than HF's, whose mean sums in
 *   an order of torch's): y = w * (x * (1 / sqrt(ss / n + eps))), ss the sum of squares in
 *   16 lanes (input c into lane c % 16, one fused multiply-add each) halved 8, 4, 2, 1.
 *   Each row alone, so rows never mix; the AVX-512 path, the AVX2 path (16 lanes in two
 *   8-lane registers: halving by 8 adds the two) and the portable one give the same bits
 *   (tests/test_layer_kernel.py).
 */
#include <math.h>
#include <stdint.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernel_paths.h"
#include "lane_sums.h"

/* One row of x (heads of dim floats, x_head apart) rotated into out (out_head apart);
 * cos, sin [dim]. */
static void rope_row_portable(const float *x, int64_t x_head, float *out, int64_t out_head, int heads, int dim,
                              const float *cos, const float *sin) {
    int half = dim / 2;
    for (int h = 0; h < heads; h++)
        for (int d = 0; d < dim; d++) {
            float rot = d < half ? -x[h * x_head + d + half] : x[h * x_head + d - half];
            out[h * out_head + d] = x[h * x_head + d] * cos[d] + rot * sin[d];
        }
}

#if defined(__x86_64__)
/* rope_row_portable's bits, half of dim a multiple of 16. */
__attribute__((target("avx512f")))
static void rope_row_vector(const float *x, int64_t x_head, float *out, int64_t out_head, int heads, int dim,
                            const float *cos, const float *sin) {
    int half = dim / 2;
    __m512i sign = _mm512_set1_epi32((int)0x80000000);
    for (int h = 0; h < heads; h++)
        for (int d = 0; d < dim; d += LANES) {
            const float *xh = x + h * x_head;
            __m512 rot = d < half ? _mm512_castsi512_ps(_mm512_xor_si512(
                                        _mm512_castps_si512(_mm512_loadu_ps(xh + d + half)), sign))  /* -x, exactly */
                                  : _mm512_loadu_ps(xh + d - half);
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(xh + d), _mm512_loadu_ps(cos + d));
            _mm512_storeu_ps(out + h * out_head + d, _mm512_add_ps(a, _mm512_mul_ps(rot, _mm512_loadu_ps(sin + d))));
        }
}

/* rope_row_portable's bits, half of dim a multiple of 8. */
__attribute__((target("avx2")))
static void rope_row_avx2(const float *x, int64_t x_head, float *out, int64_t out_head, int heads, int dim,
                          const float *cos, const float *sin) {
    int half = dim / 2;
    __m256 sign = _mm256_set1_ps(-0.0f);
    for (int h = 0; h < heads; h++)
        for (int d = 0; d < dim; d += 8) {
            const float *xh = x + h * x_head;
            __m256 rot = d < half ? _mm256_xor_ps(_mm256_loadu_ps(xh + d + half), sign)  /* -x, exactly */
                                  : _mm256_loadu_ps(xh + d - half);
            __m256 a = _mm256_mul_ps(_mm256_loadu_ps(xh + d), _mm256_loadu_ps(cos + d));
            _mm256_storeu_ps(out + h * out_head + d, _mm256_add_ps(a, _mm256_mul_ps(rot, _mm256_loadu_ps(sin + d))));
        }
}
#endif

/* q [heads, rows, dim] and k [kv_heads, rows, dim] (strides in floats: head, row) rotated
 * into q_out, k_out, contiguous in that shape; cos, sin [rows, dim] contiguous. path:
 * kernel_paths.h's (-1: the fastest allowed; AVX-512 from PATH_AVX512 on, AVX2 from
 * PATH_AVX2, else portable). */
void rakv_rope(const float *q, int64_t q_head, int64_t q_row, int heads, const float *k, int64_t k_head,
               int64_t k_row, int kv_heads, int rows, int dim, const float *cos, const float *sin,
               float *q_out, float *k_out, int path) {
    path = rakv_path(path);  /* a vector path's steps must not cross the half: the next one down where they would */
    if (path >= PATH_AVX512 && (dim / 2) % LANES != 0) path = PATH_AVX2;
    if (path >= PATH_AVX2 && (dim / 2) % 8 != 0) path = PATH_PORTABLE;
    int64_t out_head = (int64_t)rows * dim;
    for (int r = 0; r < rows; r++) {
        const float *c = cos + (int64_t)r * dim, *s = sin + (int64_t)r * dim;
        float *qo = q_out + (int64_t)r * dim, *ko = k_out + (int64_t)r * dim;
#if defined(__x86_64__)
        if (path >= PATH_AVX512) {
            rope_row_vector(q + r * q_row, q_head, qo, out_head, heads, dim, c, s);
            rope_row_vector(k + r * k_row, k_head, ko, out_head, kv_heads, dim, c, s);
            continue;
        }
        if (path >= PATH_AVX2) {
            rope_row_avx2(q + r * q_row, q_head, qo, out_head, heads, dim, c, s);
            rope_row_avx2(k + r * k_row, k_head, ko, out_head, kv_heads, dim, c, s);
            continue;
        }
#endif
        rope_row_portable(q + r * q_row, q_head, qo, out_head, heads, dim, c, s);
        rope_row_portable(k + r * k_row, k_head, ko, out_head, kv_heads, dim, c, s);
    }
}

#if defined(__x86_64__)
__attribute__((target_clones("fma", "default")))  /* fmaf as one instruction where the CPU has it */
#endif
static float squares_portable(const float *x, int n) {
    return dot_portable(x, x, n);
}

#if defined(__x86_64__)
__attribute__((target("avx512f,fma")))
static float squares_vector(const float *x, int n) {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < n; c += LANES) {
        __mmask16 live = n - c >= LANES ? 0xffff : (__mmask16)((1u << (n - c)) - 1);
        __m512 v = _mm512_maskz_loadu_ps(live, x + c);  /* dead lanes add 0 * 0 to sums of squares: no change */
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    float lane[LANES];
    _mm512_storeu_ps(lane, acc);
    return halves(lane);
}

__attribute__((target("avx2,fma")))
static float squares_avx2(const float *x, int n) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();  /* lanes 0-7 and 8-15 */
    int c = 0;
    for (; c + LANES <= n; c += LANES) {
        __m256 a = _mm256_loadu_ps(x + c), b = _mm256_loadu_ps(x + c + 8);
        lo = _mm256_fmadd_ps(a, a, lo);
        hi = _mm256_fmadd_ps(b, b, hi);
    }
    for (; c < n; c += 8) {  /* the last 1-15: dead lanes add 0 * 0 to sums of squares, no change */
        __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256 a = _mm256_maskload_ps(x + c, live);
        if (c % LANES == 0)
            lo = _mm256_fmadd_ps(a, a, lo);
        else
            hi = _mm256_fmadd_ps(a, a, hi);
    }
    float lane[LANES];
    _mm256_storeu_ps(lane, lo);
    _mm256_storeu_ps(lane + 8, hi);
    return halves(lane);
}
#endif

/* y [rows, n] = RMSNorm of x [rows, n] (contiguous) with weight w [n]. */
void rakv_rms_norm(const float *x, int rows, int n, const float *w, float eps, float *y, int path) {
    path = rakv_path(path);
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (int64_t)r * n;
        float ss;
#if defined(__x86_64__)
        if (path >= PATH_AVX512)
            ss = squares_vector(xr, n);
        else if (path >= PATH_AVX2)
            ss = squares_avx2(xr, n);
        else
#endif
            ss = squares_portable(xr, n);
        float scale = 1.0f / sqrtf(ss / (float)n + eps);
        float *yr = y + (int64_t)r * n;
        for (int c = 0; c < n; c++) yr[c] = w[c] * (xr[c] * scale);
    }
}
