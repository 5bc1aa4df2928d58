/* int8 per-channel weights times per-row int8 activations, for rakv/weights.py's Int8Forward
 * (built into the library of int4_kernel.c).
 *
 * y[r, n] = ((float)sum_k wq[n, k] * xq[r, k] * w_scale[n]) * x_scale[r] (+ bias[n]), the
 * float operations in that order, with x_scale[r] = max(max_k |x[r, k]|, TINY) / 127 and
 * xq = x / x_scale rounded half to even, in one call per layer. Rows never mix (integer
 * sums, then elementwise float operations), and every path (portable, AVX2, 256-bit VNNI,
 * AVX-512 VNNI, AMX: kernel_paths.h) gives the same bits, for its sums are exact:
 * - VNNI and AMX multiply unsigned by signed bytes, so the inputs go in as xu = xq + 128
 *   and 128 * colsum[n] (colsum[n] = sum_k wq[n, k]) comes off;
 * - AVX2 has no u8 x s8 dot into int32, and vpmaddubsw saturates its int16 pair sums
 *   (255 x 127 x 2 would). As llama.cpp does, each weight's sign moves onto its input
 *   (vpsignb): |wq| x (sign(wq) xq) pairs are at most 2 x 127 x 127 = 32,258, exact in
 *   int16, and vpmaddwd widens them to int32. wq = -128 never occurs (-127..127). This
 *   path's inputs are xq itself, broadcast straight from memory (no 128 to take off).
 *
 * Packed layout: output channels in blocks of 16 lanes; for block nb and inputs 4j..4j+3,
 * 64 bytes at packed + (nb * k / 4 + j) * 64, byte 4 lane + i = wq[16 nb + lane, 4 j + i]
 * (the 256-bit paths take lanes 0-7 from its first 32 bytes). k is a multiple of 4. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kernel_paths.h"

#define TINY 1e-30f
#define TILE8 16  /* rows per weight load: one accumulator each, no per-group epilogue */
#define TILE8_256 6  /* the 256-bit paths: 2 x 6 accumulators */
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,fma"), always_inline)) static inline

static void quantize_rows8(const float *x, int rows, int k, uint8_t *xu, float *x_scale) {
    for (int r = 0; r < rows; r++) {
        const float *v = x + (int64_t)r * k;
        float amax = 0.0f;
        for (int i = 0; i < k; i++) amax = fmaxf(amax, fabsf(v[i]));
        float scale = fmaxf(amax, TINY) / QMAX;
        for (int i = 0; i < k; i++)
            xu[(int64_t)r * k + i] = (uint8_t)((int)fminf(fmaxf(nearbyintf(v[i] / scale), -QMAX), QMAX) + 128);
        x_scale[r] = scale;
    }
}

/* One output: the integer sum less the inputs' offset, then the channel scale, the row
 * scale and the bias, in that order (the vector path's order too). */
static inline float finish8(int32_t sum, int32_t colsum, float w_scale, float x_scale, const float *bias) {
    float out = (float)(sum - 128 * colsum) * w_scale * x_scale;
    return bias ? out + *bias : out;
}

static void block8_portable(const int8_t *packed, const int32_t *colsum, const float *w_scale, const float *bias,
                            const uint8_t *xu, const float *x_scale, int k, int rows, float *y, int n) {
    for (int r = 0; r < rows; r++)
        for (int lane = 0; lane < LANES; lane++) {
            int32_t dot = 0;
            for (int j = 0; j < k / 4; j++)
                for (int i = 0; i < 4; i++)
                    dot += (int32_t)xu[(int64_t)r * k + 4 * j + i] * packed[(int64_t)j * 64 + lane * 4 + i];
            y[(int64_t)r * n + lane] = finish8(dot, colsum[lane], w_scale[lane], x_scale[r], bias ? bias + lane : NULL);
        }
}

#if defined(__x86_64__)
/* The lanes of 16 inputs from i on that lie before k. */
static inline __mmask16 live16(int i, int k) {
    return k - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - i)) - 1);
}

/* finish8 on 16 channels at once, in its order: y[0..15] for one row's int32 sums. */
__attribute__((target("avx512f"), always_inline))
static inline void finish8_16(__m512i sums, __m512i offset, __m512 w_scale, float x_scale, const float *bias,
                              float *y) {
    __m512 out = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums, offset)), w_scale),
                               _mm512_set1_ps(x_scale));
    if (bias) out = _mm512_add_ps(out, _mm512_loadu_ps(bias));
    _mm512_storeu_ps(y, out);
}

