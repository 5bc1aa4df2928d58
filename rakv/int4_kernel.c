/* int4 groupwise weights times per-group int8 activations, for rakv/int4.py.
 *
 * y[r, n] = sum over groups g of  a[n, g] * dx[r, g] * sum_k q[n, k] * xq[r, k]
 *                               + b[n, g] * (dx[r, g] * sum_k xq[r, k])      (+ bias[n])
 * with w[n, k] = a[n, g] * q[n, k] + b[n, g], q in 0..15, and x[r, k] ~ dx[r, g] * xq[r, k],
 * xq in -127..127, one scale per row and group of GROUP inputs (llama.cpp's Q8_0
 * activations). A group's scale and offset are a step count times a unit shared by
 * PER consecutive groups: a[n, g] = a_unit[n, g / PER] * a_step[n, g], b likewise, with
 * 8-bit steps and f16 units. That is how GGUF's Q4_K stores them (PER = 8: 6-bit scale
 * and min steps per group of 32, f16 units per super-block of 256), in 18.5 bytes per 32
 * weights; Q4_0 and Q4_1 have PER = 1 and no steps (the pointers are NULL: steps of 1),
 * their f16 scale and offset as the units: 20 bytes per 32 weights, as in the file.
 *
 * Invariants:
 * - A row's result never depends on the other rows: its integer sums are exact, and its
 *   float operations (one multiply for each scale, one fused multiply-add for each term,
 *   groups in order) are the same whichever rows come with it and whichever path runs.
 *   Every path (portable, AVX2, 256-bit VNNI, AVX-512 VNNI: kernel_paths.h) gives the
 *   same bits (test_int4.py). AVX2 has no u8 x s8 dot into int32: vpmaddubsw's int16
 *   pair sums are at most 2 x 15 x 127 = 3,810 here (4-bit weights), so eight of them, a
 *   group's 32 inputs, add in int16 exactly (30,480 < 32,767) before vpmaddwd widens them.
 * - Each weight block is read from memory once per forward: a forward over T tokens
 *   streams the weights once, which is what keeps verification cheap. Rows go in tiles of
 *   up to TILE (their accumulators stay in registers) and output blocks in bands of BAND
 *   (a band's weights stay in L2 while further row tiles reuse them). Splitting the
 *   inputs into chunks that keep a tile's activations in L1 was 5-7 % slower: it breaks
 *   the weights' sequential stream.
 *
 * Packed layout (rakv/int4.py packs it): output channels in blocks of 16 lanes; for
 * block nb and group g, 256 bytes at packed + (nb * num_groups + g) * 256 hold 4 loads
 * of 64 bytes; byte j of load i holds q[16 nb + j / 4, 32 g + 4 i + j % 4] in its low
 * nibble and q[16 nb + j / 4, 32 g + 16 + 4 i + j % 4] in its high nibble, so each
 * nibble plane is 16 lanes x 4 consecutive inputs, what vpdpbusd takes (the 256-bit
 * paths take lanes 0-7 from a load's first 32 bytes, 8-15 from its last). a_step and
 * b_step are [num_blocks, num_groups, 16] bytes (or NULL), a_unit and b_unit
 * [num_blocks, num_groups / PER, 16] f16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include "kernel_paths.h"

#define GROUP 32
#define TILE 12  /* 2 x 12 accumulators in registers; 12 over 8 rows: a 9-token forward 0.85-0.88x */
#define TILE256 9  /* the 256-bit paths: 9 rows (a half at a time, or AVX2's passes), a verification of 8 ... */
#define BOTH_ROWS 4  /* ... or up to 4 rows, both halves at once */

