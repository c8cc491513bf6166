/* 4-bit weights x 8-bit activations on AVX512-VNNI, reading torch's CPU int4pack bytes as they are.
 *
 * y[m, n] = sum_g xs[m, g] * (scale[g, n] * sum_{k in g} u[n, k] a[m, k] + (zero[g, n] - 8 scale[g, n]) * asum[m, g])
 *
 * where W[n, k] = (u[n, k] - 8) * scale[g, n] + zero[g, n] is the int4pack weight (u in 0..15, bf16 scale and zero,
 * quant/kernel.py), and each group of x's row is quantized on its own: x[m, k] ~= a[m, k] * xs[m, g], xs the
 * group's max |x| / 127 rounded up to bf16, a in -127..127, asum[m, g] = sum_{k in g} a[m, k]. The integer sums
 * are exact (vpdpbusd: u8 x s8 -> s32); the float steps run in one fixed order per (row, output), whatever the
 * other rows of the call: a row's result does not depend on its batch (what a verified sweep needs).
 *
 * Layout read (AVX512 int4pack, quant/kernel.py): for each block of 64 output rows, for each k, 32 bytes: byte j =
 * row j (low nibble) | row j + 32 (high nibble). A last block of fewer than 64 rows uses adjacent pairs (byte j =
 * row 2j | row 2j + 1) and goes through the scalar path, as does everything when the caller asks for it.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifndef MT
#define MT 4   /* rows of x per tile: 16 int32 accumulators for 64 outputs, 4 weight vectors */
#endif

static inline float bf16_lo(uint32_t v) { uint32_t b = v << 16; float f; memcpy(&f, &b, 4); return f; }
static inline float bf16_hi(uint32_t v) { uint32_t b = v & 0xFFFF0000u; float f; memcpy(&f, &b, 4); return f; }

/* x [M, K] fp32 -> a [M, K] int8, xs [M, G], asum [M, G] (float, exact integers). */
void q8_quantize(const float *x, int64_t M, int64_t K, int64_t gs, int8_t *a, float *xs, float *asum) {
    int64_t G = K / gs;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t g = 0; g < G; g++) {
            const float *xg = x + m * K + g * gs;
            int8_t *ag = a + m * K + g * gs;
            float mx = 0.f;
            for (int64_t k = 0; k < gs; k++) mx = fmaxf(mx, fabsf(xg[k]));
            /* the group's scale, rounded up to a bf16 value: an ulp's change in the group's largest |x| (a
             * reduction upstream summed in another order on another thread count) then leaves the scale, and so
             * the row's result, as it was, unless it crosses one of bf16's steps (as rounding x to bf16 did) */
            float sc = mx / 127.f;
            uint32_t b;
            memcpy(&b, &sc, 4);
            if (b & 0xFFFFu) b = (b | 0xFFFFu) + 1u;
            memcpy(&sc, &b, 4);
            float inv = mx > 0.f ? 1.f / sc : 0.f;
            int32_t s = 0;
            for (int64_t k = 0; k < gs; k++) {
                float q = nearbyintf(xg[k] * inv);
                q = fminf(127.f, fmaxf(-127.f, q));
                ag[k] = (int8_t)q;
                s += (int32_t)q;
            }
            xs[m * G + g] = mx > 0.f ? sc : 0.f;
            asum[m * G + g] = (float)s;
        }
    }
}

