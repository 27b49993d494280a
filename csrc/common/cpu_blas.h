// The BLAS products the CPU kernels call directly, row-major. Fortran BLAS and MKL's CBLAS bf16
// GEMM from the library torch links (MKL in x86 wheels; ATen's cpublas wrappers are not exported).
// Called from inside at::parallel_for they run single-threaded.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
            const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
            const float* beta, float* c, const int* ldc);
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
            const double* alpha, const double* a, const int* lda, const double* b, const int* ldb,
            const double* beta, double* c, const int* ldc);
// MKL's bf16 x bf16 -> fp32 GEMM (CBLAS, LP64), which runs on the AMX tile unit where the CPU has
// one. The weak reference is null where the BLAS torch links has no such routine.
void cblas_gemm_bf16bf16f32(int layout, int trans_a, int trans_b, int m, int n, int k, float alpha,
                            const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta,
                            float* c, int ldc) __attribute__((weak));
}

namespace flashmod {

// BLAS wants ld >= the stored row length even when a single row makes the stride irrelevant.
inline int blas_leading_dim(int64_t ld, int64_t rows, int64_t row_length) {
  return static_cast<int>(rows == 1 ? std::max<int64_t>(row_length, 1) : ld);
}

// Row-major C (m x n) = alpha op(A) op(B) + beta C. BLAS is column-major: a row-major matrix is
// its column-major transpose, so C^T = op(B)^T op(A)^T keeps the flags and swaps the operands.
template <typename acc_t>
inline void matmul_rows(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, acc_t alpha,
                        const acc_t* a, int64_t lda, const acc_t* b, int64_t ldb, acc_t beta,
                        acc_t* c, int64_t ldc) {
  static_assert(std::is_same_v<acc_t, float> || std::is_same_v<acc_t, double>);
  const char ta = trans_a ? 'T' : 'N', tb = trans_b ? 'T' : 'N';
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  const int lda_i = trans_a ? blas_leading_dim(lda, k, m) : blas_leading_dim(lda, m, k);
  const int ldb_i = trans_b ? blas_leading_dim(ldb, n, k) : blas_leading_dim(ldb, k, n);
  const int ldc_i = blas_leading_dim(ldc, m, n);
  if constexpr (std::is_same_v<acc_t, float>) {
    sgemm_(&tb, &ta, &ni, &mi, &ki, &alpha, b, &ldb_i, a, &lda_i, &beta, c, &ldc_i);
  } else {
    dgemm_(&tb, &ta, &ni, &mi, &ki, &alpha, b, &ldb_i, a, &lda_i, &beta, c, &ldc_i);
  }
}

// matmul_rows on bf16 operands with an fp32 C (cblas_gemm_bf16bf16f32, row-major itself); only
// where that routine exists (cblas_gemm_bf16bf16f32 != nullptr).
inline void matmul_rows_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                             float alpha, const c10::BFloat16* a, int64_t lda,
                             const c10::BFloat16* b, int64_t ldb, float beta, float* c,
                             int64_t ldc) {
  constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
  const int lda_i = trans_a ? blas_leading_dim(lda, k, m) : blas_leading_dim(lda, m, k);
  const int ldb_i = trans_b ? blas_leading_dim(ldb, n, k) : blas_leading_dim(ldb, k, n);
  cblas_gemm_bf16bf16f32(
      kRowMajor, trans_a ? kTrans : kNoTrans, trans_b ? kTrans : kNoTrans, static_cast<int>(m),
      static_cast<int>(n), static_cast<int>(k), alpha, reinterpret_cast<const uint16_t*>(a), lda_i,
      reinterpret_cast<const uint16_t*>(b), ldb_i, beta, c, blas_leading_dim(ldc, m, n));
}

}  // namespace flashmod