__attribute__((target("avx512f,avx512bw")))
static void quantize_rows8_avx512(const float *x, int rows, int k, uint8_t *xu, float *x_scale) {
    for (int r = 0; r < rows; r++) {
        const float *v = x + (int64_t)r * k;
        __m512 amax = _mm512_setzero_ps();
        for (int i = 0; i < k; i += 16) {
            __mmask16 live = live16(i, k);
            amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(live, v + i)));
        }
        float scale = fmaxf(_mm512_reduce_max_ps(amax), TINY) / QMAX;
        __m512 divisor = _mm512_set1_ps(scale);
        for (int i = 0; i < k; i += 16) {
            __mmask16 live = live16(i, k);
            __m512 rounded = _mm512_roundscale_ps(_mm512_div_ps(_mm512_maskz_loadu_ps(live, v + i), divisor),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            rounded = _mm512_min_ps(_mm512_max_ps(rounded, _mm512_set1_ps(-QMAX)), _mm512_set1_ps(QMAX));
            __m512i shifted = _mm512_add_epi32(_mm512_cvtps_epi32(rounded), _mm512_set1_epi32(128));
            _mm512_mask_cvtepi32_storeu_epi8(xu + (int64_t)r * k + i, live, shifted);  /* low bytes: 1..255 */
        }
        x_scale[r] = scale;
    }
}

VNNI void block8_vnni_rows(const int8_t *packed, const int32_t *colsum, const float *w_scale, const float *bias,
                           const uint8_t *xu, const float *x_scale, int k, const int rows, float *y, int n) {
    __m512i dot[TILE8];
    for (int r = 0; r < rows; r++) dot[r] = _mm512_setzero_si512();
    for (int j = 0; j < k / 4; j++) {
        const int8_t *w = packed + (int64_t)j * 64;
        _mm_prefetch((const char *)w + PREFETCH, _MM_HINT_T0);
        __m512i weights = _mm512_loadu_si512((const void *)w);
        for (int r = 0; r < rows; r++) {
            int32_t inputs;
            memcpy(&inputs, xu + (int64_t)r * k + 4 * j, 4);
            dot[r] = _mm512_dpbusd_epi32(dot[r], _mm512_set1_epi32(inputs), weights);
        }
    }
    __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512((const void *)colsum), 7);  /* 128 colsum */
    __m512 scale = _mm512_loadu_ps(w_scale);
    for (int r = 0; r < rows; r++) finish8_16(dot[r], offset, scale, x_scale[r], bias, y + (int64_t)r * n);
}

__attribute__((target("avx512f,avx512bw,avx512vnni,fma")))
static void block8_vnni(const int8_t *packed, const int32_t *colsum, const float *w_scale, const float *bias,
                        const uint8_t *xu, const float *x_scale, int k, int rows, float *y, int n) {
    switch (rows) {
#define ROWS(R) case R: block8_vnni_rows(packed, colsum, w_scale, bias, xu, x_scale, k, R, y, n); break;
        ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
        ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14) ROWS(15) ROWS(16)
#undef ROWS
    }
}
/* finish8 on 8 channels at once, in its order. */
AVX2 void finish8_8(__m256i sums, __m256i offset, __m256 w_scale, float x_scale, const float *bias, float *y) {
    __m256 out = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sums, offset)), w_scale),
                               _mm256_set1_ps(x_scale));
    if (bias) out = _mm256_add_ps(out, _mm256_loadu_ps(bias));
    _mm256_storeu_ps(y, out);
}

/* 8 inputs over divisor, rounded half to even and clamped to -QMAX..QMAX, as int32. */
AVX2 __m256i quantize8_over(__m256 v, __m256 divisor) {
    __m256 rounded = _mm256_round_ps(_mm256_div_ps(v, divisor), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(rounded, _mm256_set1_ps(-QMAX)), _mm256_set1_ps(QMAX)));
}

/* quantize_rows8 with the same bits: 8 inputs at a time for the max, 32 for the rest,
 * the tail as quantize_rows8 does it. offset: 128 (xu, as the VNNI paths take them) or
 * 0 (xq as signed bytes, as the AVX2 path broadcasts them straight from memory). */