/* One full block of 64 output rows (n0 .. n0 + 63) for rows m0 .. m0 + mt - 1. */
static void block64(const uint8_t *qw, const uint32_t *sz, int64_t N, int64_t K, int64_t gs, int64_t n0,
                    const int8_t *a, const float *xs, const float *asum, int64_t m0, int mt, float *y) {
    const int64_t G = K / gs;
    const uint8_t *base = qw + n0 * (K / 2);  /* block n0/64 starts at byte n0 * K / 2 */
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    const __m512i hi16 = _mm512_set1_epi32((int)0xFFFF0000u);
    const __m512 eight = _mm512_set1_ps(8.f);
    __m512i idx0, idx1;
    {
        uint8_t i0[64], i1[64];
        for (int j = 0; j < 16; j++) {
            i0[4 * j] = j;      i0[4 * j + 1] = 32 + j;      i0[4 * j + 2] = 64 + j;      i0[4 * j + 3] = 96 + j;
            i1[4 * j] = 16 + j; i1[4 * j + 1] = 48 + j;      i1[4 * j + 2] = 80 + j;      i1[4 * j + 3] = 112 + j;
        }
        idx0 = _mm512_loadu_si512(i0);
        idx1 = _mm512_loadu_si512(i1);
    }
    __m512 facc[MT][4];
    for (int r = 0; r < mt; r++)
        for (int i = 0; i < 4; i++) facc[r][i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512i iacc[MT][4];
        for (int r = 0; r < mt; r++)
            for (int i = 0; i < 4; i++) iacc[r][i] = _mm512_setzero_si512();
        for (int64_t k0 = g * gs; k0 < (g + 1) * gs; k0 += 4) {
            __m512i A = _mm512_loadu_si512(base + k0 * 32);
            __m512i C = _mm512_loadu_si512(base + (k0 + 2) * 32);
            __m512i P0 = _mm512_permutex2var_epi8(A, idx0, C);
            __m512i P1 = _mm512_permutex2var_epi8(A, idx1, C);
            __m512i W[4];
            W[0] = _mm512_and_si512(P0, lo4);
            W[1] = _mm512_and_si512(P1, lo4);
            W[2] = _mm512_and_si512(_mm512_srli_epi16(P0, 4), lo4);
            W[3] = _mm512_and_si512(_mm512_srli_epi16(P1, 4), lo4);
            for (int r = 0; r < mt; r++) {
                int32_t four;
                memcpy(&four, a + (m0 + r) * K + k0, 4);
                __m512i bx = _mm512_set1_epi32(four);
                for (int i = 0; i < 4; i++) iacc[r][i] = _mm512_dpbusd_epi32(iacc[r][i], W[i], bx);
            }
        }
        for (int i = 0; i < 4; i++) {
            __m512i v = _mm512_loadu_si512(sz + g * N + n0 + 16 * i);
            __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            __m512 z = _mm512_castsi512_ps(_mm512_and_si512(v, hi16));
            __m512 zm = _mm512_fnmadd_ps(eight, s, z);   /* zero - 8 scale */
            for (int r = 0; r < mt; r++) {
                int64_t mg = (m0 + r) * G + g;
                __m512 t = _mm512_mul_ps(s, _mm512_cvtepi32_ps(iacc[r][i]));
                t = _mm512_fmadd_ps(zm, _mm512_set1_ps(asum[mg]), t);
                facc[r][i] = _mm512_fmadd_ps(t, _mm512_set1_ps(xs[mg]), facc[r][i]);
            }
        }
    }
    for (int r = 0; r < mt; r++)
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(y + (m0 + r) * N + n0 + 16 * i, facc[r][i]);
}

/* The code of row n at column k, for a last block of adjacent pairs or for the scalar path. */
static inline int code_at(const uint8_t *qw, int64_t N, int64_t K, int64_t n, int64_t k) {
    int64_t full = N / 64 * 64;
    if (n < full) {
        int64_t blk = n / 64, j = n % 64;
        uint8_t b = qw[blk * 64 * K / 2 + k * 32 + (j % 32)];
        return j >= 32 ? b >> 4 : b & 15;
    }
    int64_t t = n - full, half = (N - full) / 2;
    uint8_t b = qw[full * K / 2 + k * half + t / 2];
    return t % 2 ? b >> 4 : b & 15;
}

/* Rows n0 .. n1 - 1, one output at a time, the same float steps in the same order as block64 (each lane of
 * block64 is one output's chain): y equal bit for bit. */
static void scalar_rows(const uint8_t *qw, const uint32_t *sz, int64_t N, int64_t K, int64_t gs, int64_t n0,
                        int64_t n1, const int8_t *a, const float *xs, const float *asum, int64_t M, float *y) {
    const int64_t G = K / gs;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = n0; n < n1; n++) {
            float acc = 0.f;
            for (int64_t g = 0; g < G; g++) {
                int32_t isum = 0;
                for (int64_t k = g * gs; k < (g + 1) * gs; k++) isum += code_at(qw, N, K, n, k) * a[m * K + k];
                uint32_t v = sz[g * N + n];
                float s = bf16_lo(v), z = bf16_hi(v);
                float zm = fmaf(-8.f, s, z);
                float t = s * (float)isum;
                t = fmaf(zm, asum[m * G + g], t);
                acc = fmaf(t, xs[m * G + g], acc);
            }
            y[m * N + n] = acc;
        }
}

/* y [M, N] = the product above. a, xs, asum from q8_quantize. scalar != 0: every row through the scalar path. */
void q4q8_mm(const uint8_t *qw, const uint16_t *scales_zeros, int64_t N, int64_t K, int64_t gs,
             const int8_t *a, const float *xs, const float *asum, int64_t M, float *y, int threads, int scalar) {
    const uint32_t *sz = (const uint32_t *)scales_zeros;
    int64_t full = scalar ? 0 : N / 64 * 64;
    int64_t nblocks = full / 64;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && nblocks > 1)
    for (int64_t b = 0; b < nblocks; b++)
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            int mt = (int)(M - m0 < MT ? M - m0 : MT);
            block64(qw, sz, N, K, gs, b * 64, a, xs, asum, m0, mt, y);
        }
    if (full < N) scalar_rows(qw, sz, N, K, gs, full, N, a, xs, asum, M, y);
}
