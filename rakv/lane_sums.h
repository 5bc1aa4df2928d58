/* Sums in 16 lanes, the fixed order that attention_kernel.c and layer_kernel.c share (their
 * vector paths reproduce it): input c goes into lane c % 16 by one fused multiply-add, then
 * the lanes are added in halves, 8, 4, 2, 1. */
#ifndef RAKV_LANE_SUMS_H
#define RAKV_LANE_SUMS_H
#include <math.h>

#define LANES 16

/* Lanes added in halves: 8, 4, 2, 1. */
__attribute__((always_inline)) static inline float halves(float *lane) {
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) lane[i] = lane[i] + lane[i + w];
    return lane[0];
}

/* a . b over n inputs in the lanes' order. */
__attribute__((always_inline)) static inline float dot_portable(const float *a, const float *b, int n) {
    float lane[LANES] = {0};
    int whole = n - n % LANES;
    for (int c = 0; c < whole; c += LANES)  /* input c into lane c % 16; in two loops, it vectorizes */
        for (int i = 0; i < LANES; i++) lane[i] = fmaf(a[c + i], b[c + i], lane[i]);
    for (int i = 0; i < n - whole; i++) lane[i] = fmaf(a[whole + i], b[whole + i], lane[i]);
    return halves(lane);
}
#endif