/* An f16 value as a float: exact (every f16 value is a float). */
static float from_f16(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 31, mantissa = h & 1023, bits;
    if (exponent == 31) {
        bits = sign | 0x7f800000 | (mantissa << 13);  /* inf, nan */
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (!mantissa) {
        bits = sign;
    } else {  /* subnormal: mantissa * 2^-24, normalized */
        exponent = 113;
        while (!(mantissa & 1024)) { mantissa <<= 1; exponent--; }
        bits = sign | (exponent << 23) | ((mantissa & 1023) << 13);
    }
    float value;
    memcpy(&value, &bits, 4);
    return value;
}

/* x [rows, k] -> xq [rows, k], dx and bx = dx * sum(xq) [rows, groups]: symmetric, round
 * half to even. quantize_rows_avx512 and _avx2 give the same bits (16x faster: this loop
 * calls nearbyintf per input). */
static void quantize_rows(const float *x, int rows, int k, int8_t *xq, float *dx, float *bx) {
    int groups = k / GROUP;
    for (int r = 0; r < rows; r++) {
        for (int g = 0; g < groups; g++) {
            const float *v = x + (int64_t)r * k + g * GROUP;
            float amax = 0.0f;
            for (int i = 0; i < GROUP; i++) amax = fmaxf(amax, fabsf(v[i]));
            float scale = amax / QMAX;
            float inverse = amax > 0.0f ? QMAX / amax : 0.0f;
            int32_t sum = 0;
            int8_t *out = xq + (int64_t)r * k + g * GROUP;
            for (int i = 0; i < GROUP; i++) {
                float scaled = nearbyintf(v[i] * inverse);
                scaled = fminf(fmaxf(scaled, -QMAX), QMAX);
                out[i] = (int8_t)scaled;
                sum += out[i];
            }
            dx[r * groups + g] = scale;
            bx[r * groups + g] = (float)sum * scale;
        }
    }
}

/* One output block and up to TILE rows, into acc [rows][LANES] (row r's at acc + r * n):
 * the portable path, the same float operations in the same order as the vector one.
 * xq, dx, bx start at the tile's first row. */
static void block_portable(const uint8_t *packed, const uint8_t *a_step, const uint8_t *b_step,
                           const uint16_t *a_unit, const uint16_t *b_unit, int shift, int groups,
                           const int8_t *xq, const float *dx, const float *bx, int k,
                           int rows, float *acc, int n) {
    for (int r = 0; r < rows; r++)
        for (int lane = 0; lane < LANES; lane++) acc[(int64_t)r * n + lane] = 0.0f;
    for (int g = 0; g < groups; g++) {
        const uint8_t *block = packed + (int64_t)g * 256;
        for (int r = 0; r < rows; r++) {
            const int8_t *xg = xq + (int64_t)r * k + g * GROUP;
            float d = dx[r * groups + g], s = bx[r * groups + g];
            for (int lane = 0; lane < LANES; lane++) {
                int32_t dot = 0;
                for (int i = 0; i < 4; i++)
                    for (int j = 0; j < 4; j++) {
                        uint8_t byte = block[i * 64 + lane * 4 + j];
                        dot += (int32_t)(byte & 15) * xg[4 * i + j] + (int32_t)(byte >> 4) * xg[16 + 4 * i + j];
                    }
                float a = from_f16(a_unit[(g >> shift) * LANES + lane]) * (a_step ? (float)a_step[g * LANES + lane] : 1.0f);
                float b = from_f16(b_unit[(g >> shift) * LANES + lane]) * (b_step ? (float)b_step[g * LANES + lane] : 1.0f);
                float *out = acc + (int64_t)r * n + lane;
                *out = fmaf((float)dot, a * d, *out);
                *out = fmaf(b, s, *out);
            }
        }
    }
}

#if defined(__x86_64__)
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,fma"), always_inline)) static inline

/* 16 lanes of group g: unit * step (a step of 1 where there are none), as the portable path. */
VNNI __m512 scales(const uint8_t *step, const uint16_t *unit, int g, int shift) {
    __m512 units = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(unit + (g >> shift) * LANES)));
    __m512 steps = step ? _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(step + g * LANES))))
                        : _mm512_set1_ps(1.0f);
    return _mm512_mul_ps(units, steps);
}

