/* Which vector path runs (kernel_paths.h), read once from the CPU; the scratch buffers. */
#include <stdlib.h>
#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include "kernel_paths.h"

static int cap = -1;

#if defined(__x86_64__)
/* 1 where AMX int8 tiles run here: the CPU has them and Linux lets this process use them. */
static int amx_usable(void) {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 24)) && (d & (1u << 25))
           && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

static int detect(void) {
    __builtin_cpu_init();  /* its answers include the OS's support for the registers (XCR0) */
#define HAS(feature) __builtin_cpu_supports(feature)
    if (!(HAS("avx2") && HAS("fma") && HAS("f16c"))) return PATH_PORTABLE;
    int avx512 = HAS("avx512f") && HAS("avx512bw") && HAS("avx512dq") && HAS("avx512vl");
    if (avx512 && HAS("avx512vnni")) return amx_usable() ? PATH_AMX : PATH_AVX512;
    return HAS("avxvnni") || (avx512 && HAS("avx512vnni")) ? PATH_VNNI256 : PATH_AVX2;
}
#else
static int detect(void) { return PATH_PORTABLE; }
#endif

int rakv_cpu_path(void) {
    static int path = -1;
    if (path < 0) path = detect();
    return path;
}

void rakv_cap_path(int path) { cap = path; }

int rakv_path(int requested) {
    int path = requested < 0 ? cap : requested;
    return path < 0 || path > rakv_cpu_path() ? rakv_cpu_path() : path;
}

int rakv_vnni256_vex(void) {  /* asked by every Linear call: read once */
    static int vex = -1;
    if (vex < 0) {
#if defined(__x86_64__)
        __builtin_cpu_init();
        vex = __builtin_cpu_supports("avxvnni") != 0;
#else
        vex = 0;
#endif
    }
    return vex;
}

int8_t *rakv_scratch(size_t needed) {
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
