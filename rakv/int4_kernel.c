/* int4 groupwise weights times per-group int8 activations, for rakv/int4.py (and, at the
 * end of this file, int8 per-channel weights for rakv/weights.py, which share its library).
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
 *   The AVX-512 VNNI path and the portable path give the same bits (test_int4.py).
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
 * nibble plane is 16 lanes x 4 consecutive inputs, what vpdpbusd takes. a_step and
 * b_step are [num_blocks, num_groups, 16] bytes (or NULL), a_unit and b_unit
 * [num_blocks, num_groups / PER, 16] f16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define GROUP 32
#define LANES 16
#define TILE 12  /* 2 x 12 accumulators in registers; 12 over 8 rows: a 9-token forward 0.85-0.88x */
#define BAND 8
#define QMAX 127.0f
#define PREFETCH 4096  /* bytes: 16 groups ahead (2048-8192 did alike) */

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
 * half to even. quantize_rows_vector gives the same bits with AVX-512 (16x faster: this
 * loop calls nearbyintf per input). */
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
static void quantize_rows_vector(const float *x, int rows, int k, int8_t *xq, float *dx, float *bx) {
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
#endif

/* 1 where the vector path runs here. */
int rakv_int4_vector(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

/* The calling thread's buffer for quantized inputs, of at least ``needed`` bytes, grown as
 * needed and kept; NULL where it cannot be allocated. */
static int8_t *scratch_of(size_t needed) {
    static __thread int8_t *scratch = NULL;
    static __thread size_t scratch_bytes = 0;
    if (needed == 0) needed = 1;  /* zero rows: a buffer all the same, so NULL always means no memory */
    if (needed > scratch_bytes) {
        free(scratch);
        scratch = malloc(needed);
        scratch_bytes = scratch ? needed : 0;
    }
    return scratch;
}

/* y [rows, n] = x [rows, k] @ w.T (+ bias), w packed as above, n a multiple of 16 (the
 * caller pads), per a power of two. portable: 1 forces the portable path. Returns 0, or
 * -1 where the quantized inputs' buffer (rows * (k + 8 * k / GROUP) bytes, kept per
 * calling thread and grown as needed) cannot be allocated. */
int rakv_int4_linear(const float *x, int rows, int k, const uint8_t *packed, const uint8_t *a_step,
                     const uint8_t *b_step, const uint16_t *a_unit, const uint16_t *b_unit, int per,
                     const float *bias, int n, float *y, int num_threads, int portable) {
    int8_t *scratch = scratch_of((size_t)rows * (k + 8 * (k / GROUP)));
    if (!scratch) return -1;
    int groups = k / GROUP, blocks = n / LANES, bands = (blocks + BAND - 1) / BAND, units = groups / per;
    int shift = __builtin_ctz(per);  /* per is a power of two: a group's unit is g >> shift, no division */
    int8_t *xq = scratch;
    float *dx = (float *)(scratch + (int64_t)rows * k);
    float *bx = dx + rows * groups;
    int vector = !portable && rakv_int4_vector();
#if defined(__x86_64__)
    if (vector)
        quantize_rows_vector(x, rows, k, xq, dx, bx);
    else
#endif
        quantize_rows(x, rows, k, xq, dx, bx);
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int band = 0; band < bands; band++) {
        int nb1 = (band + 1) * BAND < blocks ? (band + 1) * BAND : blocks;
        for (int r0 = 0; r0 < rows; r0 += TILE) {
            int tile = rows - r0 < TILE ? rows - r0 : TILE;
            const int8_t *xt = xq + (int64_t)r0 * k;
            for (int nb = band * BAND; nb < nb1; nb++) {
                const uint8_t *block = packed + (int64_t)nb * groups * 256;
                const uint8_t *as = a_step ? a_step + (int64_t)nb * groups * LANES : NULL;
                const uint8_t *bs = b_step ? b_step + (int64_t)nb * groups * LANES : NULL;
                const uint16_t *au = a_unit + (int64_t)nb * units * LANES, *bu = b_unit + (int64_t)nb * units * LANES;
                float *acc = y + (int64_t)r0 * n + nb * LANES;
#if defined(__x86_64__)
                if (vector)
                    block_vnni(block, as, bs, au, bu, shift, groups, xt, dx + r0 * groups, bx + r0 * groups, k,
                               tile, acc, n);
                else
#endif
                    block_portable(block, as, bs, au, bu, shift, groups, xt, dx + r0 * groups, bx + r0 * groups, k,
                                   tile, acc, n);
            }
        }
    }
    if (bias)
        for (int r = 0; r < rows; r++)
            for (int col = 0; col < n; col++) y[(int64_t)r * n + col] += bias[col];
    return 0;
}


/* ---- int8 per-channel weights (rakv/weights.py's Int8Forward) ----
 *
 * y[r, n] = ((float)sum_k wq[n, k] * xq[r, k] * w_scale[n]) * x_scale[r] (+ bias[n]), the
 * float operations in that order, with x_scale[r] = max(max_k |x[r, k]|, TINY) / 127 and
 * xq = x / x_scale rounded half to even: the bits of the oneDNN path it replaces (test),
 * in one call where that path took a dozen torch ops per layer. Rows never mix (integer
 * sums, then elementwise float operations).
 *
 * Packed layout: output channels in blocks of 16 lanes; for block nb and inputs 4j..4j+3,
 * 64 bytes at packed + (nb * k / 4 + j) * 64, byte 4 lane + i = wq[16 nb + lane, 4 j + i].
 * VNNI multiplies unsigned by signed bytes, so the inputs go in as xq + 128 and
 * 128 * colsum[n] (colsum[n] = sum_k wq[n, k]) comes off: exact integers. k is a multiple
 * of 4. */

#define TINY 1e-30f
#define TILE8 16  /* rows per weight load: one accumulator each, no per-group epilogue */

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
static void quantize_rows8_vector(const float *x, int rows, int k, uint8_t *xu, float *x_scale) {
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
/* 1 where AMX int8 tiles run here: the CPU has them and Linux lets this process use them. */
static int amx_usable(void) {
    static int usable = -1;
    if (usable < 0) {
        unsigned a, b, c, d;
        usable = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 24)) && (d & (1u << 25))
                 && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    }
    return usable;
}

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
 * caller pads), k of 4. Returns 0, or -1 where the quantized inputs' buffer cannot be
 * allocated. */