/* 16 inputs times inverse, rounded half to even and clamped to -QMAX..QMAX, as int32. */
__attribute__((target("avx512f"), always_inline)) static inline __m512i quantize16(__m512 v, __m512 inverse) {
    __m512 rounded = _mm512_roundscale_ps(_mm512_mul_ps(v, inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(rounded, _mm512_set1_ps(-QMAX)), _mm512_set1_ps(QMAX)));
}

/* quantize_rows with the same bits: the same max, the same multiply, round half to even. */
__attribute__((target("avx512f,avx512bw")))
static void quantize_rows_avx512(const float *x, int rows, int k, int8_t *xq, float *dx, float *bx) {
    int groups = k / GROUP;
    for (int r = 0; r < rows; r++) {
        for (int g = 0; g < groups; g++) {
            const float *v = x + (int64_t)r * k + g * GROUP;
            __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            float scale = amax / QMAX;
            __m512 inverse = _mm512_set1_ps(amax > 0.0f ? QMAX / amax : 0.0f);
            __m512i q0 = quantize16(v0, inverse), q1 = quantize16(v1, inverse);
            int8_t *out = xq + (int64_t)r * k + g * GROUP;
            _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(out + 16), _mm512_cvtepi32_epi8(q1));
            dx[r * groups + g] = scale;
            bx[r * groups + g] = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)) * scale;
        }
    }
}

VNNI void block_vnni_rows(const uint8_t *packed, const uint8_t *a_step, const uint8_t *b_step,
                          const uint16_t *a_unit, const uint16_t *b_unit, int shift, int groups,
                          const int8_t *xq, const float *dx, const float *bx, int k,
                          const int rows, float *acc, int n) {
    __m512 facc[TILE];
    const __m512i low = _mm512_set1_epi8(15);
    for (int r = 0; r < rows; r++) facc[r] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const uint8_t *block = packed + (int64_t)g * 256;
        /* one core keeps too few loads in flight to stream memory at its bandwidth: asking
         * for the weights PREFETCH bytes ahead took 1536x8960 at 1 row from 8.1 to 11.8 GB/s
         * and at 8 rows from 6.2 to 9.2 (past the buffer's end too: a prefetch never faults) */
        for (int line = 0; line < 256; line += 64) _mm_prefetch((const char *)block + PREFETCH + line, _MM_HINT_T0);
        __m512i dot[TILE];
        for (int r = 0; r < rows; r++) dot[r] = _mm512_setzero_si512();
        for (int i = 0; i < 4; i++) {
            __m512i bytes = _mm512_loadu_si512((const void *)(block + i * 64));
            __m512i w_low = _mm512_and_si512(bytes, low);                        /* inputs 4i..4i+3 */
            __m512i w_high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);  /* 16+4i..16+4i+3 */
            for (int r = 0; r < rows; r++) {
                const int8_t *xg = xq + (int64_t)r * k + g * GROUP;
                int32_t x_low, x_high;
                memcpy(&x_low, xg + 4 * i, 4);
                memcpy(&x_high, xg + 16 + 4 * i, 4);
                dot[r] = _mm512_dpbusd_epi32(dot[r], w_low, _mm512_set1_epi32(x_low));
                dot[r] = _mm512_dpbusd_epi32(dot[r], w_high, _mm512_set1_epi32(x_high));
            }
        }
        __m512 va = scales(a_step, a_unit, g, shift);
        __m512 vb = scales(b_step, b_unit, g, shift);
        for (int r = 0; r < rows; r++) {
            __m512 d = _mm512_set1_ps(dx[r * groups + g]);
            facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(va, d), facc[r]);
            facc[r] = _mm512_fmadd_ps(vb, _mm512_set1_ps(bx[r * groups + g]), facc[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(acc + (int64_t)r * n, facc[r]);
}

/* One copy per tile height, so each keeps its accumulators in registers. */
__attribute__((target("avx512f,avx512bw,avx512vnni,fma")))
static void block_vnni(const uint8_t *packed, const uint8_t *a_step, const uint8_t *b_step,
                       const uint16_t *a_unit, const uint16_t *b_unit, int shift, int groups,
                       const int8_t *xq, const float *dx, const float *bx, int k,
                       int rows, float *acc, int n) {
    switch (rows) {
#define ROWS(R) case R: block_vnni_rows(packed, a_step, b_step, a_unit, b_unit, shift, groups, xq, dx, bx, \
                                        k, R, acc, n); break;
        ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8) ROWS(9) ROWS(10) ROWS(11) ROWS(12)
#undef ROWS
    }
}
/* ---- the 256-bit paths (AVX2, VNNI256) ---- */
/* 8 lanes (half h: lanes 8h..8h+7) of group g's unit * step, as scales(). */
AVX2 __m256 scales8(const uint8_t *step, const uint16_t *unit, int g, int shift, int h) {
    __m256 units = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(unit + (g >> shift) * LANES + 8 * h)));
    __m256 steps = step ? _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                              _mm_loadl_epi64((const __m128i *)(step + g * LANES + 8 * h))))
                        : _mm256_set1_ps(1.0f);
    return _mm256_mul_ps(units, steps);
}

