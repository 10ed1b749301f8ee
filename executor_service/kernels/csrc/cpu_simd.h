// What the executor's C++ CPU kernels share (attention/csrc, model/csrc): the inlining macro, AVX-512 helpers
// (a 16-lane horizontal sum, e^x) and AVX2's (an 8-lane horizontal sum, e^x).
// On the include path of every extension executor_service/kernels/build.py builds.
#pragma once

#ifndef ALWAYS_INLINE
#define ALWAYS_INLINE inline __attribute__((always_inline))
#endif

#ifdef __AVX512F__
#include <immintrin.h>

namespace pagedserve {

// lane t of the result = the sum of the 16 lanes of p[t].
ALWAYS_INLINE __m512 sum_lanes16(const __m512* p) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]), _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: that lane's sums of 4 inputs
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const auto halves = [](__m512 a, __m512 b) {  // lanes (a.l0+a.l1, a.l2+a.l3, b.l0+b.l1, b.l2+b.l3)
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  return halves(halves(quads[0], quads[1]), halves(quads[2], quads[3]));
}

// e^x on 16 lanes for x in [-87.3, 88.3] (the caller clamps): Cephes' expf, x = n ln2 + r with ln2 in two parts,
// a degree-6 polynomial in r, times 2^n built in the exponent bits; within 2 ulp.
ALWAYS_INLINE __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

}  // namespace pagedserve
#endif  // __AVX512F__

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace pagedserve {

// exp16's e^x on 8 lanes (AVX2 and FMA; the same steps, so the same results lane for lane).
ALWAYS_INLINE __m256 exp8(__m256 x) {
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// lane t of the result = the sum of the 8 lanes of p[t].
ALWAYS_INLINE __m256 sum_lanes8(const __m256* p) {
  // per 128-bit half: (a0+a1, a2+a3, b0+b1, b2+b3), then (a0+..+a3, b0+..+b3, c0+..+c3, d0+..+d3)
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(p[0], p[1]), _mm256_hadd_ps(p[2], p[3]));
  const __m256 efgh = _mm256_hadd_ps(_mm256_hadd_ps(p[4], p[5]), _mm256_hadd_ps(p[6], p[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(abcd, efgh, 0x20), _mm256_permute2f128_ps(abcd, efgh, 0x31));
}

}  // namespace pagedserve
#endif  // __AVX2__ && __FMA__

