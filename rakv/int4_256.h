/* int4_kernel.c's block on a 256-bit path: lanes 0-7 of each 64-byte load as one half,
 * 8-15 as the other; up to BOTH_ROWS rows both halves at once, up to TILE256 rows half by
 * half. Included once per path, with
 *   SUFFIX    the functions' name suffix,
 *   TARGET    their target options,
 *   DOT_ADD   (dot, weights, inputs): the u8 x s8 products of 4 consecutive bytes added
 *             into dot, per 32-bit lane,
 *   DOT_SUMS  (dot): dot as int32 lane sums at the group's end,
 *   SPLIT_ROWS where defined: 5-9 rows as 2 or 3 passes of both halves at once (below),
 *             not a half at a time.
 * The float steps are block_portable's, in its order. */
#define JOIN2(a, b) a##_##b
#define JOIN(a, b) JOIN2(a, b)

/* Both halves at once, up to BOTH_ROWS rows (their 2 x 2 sums in registers): each
 * 64-byte line used whole as it streams in, the fastest for a step and a few rows. */
__attribute__((target(TARGET), always_inline))
static inline void JOIN(block256_both, SUFFIX)(const uint8_t *packed, const uint8_t *a_step, const uint8_t *b_step,
                                               const uint16_t *a_unit, const uint16_t *b_unit, int shift, int groups,
                                               const int8_t *xq, const float *dx, const float *bx, int k,
                                               const int rows, float *acc, int n) {
    __m256 facc[BOTH_ROWS][2];
    const __m256i low = _mm256_set1_epi8(15);
    for (int r = 0; r < rows; r++) facc[r][0] = facc[r][1] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const uint8_t *block = packed + (int64_t)g * 256;
        for (int line = 0; line < 256; line += 64) _mm_prefetch((const char *)block + PREFETCH + line, _MM_HINT_T0);
        __m256i dot[BOTH_ROWS][2];
        for (int r = 0; r < rows; r++) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            __m256i w_low[2], w_high[2];
            for (int h = 0; h < 2; h++) {
                __m256i bytes = _mm256_loadu_si256((const __m256i *)(block + i * 64 + h * 32));
                w_low[h] = _mm256_and_si256(bytes, low);
                w_high[h] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
            }
            for (int r = 0; r < rows; r++) {
                const int8_t *xg = xq + (int64_t)r * k + g * GROUP;
                int32_t x_low, x_high;
                memcpy(&x_low, xg + 4 * i, 4);
                memcpy(&x_high, xg + 16 + 4 * i, 4);
                __m256i inputs_low = _mm256_set1_epi32(x_low), inputs_high = _mm256_set1_epi32(x_high);
                for (int h = 0; h < 2; h++) {
                    DOT_ADD(dot[r][h], w_low[h], inputs_low);
                    DOT_ADD(dot[r][h], w_high[h], inputs_high);
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            __m256 va = scales8(a_step, a_unit, g, shift, h), vb = scales8(b_step, b_unit, g, shift, h);
            for (int r = 0; r < rows; r++) {
                __m256 d = _mm256_set1_ps(dx[r * groups + g]);
                facc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DOT_SUMS(dot[r][h])), _mm256_mul_ps(va, d), facc[r][h]);
                facc[r][h] = _mm256_fmadd_ps(vb, _mm256_set1_ps(bx[r * groups + g]), facc[r][h]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(acc + (int64_t)r * n, facc[r][0]);
        _mm256_storeu_ps(acc + (int64_t)r * n + 8, facc[r][1]);
    }
}
__attribute__((target(TARGET), always_inline))
static inline void JOIN(block256_rows, SUFFIX)(const uint8_t *packed, const uint8_t *a_step, const uint8_t *b_step,
                                               const uint16_t *a_unit, const uint16_t *b_unit, int shift, int groups,
                                               const int8_t *xq, const float *dx, const float *bx, int k,
                                               const int rows, float *acc, int n) {
    /* More rows: a half's 8 nibble planes stay in registers while each row takes its dot
     * product of them in turn (with more rows' sums in registers, the compiler's reordering
     * of the integer adds spilled most of them). The float sums live in acc (L1), a load
     * and a store per row and half a group: against the above, 0.95-1.09x the time at 1
     * row, 0.83-0.95x at 9 (twelve Qwen MLP layers on AVX2, two builds in lockstep, twice). */
    const __m256i low = _mm256_set1_epi8(15);
    for (int r = 0; r < rows; r++)
        for (int lane = 0; lane < LANES; lane++) acc[(int64_t)r * n + lane] = 0.0f;
    for (int g = 0; g < groups; g++) {
        const uint8_t *block = packed + (int64_t)g * 256;
        for (int line = 0; line < 256; line += 64) _mm_prefetch((const char *)block + PREFETCH + line, _MM_HINT_T0);
        for (int h = 0; h < 2; h++) {  /* the group's 256 bytes stay in L1 for the second half */
            __m256i planes[8];  /* 2i: inputs 4i..4i+3 of lanes 8h..8h+7; 2i + 1: inputs 16+4i..16+4i+3 */
            for (int i = 0; i < 4; i++) {
                __m256i bytes = _mm256_loadu_si256((const __m256i *)(block + i * 64 + h * 32));
                planes[2 * i] = _mm256_and_si256(bytes, low);
                planes[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
            }
            __m256 va = scales8(a_step, a_unit, g, shift, h), vb = scales8(b_step, b_unit, g, shift, h);
            for (int r = 0; r < rows; r++) {
                const int8_t *xg = xq + (int64_t)r * k + g * GROUP;
                __m256i dot = _mm256_setzero_si256();
                for (int i = 0; i < 4; i++) {
                    int32_t x_low, x_high;
                    memcpy(&x_low, xg + 4 * i, 4);
                    memcpy(&x_high, xg + 16 + 4 * i, 4);
                    DOT_ADD(dot, planes[2 * i], _mm256_set1_epi32(x_low));
                    DOT_ADD(dot, planes[2 * i + 1], _mm256_set1_epi32(x_high));
                }
                float *out = acc + (int64_t)r * n + 8 * h;
                __m256 d = _mm256_set1_ps(dx[r * groups + g]);
                __m256 sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DOT_SUMS(dot)), _mm256_mul_ps(va, d),
                                             _mm256_loadu_ps(out));
                _mm256_storeu_ps(out, _mm256_fmadd_ps(vb, _mm256_set1_ps(bx[r * groups + g]), sum));
            }
        }
    }
}