/* 8 inputs times inverse, rounded half to even and clamped to -QMAX..QMAX, as int32. */
AVX2 __m256i quantize8(__m256 v, __m256 inverse) {
    __m256 rounded = _mm256_round_ps(_mm256_mul_ps(v, inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(rounded, _mm256_set1_ps(-QMAX)), _mm256_set1_ps(QMAX)));
}

/* quantize_rows with the same bits, 8 inputs at a time. */
__attribute__((target("avx2,fma,f16c")))
static void quantize_rows_avx2(const float *x, int rows, int k, int8_t *xq, float *dx, float *bx) {
    int groups = k / GROUP;
    for (int r = 0; r < rows; r++) {
        for (int g = 0; g < groups; g++) {
            const float *v = x + (int64_t)r * k + g * GROUP;
            __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16),
                   v3 = _mm256_loadu_ps(v + 24);
            float amax = max8(_mm256_max_ps(_mm256_max_ps(abs8(v0), abs8(v1)), _mm256_max_ps(abs8(v2), abs8(v3))));
            float scale = amax / QMAX;
            __m256 inverse = _mm256_set1_ps(amax > 0.0f ? QMAX / amax : 0.0f);
            __m256i q0 = quantize8(v0, inverse), q1 = quantize8(v1, inverse), q2 = quantize8(v2, inverse),
                    q3 = quantize8(v3, inverse);
            _mm256_storeu_si256((__m256i *)(xq + (int64_t)r * k + g * GROUP), bytes32(q0, q1, q2, q3));
            dx[r * groups + g] = scale;
            bx[r * groups + g] = (float)sum8(_mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3)))
                                 * scale;
        }
    }
}

/* AVX2: vpmaddubsw's int16 pair sums, 8 of them a group (exact: the file's comment), then
 * vpmaddwd into int32. The empty asm keeps each sum in its register as it grows: GCC
 * otherwise reassociates the adds into a tree over every product of the group and spills
 * the products (3 of every 4 vector moves in block256_both were to the stack; 0.85-0.9x
 * the time at 4 rows without them). */
#define SUFFIX avx2
#define TARGET "avx2,fma,f16c"
#define DOT_ADD(dot, w, x) do { \
    (dot) = _mm256_add_epi16((dot), _mm256_maddubs_epi16((w), (x))); \
    __asm__("" : "+x"(dot)); \
} while (0)
#define DOT_SUMS(dot) _mm256_madd_epi16((dot), _mm256_set1_epi16(1))
#define SPLIT_ROWS
#include "int4_256.h"

/* 256-bit VNNI: vpdpbusd into int32, in AVX-VNNI's encoding (no AVX-512 needed) ... */
#define SUFFIX vex
#define TARGET "avx2,fma,f16c,avxvnni"
#define DOT_ADD(dot, w, x) (dot) = _mm256_dpbusd_avx_epi32((dot), (w), (x))
#define DOT_SUMS(dot) (dot)
#include "int4_256.h"