__attribute__((target("avx2,fma,f16c")))
static void quantize_rows8_avx2(const float *x, int rows, int k, int offset, uint8_t *xu, float *x_scale) {
    for (int r = 0; r < rows; r++) {
        const float *v = x + (int64_t)r * k;
        uint8_t *out = xu + (int64_t)r * k;
        __m256 top = _mm256_setzero_ps();
        int i = 0;
        for (; i + 8 <= k; i += 8) top = _mm256_max_ps(top, abs8(_mm256_loadu_ps(v + i)));
        float amax = max8(top);
        for (; i < k; i++) amax = fmaxf(amax, fabsf(v[i]));
        float scale = fmaxf(amax, TINY) / QMAX;
        __m256 divisor = _mm256_set1_ps(scale);
        for (i = 0; i + 32 <= k; i += 32) {
            __m256i bytes = bytes32(quantize8_over(_mm256_loadu_ps(v + i), divisor),
                                    quantize8_over(_mm256_loadu_ps(v + i + 8), divisor),
                                    quantize8_over(_mm256_loadu_ps(v + i + 16), divisor),
                                    quantize8_over(_mm256_loadu_ps(v + i + 24), divisor));
            _mm256_storeu_si256((__m256i *)(out + i), _mm256_xor_si256(bytes, _mm256_set1_epi8((char)offset)));
        }
        for (; i < k; i++) out[i] = (uint8_t)((int)fminf(fmaxf(nearbyintf(v[i] / scale), -QMAX), QMAX) + offset);
        x_scale[r] = scale;
    }
}

/* AVX2: each weight's sign moved onto the input, |w| x that in int16 pairs, then int32. */
#define SUFFIX avx2
#define TARGET "avx2,fma,f16c"
#define DOT_ADD(dot, x, w, magnitude) (dot) = _mm256_add_epi32((dot), _mm256_madd_epi16( \
    _mm256_maddubs_epi16((magnitude), _mm256_sign_epi8((x), (w))), _mm256_set1_epi16(1)))
#define OFFSET(colsum) _mm256_setzero_si256()
#include "int8_256.h"

/* 256-bit VNNI in AVX-VNNI's encoding ... */
#define SUFFIX vex
#define TARGET "avx2,fma,f16c,avxvnni"
#define DOT_ADD(dot, x, w, magnitude) ((void)(magnitude), (dot) = _mm256_dpbusd_avx_epi32((dot), (x), (w)))
#define OFFSET(colsum) _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(colsum)), 7)  /* 128 colsum */
#include "int8_256.h"

/* ... and in AVX-512's */
#define SUFFIX evex
#define TARGET "avx2,fma,f16c,avx512f,avx512vl,avx512vnni"
#define DOT_ADD(dot, x, w, magnitude) ((void)(magnitude), (dot) = _mm256_dpbusd_epi32((dot), (x), (w)))
#define OFFSET(colsum) _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(colsum)), 7)
#include "int8_256.h"
#endif

/* AMX: rows as tiles. The packed layout is what tdpbusd takes as its second operand: 16
 * consecutive 64-byte loads of a block (inputs 4j..4j+63, 16 channels) are one 16 x 64
 * tile; 16 rows' 64 inputs are the first (a last tile's missing rows are zero padding,
 * their sums dropped). Each tile of sums (16 rows, 16 channels) accumulates over all of k
 * in int32 (exact, as the VNNI path's), then finish8's epilogue, vectorized. k a multiple
 * of 64. Each block runs all tiles of rows while it is in cache. From AMX_MIN_ROWS rows
 * on, a verification's few rows take AMX too: VNNI spends one instruction per row per 64
 * weight bytes and falls behind the weights' stream (a 9-token forward of the Qwen 1.5B
 * target took 1.33-1.41 one-token steps; with AMX 1.25, its Linear calls 1.09-1.13). */
#define AMX_ROWS 16
#define AMX_MIN_ROWS 2
/* Bytes of weights asked for ahead, as the VNNI path does: the tile loads alone left the
 * stream short (2-16 rows 0.92-0.94x the time with 4 KiB ahead, lockstep A/B over six
 * layers' worth of Qwen shapes; 100 rows 0.86x with 8 KiB, small counts alike). */
#define AMX_PREFETCH (2 * PREFETCH)
#if defined(__x86_64__)
struct tile_config { uint8_t palette, start_row, reserved[14]; uint16_t bytes_per_row[16]; uint8_t rows[16]; };

