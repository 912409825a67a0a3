// Native CPU kernels of tf_dct's compressors (tf_dct/ops/native.py builds
// and loads this file). Each gives bit for bit what the stock ops it replaces
// give.
//
// TfDctThresholdSelect: DCT-DP (DCT Algorithm 1) lines 2 and 9-11 for one
// variable, in one pass.
//
// acc = grad + residual (line 2); the mask |acc| >= tau, zeros excepted
// (line 9); the first `capacity` selected entries packed, in position order,
// into fixed (idx, val) buffers, padding n and 0 (line 10); the new residual,
// acc with the packed entries zeroed (line 11); and the number selected before
// the capacity cut, as tf_dct/compression/dct_dp.py computes with stock ops.
//
// A non-finite gradient entry fails the op with InvalidArgument and `message`,
// as tf.debugging.check_numerics would, so nothing computed from it leaves.
//
// TfDctOrderStatistic: the threshold of a refresh (lines 4-5) in O(n).
//
// TfDctScatterSum: the dense sum of every replica's packed entries (DCT
// Algorithm 1 line 12, after the all-gather) and its number of non-zero
// entries: it decodes each replica's index words (the layouts of
// tf_dct/compression/sparse_wire.py), adds the values in, and counts. Positions
// outside [0, n) (the padding n) are dropped, and each position sums its
// values in slot order starting from +0, as tf.math.unsorted_segment_sum does.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the wire's packed counts and offsets are read little-endian");

namespace tf_dct {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
namespace shape_inference = ::tensorflow::shape_inference;

template <typename... Args>
absl::Status InvalidArgument(const Args&... args) {
  return absl::InvalidArgumentError(absl::StrCat(args...));
}

// The error of a non-finite gradient, worded as check_numerics words it.
absl::Status NonFinite(const std::string& message, bool nan) {
  return InvalidArgument(message, " : Tensor had ", (nan ? "NaN" : "Inf"),
                         " values");
}

// Whether `residual` is one scalar added to every entry of `grad` (else it
// has grad's entries), or an error.
absl::Status ScalarResidual(const Tensor& grad, const Tensor& residual,
                            bool* scalar) {
  const int64_t n = grad.NumElements();
  *scalar = residual.NumElements() == 1 && n != 1;
  if (!*scalar && residual.NumElements() != n) {
    return InvalidArgument("residual must have ", n, " entries or one, got ",
                           residual.shape().DebugString());
  }
  return absl::OkStatus();
}

REGISTER_OP("TfDctThresholdSelect")
    .Input("grad: T")
    .Input("residual: T")
    .Input("tau: T")
    .Output("idx: int32")
    .Output("val: T")
    .Output("new_residual: T")
    .Output("selected: int32")
    .Attr("T: {float, double}")
    .Attr("capacity: int >= 1")
    .Attr("message: string")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      int64_t capacity;
      TF_RETURN_IF_ERROR(c->GetAttr("capacity", &capacity));
      shape_inference::ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &unused));
      c->set_output(0, c->Vector(capacity));
      c->set_output(1, c->Vector(capacity));
      c->set_output(2, c->input(0));
      c->set_output(3, c->Scalar());
      return absl::OkStatus();
    });

template <typename T>
class ThresholdSelectOp : public OpKernel {
 public:
  explicit ThresholdSelectOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("capacity", &capacity_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("message", &message_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& grad = ctx->input(0);
    const Tensor& residual = ctx->input(1);
    const Tensor& tau_t = ctx->input(2);
    const int64_t n = grad.NumElements();
    OP_REQUIRES(ctx, grad.dims() == 1 && n < INT32_MAX,
                InvalidArgument("grad must be rank 1 with fewer than 2^31 - 1 "
                                "entries, got shape ", grad.shape().DebugString()));
    // The residual is the variable's (same length) or one scalar added to
    // every entry (0 when the caller accumulated already).
    bool scalar;
    OP_REQUIRES_OK(ctx, ScalarResidual(grad, residual, &scalar));
    OP_REQUIRES(ctx, tau_t.NumElements() == 1,
                InvalidArgument("tau must be a scalar"));
    Tensor *idx_t, *val_t, *res_t, *sel_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({capacity_}), &idx_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({capacity_}), &val_t));
    // The new residual may take over the gradient's buffer when nothing else
    // holds it (each entry is read before it is written).
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output(
                            {0}, 2, grad.shape(), &res_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({}), &sel_t));
    const T* g = grad.flat<T>().data();
    const T* r = residual.flat<T>().data();
    const T tau = tau_t.flat<T>()(0);
    int32_t* idx = idx_t->flat<int32_t>().data();
    T* val = val_t->flat<T>().data();
    T* out = res_t->flat<T>().data();
    const int64_t capacity = capacity_;
    int64_t selected = 0;
    for (int64_t i = 0; i < n; ++i) {
      const T gi = g[i];
      if (!std::isfinite(gi)) {
        ctx->CtxFailure(NonFinite(message_, std::isnan(gi)));
        return;
      }
      const T acc = gi + (scalar ? r[0] : r[i]);        // line 2
      const T magnitude = std::fabs(acc);
      if (magnitude >= tau && magnitude > T(0)) {        // line 9
        if (selected < capacity) {                        // line 10
          idx[selected] = static_cast<int32_t>(i);
          val[selected] = acc;
          out[i] = T(0);                                  // line 11
        } else {
          out[i] = acc;  // selected but no slot: kept, like the unselected
        }
        ++selected;
      } else {
        out[i] = acc;                                     // line 11
      }
    }
    for (int64_t j = selected < capacity ? selected : capacity; j < capacity; ++j) {
      idx[j] = static_cast<int32_t>(n);
      val[j] = T(0);
    }
    sel_t->scalar<int32_t>()() = static_cast<int32_t>(selected);
  }

 private:
  int64_t capacity_;
  std::string message_;
};

