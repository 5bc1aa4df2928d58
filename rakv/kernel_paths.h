/* Which vector path the library's kernels run, and each thread's scratch buffer
 * (kernel_paths.c). Every kernel has a portable path and vector paths that give its bits
 * (each kernel's comment says why); a caller names a path, or -1 for the fastest one
 * allowed here. */
#ifndef RAKV_KERNEL_PATHS_H
#define RAKV_KERNEL_PATHS_H
#include <stddef.h>
#include <stdint.h>

/* Slowest to fastest; a CPU that runs one runs every one before it. */
enum {
    PATH_PORTABLE = 0,  /* plain C */
    PATH_AVX2 = 1,      /* AVX2, FMA, F16C: AMD Zen 1-3, Intel Haswell on */
    PATH_VNNI256 = 2,   /* 256-bit VNNI: AVX-VNNI (Intel Alder Lake on), or AVX-512 VNNI's 256-bit form */
    PATH_AVX512 = 3,    /* AVX-512 F, BW, DQ, VL and VNNI: Intel Cascade Lake on, AMD Zen 4 on */
    PATH_AMX = 4,       /* AMX int8 tiles for int8's many-row forwards (Intel Sapphire Rapids on) */
};

int rakv_cpu_path(void);          /* the fastest path this CPU (and OS) runs */
void rakv_cap_path(int cap);      /* -1 (the fastest) unless set: what rakv_path(-1) may use */
int rakv_path(int requested);     /* requested, or the cap for -1, never past rakv_cpu_path() */
int rakv_vnni256_vex(void);       /* 1 where PATH_VNNI256 runs AVX-VNNI's encoding, 0: AVX-512's */

/* The calling thread's buffer of at least `needed` bytes, grown as needed and kept; NULL
 * where it cannot be allocated. The Linear kernels quantize their inputs into it. */
int8_t *rakv_scratch(size_t needed);

/* What both Linear kernels (int4_kernel.c, int8_kernel.c) share. */
#define LANES 16       /* output channels per packed block */
#define BAND 8         /* output blocks per band: a band's weights stay in L2 for further row tiles */
#define QMAX 127.0f    /* activations in -127..127 */
#define PREFETCH 4096  /* bytes of weights asked for ahead: 16 int4 groups (2048-8192 did alike) */

#if defined(__x86_64__)
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

/* 32 int32 in -127..127 (4 vectors of 8, in order) as 32 int8 in order: the packs work
 * within 128-bit halves, the permute puts their 4-byte pieces back in order. */
AVX2 __m256i bytes32(__m256i q0, __m256i q1, __m256i q2, __m256i q3) {
    __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
    return _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

AVX2 float max8(__m256 v) {  /* a max is exact in any order */
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

AVX2 int32_t sum8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

AVX2 __m256 abs8(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }
#endif
#endif