__attribute__((target("amx-tile,amx-int8,avx512f")))
static void band8_amx(const int8_t *packed, const int32_t *colsum, const float *w_scale, const float *bias,
                      const uint8_t *xu, const float *x_scale, int k, int rows, int nb0, int nb1, float *y, int n) {
    struct tile_config config = {1};
    for (int t = 0; t < 3; t++) { config.bytes_per_row[t] = 64; config.rows[t] = AMX_ROWS; }
    _tile_loadconfig(&config);  /* tile 0: the sums; 1: 16 rows' inputs; 2: 16 channels' weights */
    int32_t sums[AMX_ROWS][LANES];
    for (int nb = nb0; nb < nb1; nb++) {
        const int8_t *block = packed + (int64_t)nb * k * LANES;
        int c = nb * LANES;
        __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512((const void *)(colsum + c)), 7);  /* 128 colsum */
        __m512 scale = _mm512_loadu_ps(w_scale + c);
        for (int r0 = 0; r0 < rows; r0 += AMX_ROWS) {  /* the block stays in cache for the next tile of rows */
            _tile_zero(0);
            for (int i = 0; i < k; i += 64) {
                const int8_t *w = block + (int64_t)i * LANES;  /* 1 KiB: 16 channels x 64 inputs */
                for (int line = 0; line < 1024; line += 64)
                    _mm_prefetch((const char *)w + AMX_PREFETCH + line, _MM_HINT_T0);
                _tile_loadd(1, xu + (int64_t)r0 * k + i, k);  /* a last tile's rows past `rows`: padding */
                _tile_loadd(2, w, 64);
                _tile_dpbusd(0, 1, 2);
            }
            _tile_stored(0, sums, LANES * 4);
            int m = rows - r0 < AMX_ROWS ? rows - r0 : AMX_ROWS;
            for (int r = 0; r < m; r++)
                finish8_16(_mm512_loadu_si512((const void *)sums[r]), offset, scale, x_scale[r0 + r],
                           bias ? bias + c : NULL, y + (int64_t)(r0 + r) * n + c);
        }
    }
    _tile_release();
}
#endif

/* y [rows, n] = x [rows, k] @ (wq * w_scale).T (+ bias), as above; n a multiple of 16 (the
 * caller pads), k of 4. path: kernel_paths.h's (-1: the fastest allowed). Returns 0, or
 * -1 where the quantized inputs' buffer cannot be allocated. */
int rakv_int8_linear(const float *x, int rows, int k, const int8_t *packed, const int32_t *colsum,
                     const float *w_scale, const float *bias, int n, float *y, int num_threads, int path) {
    path = rakv_path(path);
    if (path == PATH_AMX && !(k % 64 == 0 && rows >= AMX_MIN_ROWS)) path = PATH_AVX512;
    int tile = path == PATH_AVX2 || path == PATH_VNNI256 ? TILE8_256 : TILE8;
    /* AMX loads whole tiles of rows: the last one's missing rows are zeros, their sums dropped */
    int padded = path == PATH_AMX ? (rows + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS : rows;
    int8_t *scratch = rakv_scratch((size_t)padded * k + 4 * (size_t)rows);
    if (!scratch) return -1;
    uint8_t *xu = (uint8_t *)scratch;
    float *x_scale = (float *)(scratch + (int64_t)padded * k);
    memset(xu + (int64_t)rows * k, 0, (size_t)(padded - rows) * k);
    int blocks = n / LANES, bands = (blocks + BAND - 1) / BAND;
#if defined(__x86_64__)
    int vex = rakv_vnni256_vex();
    if (path >= PATH_AVX512)
        quantize_rows8_avx512(x, rows, k, xu, x_scale);
    else if (path != PATH_PORTABLE)
        quantize_rows8_avx2(x, rows, k, path == PATH_AVX2 ? 0 : 128, xu, x_scale);
    else
#endif
        quantize_rows8(x, rows, k, xu, x_scale);
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int band = 0; band < bands; band++) {
        int nb1 = (band + 1) * BAND < blocks ? (band + 1) * BAND : blocks;
#if defined(__x86_64__)
        if (path == PATH_AMX) {
            band8_amx(packed, colsum, w_scale, bias, xu, x_scale, k, rows, band * BAND, nb1, y, n);
            continue;
        }
#endif
        for (int r0 = 0; r0 < rows; r0 += tile) {
            int m = rows - r0 < tile ? rows - r0 : tile;
            const uint8_t *xt = xu + (int64_t)r0 * k;
            for (int nb = band * BAND; nb < nb1; nb++) {
                const int8_t *block = packed + (int64_t)nb * k * LANES;
                const int32_t *cs = colsum + nb * LANES;
                const float *ws = w_scale + nb * LANES, *bs = bias ? bias + nb * LANES : NULL;
                float *out = y + (int64_t)r0 * n + nb * LANES;
                switch (path) {
#if defined(__x86_64__)
                case PATH_AVX512: block8_vnni(block, cs, ws, bs, xt, x_scale + r0, k, m, out, n); break;
                case PATH_VNNI256:
                    if (vex) block8_256_vex(block, cs, ws, bs, xt, x_scale + r0, k, m, out, n);
                    else block8_256_evex(block, cs, ws, bs, xt, x_scale + r0, k, m, out, n);
                    break;
                case PATH_AVX2: block8_256_avx2(block, cs, ws, bs, xt, x_scale + r0, k, m, out, n); break;
#endif
                default: block8_portable(block, cs, ws, bs, xt, x_scale + r0, k, m, out, n);
                }
            }
        }
    }
    return 0;
}