REGISTER_OP("TfDctScatterSum")
    .Input("words: int32")
    .Input("val: T")
    .Output("dense: T")
    .Output("nnz: int64")
    .Attr("T: {float, double}")
    .Attr("n: int >= 1")
    .Attr("chunk: int >= 0")
    .Attr("count_bytes: int >= 0")
    .Attr("offset_bytes: int >= 1")
    .Attr("count_words: int >= 0")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      int64_t n;
      TF_RETURN_IF_ERROR(c->GetAttr("n", &n));
      shape_inference::ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &unused));
      c->set_output(0, c->Vector(n));
      c->set_output(1, c->Scalar());
      return absl::OkStatus();
    });

// An unsigned little-endian value of `nbytes` bytes, as tf.bitcast lays
// narrower integers into int32 words on this (little-endian) host.
inline uint32_t ReadLittle(const unsigned char* at, int64_t nbytes) {
  uint32_t value = 0;
  std::memcpy(&value, at, nbytes);
  return value;
}

template <typename T>
class ScatterSumOp : public OpKernel {
 public:
  explicit ScatterSumOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("n", &n_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("chunk", &chunk_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("count_bytes", &count_bytes_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("offset_bytes", &offset_bytes_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("count_words", &count_words_));
    OP_REQUIRES(ctx, chunk_ == 0 || (count_bytes_ >= 1 && count_bytes_ <= 4 &&
                                     offset_bytes_ <= 4),
                InvalidArgument("a chunked layout needs 1-4 bytes per count "
                                "and per offset"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& words_t = ctx->input(0);
    const Tensor& val_t = ctx->input(1);
    OP_REQUIRES(ctx, words_t.dims() == 2 && val_t.dims() == 2 &&
                         words_t.dim_size(0) == val_t.dim_size(0),
                InvalidArgument("words and val must be [replicas, ...] with the "
                                "same replicas, got ",
                                words_t.shape().DebugString(), " and ",
                                val_t.shape().DebugString()));
    const int64_t rows = val_t.dim_size(0);
    const int64_t capacity = val_t.dim_size(1);
    const int64_t width = words_t.dim_size(1);
    const int64_t chunks = chunk_ ? (n_ + chunk_ - 1) / chunk_ : 0;
    const int64_t need =
        chunk_ ? count_words_ + (capacity * offset_bytes_ + 3) / 4 : capacity;
    OP_REQUIRES(ctx, width >= need && count_words_ * 4 >= chunks * count_bytes_,
                InvalidArgument("words has ", width, " words per replica, the "
                                "layout needs ", need));
    Tensor *dense_t, *nnz_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n_}), &dense_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &nnz_t));
    const int32_t* words = words_t.flat<int32_t>().data();
    const T* val = val_t.flat<T>().data();
    T* dense = dense_t->flat<T>().data();
    std::fill(dense, dense + n_, T(0));
    std::vector<int64_t> touched;  // positions added to, to count non-zeros
    touched.reserve(rows * capacity);
    // Replicas in order, each one's slots in order: the additions happen in
    // the order unsorted_segment_sum makes them on the decoded positions.
    for (int64_t row = 0; row < rows; ++row) {
      const int32_t* w = words + row * width;
      const T* v = val + row * capacity;
      if (chunk_ == 0) {  // "int32": the words are the positions
        for (int64_t j = 0; j < capacity; ++j) {
          const int64_t p = w[j];
          if (p >= 0 && p < n_) {
            dense[p] += v[j];
            touched.push_back(p);
          }
        }
        continue;
      }
      // Chunked: per-chunk counts, then one offset per slot; slot j belongs
      // to the chunk whose running count first exceeds j.
      const auto* counts = reinterpret_cast<const unsigned char*>(w);
      const auto* offsets = reinterpret_cast<const unsigned char*>(w + count_words_);
      int64_t j = 0;
      for (int64_t c = 0; c < chunks && j < capacity; ++c) {
        const int64_t end = j + ReadLittle(counts + c * count_bytes_, count_bytes_);
        for (; j < end && j < capacity; ++j) {
          const int64_t p =
              c * chunk_ + ReadLittle(offsets + j * offset_bytes_, offset_bytes_);
          if (p < n_) {
            dense[p] += v[j];
            touched.push_back(p);
          }
        }
      }
    }
    // Only touched positions can be non-zero; each is counted once.
    std::vector<bool> seen(n_, false);
    int64_t nnz = 0;
    for (const int64_t p : touched) {
      if (!seen[p]) {
        seen[p] = true;
        nnz += dense[p] != T(0);
      }
    }
    nnz_t->scalar<int64_t>()() = nnz;
  }

