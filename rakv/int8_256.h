/* int8_kernel.c's block on a 256-bit path: lanes 0-7 of each 64-byte load as one half,
 * 8-15 as the other, up to TILE8_256 rows. Included once per path, with
 *   SUFFIX    the functions' name suffix,
 *   TARGET    their target options,
 *   DOT_ADD   (dot, inputs, weights, magnitudes): 4 inputs' products with each lane's 4
 *             weights added into dot's int32 lanes (magnitudes: |weights|),
 *   OFFSET    (colsum): what comes off each lane's sum (8 int32).
 * Then finish8's float steps, in its order. */
#define JOIN2(a, b) a##_##b
#define JOIN(a, b) JOIN2(a, b)

__attribute__((target(TARGET), always_inline))
static inline void JOIN(block8_256_rows, SUFFIX)(const int8_t *packed, const int32_t *colsum, const float *w_scale,
                                                 const float *bias, const uint8_t *xu, const float *x_scale, int k,
                                                 const int rows, float *y, int n) {
    __m256i dot[TILE8_256][2];
    for (int r = 0; r < rows; r++) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int j = 0; j < k / 4; j++) {
        const int8_t *w = packed + (int64_t)j * 64;
        _mm_prefetch((const char *)w + PREFETCH, _MM_HINT_T0);
        __m256i weights[2], magnitudes[2];
        for (int h = 0; h < 2; h++) {
            weights[h] = _mm256_loadu_si256((const __m256i *)(w + 32 * h));
            magnitudes[h] = _mm256_abs_epi8(weights[h]);  /* unused where DOT_ADD takes xu as it is */
        }
        for (int r = 0; r < rows; r++) {
            int32_t four;
            memcpy(&four, xu + (int64_t)r * k + 4 * j, 4);
            __m256i inputs = _mm256_set1_epi32(four);  /* vpbroadcastd from memory */
            for (int h = 0; h < 2; h++) DOT_ADD(dot[r][h], inputs, weights[h], magnitudes[h]);
        }
    }
    for (int h = 0; h < 2; h++) {
        __m256i offset = OFFSET(colsum + 8 * h);
        __m256 scale = _mm256_loadu_ps(w_scale + 8 * h);
        for (int r = 0; r < rows; r++)
            finish8_8(dot[r][h], offset, scale, x_scale[r], bias ? bias + 8 * h : NULL, y + (int64_t)r * n + 8 * h);
    }
}

/* One copy per tile height, so each keeps its accumulators in registers. */
__attribute__((target(TARGET)))
static void JOIN(block8_256, SUFFIX)(const int8_t *packed, const int32_t *colsum, const float *w_scale,
                                     const float *bias, const uint8_t *xu, const float *x_scale, int k, int rows,
                                     float *y, int n) {
    switch (rows) {
#define ROWS_256(R) \
    case R: JOIN(block8_256_rows, SUFFIX)(packed, colsum, w_scale, bias, xu, x_scale, k, R, y, n); break;
        ROWS_256(1) ROWS_256(2) ROWS_256(3) ROWS_256(4) ROWS_256(5) ROWS_256(6)
#undef ROWS_256
    }
}

#undef JOIN
#undef JOIN2
#undef SUFFIX
#undef TARGET
#undef DOT_ADD
#undef OFFSET