/* One copy per tile height, so each keeps its accumulators in registers. Up to BOTH_ROWS
 * rows run as one pass of both halves at once. More: the 256-bit VNNI paths take them a
 * half at a time; AVX2 (SPLIT_ROWS) in passes of at most BOTH_ROWS, each over the block's
 * weights (in L1 and L2 after the first), each as fast a row as a pass of 4 (5 rows: 4 +
 * 1 takes as long as 3 + 2). Against a half at a time there: 0.85x at 5 rows, 0.76x at 6,
 * 0.85x at 9 (rakv_int4_linear over Qwen's 1536 x 8960 and 8960 x 1536 Q4_K, streamed). */
__attribute__((target(TARGET)))
static void JOIN(block256, SUFFIX)(const uint8_t *packed, const uint8_t *a_step, const uint8_t *b_step,
                                   const uint16_t *a_unit, const uint16_t *b_unit, int shift, int groups,
                                   const int8_t *xq, const float *dx, const float *bx, int k,
                                   int rows, float *acc, int n) {
#ifndef SPLIT_ROWS
    if (rows > BOTH_ROWS) {
        switch (rows) {
#define PLANES(R) case R: JOIN(block256_rows, SUFFIX)(packed, a_step, b_step, a_unit, b_unit, shift, groups, xq, dx, \
                                                      bx, k, R, acc, n); break;
            PLANES(5) PLANES(6) PLANES(7) PLANES(8) PLANES(9)
#undef PLANES
        }
        return;
    }
#endif
    static const signed char passes[TILE256 + 1][3] = {{0}, {1}, {2}, {3}, {4}, {3, 2}, {3, 3}, {4, 3}, {4, 4},
                                                       {3, 3, 3}};
    for (int p = 0, r0 = 0; p < 3 && passes[rows][p]; r0 += passes[rows][p++]) {
        const int8_t *xp = xq + (int64_t)r0 * k;
        const float *dp = dx + r0 * groups, *bp = bx + r0 * groups;
        float *ap = acc + (int64_t)r0 * n;
        switch (passes[rows][p]) {
#define PASS(R) case R: JOIN(block256_both, SUFFIX)(packed, a_step, b_step, a_unit, b_unit, shift, groups, xp, dp, \
                                                    bp, k, R, ap, n); break;
            PASS(1) PASS(2) PASS(3) PASS(4)
#undef PASS
        }
    }
}

#undef JOIN
#undef JOIN2
#undef SUFFIX
#undef TARGET
#undef DOT_ADD
#undef DOT_SUMS
#undef SPLIT_ROWS