 private:
  int64_t n_, chunk_, count_bytes_, offset_bytes_, count_words_;
};

REGISTER_OP("TfDctOrderStatistic")
    .Input("grad: T")
    .Input("residual: T")
    .Output("threshold: T")
    .Attr("T: {float, double}")
    .Attr("m: int >= 0")
    .Attr("message: string")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    });

// w_m, the m-th smallest (0-based) of |grad + residual| (DCT Algorithm 1
// lines 4-5), in O(n): non-negative floats order like their bit patterns, so
// one pass counts the magnitudes by their top kBucketBits bits, the bucket
// holding rank m is found from the counts, and a second pass gathers that
// bucket (the magnitudes recomputed, the same bits) for std::nth_element.
// top_k of k = n - m finds the same value, ties included, in O(n log k). A
// non-finite entry of grad fails the op with `message`, as in
// TfDctThresholdSelect (and keeps NaN away from the comparisons).
constexpr int kBucketBits = 12;

template <typename T>
class OrderStatisticOp : public OpKernel {
 public:
  explicit OrderStatisticOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("m", &m_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("message", &message_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& grad = ctx->input(0);
    const Tensor& residual = ctx->input(1);
    const int64_t n = grad.NumElements();
    bool scalar;
    OP_REQUIRES_OK(ctx, ScalarResidual(grad, residual, &scalar));
    OP_REQUIRES(ctx, m_ < n, InvalidArgument("m must be below ", n, ", got ", m_));
    const T* g = grad.flat<T>().data();
    const T* r = residual.flat<T>().data();
    using Bits = typename std::conditional<sizeof(T) == 4, uint32_t,
                                           uint64_t>::type;
    constexpr int kShift = 8 * sizeof(Bits) - kBucketBits;
    const auto magnitude = [&](int64_t i) {
      return std::fabs(g[i] + (scalar ? r[0] : r[i]));
    };
    const auto bucket = [](T value) {
      Bits bits;
      std::memcpy(&bits, &value, sizeof(bits));
      return static_cast<int64_t>(bits >> kShift);
    };
    std::vector<int64_t> count(int64_t{1} << kBucketBits, 0);
    bool finite = true, nan = false;
    for (int64_t i = 0; i < n; ++i) {
      finite &= (g[i] - g[i] == T(0));  // false for NaN and +-Inf
      nan |= (g[i] != g[i]);
      ++count[bucket(magnitude(i))];
    }
    OP_REQUIRES(ctx, finite, NonFinite(message_, nan));
    int64_t target = 0, below = 0;  // the bucket of rank m, entries before it
    while (below + count[target] <= m_) below += count[target++];
    std::vector<T> members;
    members.reserve(count[target]);
    for (int64_t i = 0; i < n; ++i) {
      const T value = magnitude(i);
      if (bucket(value) == target) members.push_back(value);
    }
    std::nth_element(members.begin(), members.begin() + (m_ - below),
                     members.end());
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<T>()() = members[m_ - below];
  }

 private:
  int64_t m_;
  std::string message_;
};

#define TF_DCT_REGISTER(T)                                              \
  REGISTER_KERNEL_BUILDER(                                              \
      Name("TfDctThresholdSelect").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
      ThresholdSelectOp<T>);                                           \
  REGISTER_KERNEL_BUILDER(                                              \
      Name("TfDctScatterSum").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
      ScatterSumOp<T>);                                                \
  REGISTER_KERNEL_BUILDER(                                              \
      Name("TfDctOrderStatistic").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
      OrderStatisticOp<T>)
TF_DCT_REGISTER(float);
TF_DCT_REGISTER(double);
#undef TF_DCT_REGISTER

}  // namespace tf_dct
