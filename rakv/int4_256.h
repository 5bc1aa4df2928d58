/* int4_kernel.c's block on a 256-bit path: lanes 0-7 of each 64-byte load as one half,
 * 8-15 as the other, half by half, up to TILE256 rows. Included once per path, with
 *   SUFFIX    the functions' name suffix,
 *   TARGET    their target options,
 *   DOT_ADD   (dot, weights, inputs): the u8 x s8 products of 4 consecutive bytes added
 *             into dot, per 32-bit lane,
 *   DOT_SUMS  (dot): dot as int32 lane sums at the group's end.
 * The float steps are block_portable's, in its order. */
#define JOIN2(a, b) a##_##b
#define JOIN(a, b) JOIN2(a, b)

__attribute__((target(TARGET), always_inline))
static inline void JOIN(block256_rows, SUFFIX)(const uint8_t *packed, const uint8_t *a_step, const uint8_t *b_step,
                                               const uint16_t *a_unit, const uint16_t *b_unit, int shift, int groups,
                                               const int8_t *xq, const float *dx, const float *bx, int k,
                                               const int rows, float *acc, int n) {
    /* A half's 8 nibble planes stay in registers while each row takes its dot product of
     * them in turn: with the rows' sums in registers instead (their loop inside), the
     * compiler's reordering of the integer sums spilled most of them. The float sums live
     * in acc (L1), a load and a store per row and half a group. */
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

/* One copy per tile height, so each keeps its accumulators in registers. */
__attribute__((target(TARGET)))
static void JOIN(block256, SUFFIX)(const uint8_t *packed, const uint8_t *a_step, const uint8_t *b_step,
                                   const uint16_t *a_unit, const uint16_t *b_unit, int shift, int groups,
                                   const int8_t *xq, const float *dx, const float *bx, int k,
                                   int rows, float *acc, int n) {
    switch (rows) {
#define ROWS(R) case R: JOIN(block256_rows, SUFFIX)(packed, a_step, b_step, a_unit, b_unit, shift, groups, xq, dx, \
                                                    bx, k, R, acc, n); break;
        ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8) ROWS(9)
#undef ROWS
    }
}

#undef JOIN
#undef JOIN2
#undef SUFFIX
#undef TARGET
#undef DOT_ADD
#undef DOT_SUMS