int rakv_int8_linear(const float *x, int rows, int k, const int8_t *packed, const int32_t *colsum,
                     const float *w_scale, const float *bias, int n, float *y, int num_threads, int portable) {
    int vector = !portable && rakv_int4_vector();
    int amx = 0;
#if defined(__x86_64__)
    amx = vector && k % 64 == 0 && rows >= AMX_MIN_ROWS && amx_usable();
#endif
    /* AMX loads whole tiles of rows: the last one's missing rows are zeros, their sums dropped */
    int padded = amx ? (rows + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS : rows;
    int8_t *scratch = scratch_of((size_t)padded * k + 4 * (size_t)rows);
    if (!scratch) return -1;
    uint8_t *xu = (uint8_t *)scratch;
    float *x_scale = (float *)(scratch + (int64_t)padded * k);
    memset(xu + (int64_t)rows * k, 0, (size_t)(padded - rows) * k);
    int blocks = n / LANES, bands = (blocks + BAND - 1) / BAND;
#if defined(__x86_64__)
    if (vector)
        quantize_rows8_vector(x, rows, k, xu, x_scale);
    else
#endif
        quantize_rows8(x, rows, k, xu, x_scale);
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int band = 0; band < bands; band++) {
        int nb1 = (band + 1) * BAND < blocks ? (band + 1) * BAND : blocks;
#if defined(__x86_64__)
        if (amx) {
            band8_amx(packed, colsum, w_scale, bias, xu, x_scale, k, rows, band * BAND, nb1, y, n);
            continue;
        }
#endif
        for (int r0 = 0; r0 < rows; r0 += TILE8) {
            int tile = rows - r0 < TILE8 ? rows - r0 : TILE8;
            for (int nb = band * BAND; nb < nb1; nb++) {
                const int8_t *block = packed + (int64_t)nb * k * LANES;
                const int32_t *cs = colsum + nb * LANES;
                const float *ws = w_scale + nb * LANES, *bs = bias ? bias + nb * LANES : NULL;
                float *out = y + (int64_t)r0 * n + nb * LANES;
#if defined(__x86_64__)
                if (vector)
                    block8_vnni(block, cs, ws, bs, xu + (int64_t)r0 * k, x_scale + r0, k, tile, out, n);
                else
#endif
                    block8_portable(block, cs, ws, bs, xu + (int64_t)r0 * k, x_scale + r0, k, tile, out, n);
            }
        }
    }
    return 0;
}