/* ... and in AVX-512's, for a CPU that has AVX-512 VNNI and not AVX-VNNI (AMD Zen 4) */
#define SUFFIX evex
#define TARGET "avx2,fma,f16c,avx512f,avx512vl,avx512vnni"
#define DOT_ADD(dot, w, x) (dot) = _mm256_dpbusd_epi32((dot), (w), (x))
#define DOT_SUMS(dot) (dot)
#include "int4_256.h"
#endif

/* y [rows, n] = x [rows, k] @ w.T (+ bias), w packed as above, n a multiple of 16 (the
 * caller pads), per a power of two. path: kernel_paths.h's (-1: the fastest allowed).
 * Returns 0, or -1 where the quantized inputs' buffer (rows * (k + 8 * k / GROUP) bytes,
 * kept per calling thread and grown as needed) cannot be allocated. */
int rakv_int4_linear(const float *x, int rows, int k, const uint8_t *packed, const uint8_t *a_step,
                     const uint8_t *b_step, const uint16_t *a_unit, const uint16_t *b_unit, int per,
                     const float *bias, int n, float *y, int num_threads, int path) {
    int8_t *scratch = rakv_scratch((size_t)rows * (k + 8 * (k / GROUP)));
    if (!scratch) return -1;
    int groups = k / GROUP, blocks = n / LANES, bands = (blocks + BAND - 1) / BAND, units = groups / per;
    int shift = __builtin_ctz(per);  /* per is a power of two: a group's unit is g >> shift, no division */
    int8_t *xq = scratch;
    float *dx = (float *)(scratch + (int64_t)rows * k);
    float *bx = dx + rows * groups;
    path = rakv_path(path);
    if (path == PATH_AMX) path = PATH_AVX512;  /* AMX has no 4-bit tiles */
    int tile = path == PATH_AVX2 || path == PATH_VNNI256 ? TILE256 : TILE;
#if defined(__x86_64__)
    int vex = rakv_vnni256_vex();
    if (path == PATH_AVX512)
        quantize_rows_avx512(x, rows, k, xq, dx, bx);
    else if (path != PATH_PORTABLE)
        quantize_rows_avx2(x, rows, k, xq, dx, bx);
    else
#endif
        quantize_rows(x, rows, k, xq, dx, bx);
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int band = 0; band < bands; band++) {
        int nb1 = (band + 1) * BAND < blocks ? (band + 1) * BAND : blocks;
        for (int r0 = 0; r0 < rows; r0 += tile) {
            int m = rows - r0 < tile ? rows - r0 : tile;
            const int8_t *xt = xq + (int64_t)r0 * k;
            const float *dt = dx + r0 * groups, *bt = bx + r0 * groups;
            for (int nb = band * BAND; nb < nb1; nb++) {
                const uint8_t *block = packed + (int64_t)nb * groups * 256;
                const uint8_t *as = a_step ? a_step + (int64_t)nb * groups * LANES : NULL;
                const uint8_t *bs = b_step ? b_step + (int64_t)nb * groups * LANES : NULL;
                const uint16_t *au = a_unit + (int64_t)nb * units * LANES, *bu = b_unit + (int64_t)nb * units * LANES;
                float *acc = y + (int64_t)r0 * n + nb * LANES;
                switch (path) {
#if defined(__x86_64__)
                case PATH_AVX512: block_vnni(block, as, bs, au, bu, shift, groups, xt, dt, bt, k, m, acc, n); break;
                case PATH_VNNI256:
                    if (vex) block256_vex(block, as, bs, au, bu, shift, groups, xt, dt, bt, k, m, acc, n);
                    else block256_evex(block, as, bs, au, bu, shift, groups, xt, dt, bt, k, m, acc, n);
                    break;
                case PATH_AVX2: block256_avx2(block, as, bs, au, bu, shift, groups, xt, dt, bt, k, m, acc, n); break;
#endif
                default: block_portable(block, as, bs, au, bu, shift, groups, xt, dt, bt, k, m, acc, n);
                }
            }
        }
    }
    if (bias)
        for (int r = 0; r < rows; r++)
            for (int col = 0; col < n; col++) y[(int64_t)r * n + col] += bias[col];
    return 0;
}
