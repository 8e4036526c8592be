// Test helpers for checking against the float64 oracle: fresh parameters and
// a closeness check relative to the reference's magnitude, and an error check.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

namespace hp::testing {

inline const torch::TensorOptions kF64 = torch::TensorOptions().dtype(torch::kFloat64);

/// A float64 leaf that requires grad, drawn from the global generator.
inline torch::Tensor param(std::vector<int64_t> shape) {
  return (torch::randn(shape, kF64) * 0.5).requires_grad_(true);
}

/// Fails unless `a` equals the reference `b` within `tol` of max(1, |b|max).
inline void expect_close(const torch::Tensor& a, const torch::Tensor& b, const std::string& what,
                         double tol = 1e-12) {
  ASSERT_TRUE(a.defined()) << what << " is undefined";
  ASSERT_TRUE(b.defined()) << what << " reference is undefined";
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  double scale = std::max(1.0, b.abs().max().item<double>());
  double err = (a - b).abs().max().item<double>();
  EXPECT_LE(err, tol * scale) << what << ": max abs error " << err;
}

/// Fails unless `f` throws an error (c10::Error or a standard exception)
/// whose message contains `fragment`.
inline void expect_error(const std::function<void()>& f, const std::string& fragment) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing '" << fragment << "'";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

}  // namespace hp::testing
