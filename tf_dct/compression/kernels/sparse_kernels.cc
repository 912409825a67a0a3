// Native CPU kernels of tf_dct's compressors (tf_dct/compression/native.py builds
// and loads this file). Each gives bit for bit what the stock ops it replaces
// give.
//
// TfDctSelect: DCT-DP (DCT Algorithm 1) lines 2-11 for all of one replica's
// variables in one op. Per variable: acc = grad + residual (line 2); the
// threshold tau, on a refresh the order statistic of |acc| in O(n) (lines
// 4-5), else the old tau (line 7), checked by the density guard of
// tf_dct/compression/dct_dp.py, which refreshes early when the old tau
// selects too few or too many; the mask |acc| >= tau, zeros excepted (line
// 9); the first `capacity` selected entries packed, in position order, into
// fixed (idx, val) buffers, padding n and 0 (line 10); the new residual, acc
// with the packed entries zeroed (line 11); and the number selected before
// the capacity cut. With the old tau, lines 2 and 9-11 are one pass (grad
// and residual read once, the new residual written once); when the guard
// then refreshes, the packed entries go back into acc and lines 4-5 and
// 9-11 run on it. The op also returns its own run time in seconds (the
// selection time of the accounting): tf.timestamp ops around it would run
// the replicas' selections one after another, since TensorFlow runs
// stateful ops without resource inputs in program order. One op instead of
// one per variable saves the per-op dispatch that dominates small variables.
//
// A non-finite gradient entry fails the op with InvalidArgument and the
// variable's message, as tf.debugging.check_numerics would, so nothing
// computed from it leaves.
//
// TfDctEncode and TfDctGatherSum: the wire of DCT Algorithm 1 line 12 (and
// of every compressor that exchanges packed entries). TfDctEncode lays one
// replica's packed vectors into one int32 payload: every vector's index
// words (the layouts of tf_dct/compression/sparse_wire.py), then every
// vector's values. After the all-gather of the payloads, TfDctGatherSum
// decodes every replica's words, adds the values into dense sums and counts
// each sum's non-zero entries. Positions outside [0, n) (the padding n) are
// dropped, and each position sums its values in slot order starting from +0,
// replicas in order, as tf.math.unsorted_segment_sum does on the decoded
// positions.
//
// Value words: the packed values travel in the accumulator's type T or, for
// float32 with V = bfloat16, as bfloat16 two to an int32 word (slot 2j in
// the low half of word j). TfDctSelect then rounds each packed value to
// nearest even and leaves what rounding took off in the new residual, as
// sparse_wire.round_values does with stock ops, and TfDctGatherSum widens
// the words back to float32 before it adds them.

#include <algorithm>
#include <chrono>
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
using ::tensorflow::bfloat16;
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

// A packed accumulator entry on its way to a value word of type V, and back.
// With V = T the value travels as it is and leaves 0 in the residual.
template <typename T, typename V>
struct Word {
  static_assert(std::is_same<T, V>::value, "V must be T or, for float, "
                "bfloat16");
  // Writes the word of `a` (non-zero) into `slot`; returns the residual left.
  static T Put(T a, V* slot) {
    *slot = a;
    return T(0);
  }
  // The entry that Put(a) turned into `word` and `left`.
  static T Restore(V word, T /*left*/) { return word; }
  static T Widen(V word) { return word; }
};

// float32 as bfloat16 (sparse_wire.round_values, bit for bit): rounded to
// nearest even by Eigen's conversion, the one tf.cast makes; the error
// a - float(b) is exact (a and b share the exponent) and, for |a| >= kTiny,
// a normal float. A value below kTiny (sparse_wire.TINY = 2^-103) travels as
// +0 and stays whole in the residual: its error could be subnormal, and
// TensorFlow runs kernels with subnormal results flushed to zero.
template <>
struct Word<float, bfloat16> {
  static constexpr float kTiny = 0x1p-103f;
  static float Put(float a, bfloat16* slot) {
    if (std::fabs(a) < kTiny) {
      *slot = bfloat16(0.0f);
      return a;
    }
    const bfloat16 b(a);
    *slot = b;
    return a - static_cast<float>(b);
  }
  // Exact: b + (a - b) is a. A tiny a went as 0 and is its own residual
  // (no addition, which would flush a subnormal a).
  static float Restore(bfloat16 word, float left) {
    const float b = static_cast<float>(word);
    return b == 0.0f ? left : b + left;
  }
  static float Widen(bfloat16 word) { return static_cast<float>(word); }
};

// int32 words of `capacity` values of type V (an odd count of bfloat16
// fills its last word with a zero half).
template <typename V>
constexpr int64_t ValueWords(int64_t capacity) {
  return (capacity * static_cast<int64_t>(sizeof(V)) + 3) / 4;
}

REGISTER_OP("TfDctSelect")
    .Input("grads: N * T")
    .Input("residuals: N * T")
    .Input("taus: T")
    .Input("modes: int32")
    .Output("idx: N * int32")
    .Output("val: N * V")
    .Output("new_residuals: N * T")
    .Output("new_taus: T")
    .Output("selected: int32")
    .Output("early: bool")
    .Output("seconds: double")
    .Attr("T: {float, double}")
    .Attr("V: {float, double, bfloat16}")
    .Attr("N: int >= 1")
    .Attr("capacities: list(int)")
    .Attr("below: list(int)")
    .Attr("lowest: list(int)")
    .Attr("highest: list(int)")
    .Attr("messages: list(string)")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      int64_t n;
      std::vector<int64_t> capacities;
      TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
      TF_RETURN_IF_ERROR(c->GetAttr("capacities", &capacities));
      if (static_cast<int64_t>(capacities.size()) != n) {
        return InvalidArgument("capacities must have N = ", n, " entries");
      }
      shape_inference::ShapeHandle unused;
      for (int64_t v = 0; v < n; ++v) {
        TF_RETURN_IF_ERROR(c->WithRank(c->input(v), 1, &unused));
        c->set_output(v, c->Vector(capacities[v]));
        c->set_output(n + v, c->Vector(capacities[v]));
        c->set_output(2 * n + v, c->input(v));
      }
      for (int64_t k = 0; k < 3; ++k) c->set_output(3 * n + k, c->Vector(n));
      c->set_output(3 * n + 3, c->Scalar());
      return absl::OkStatus();
    });

// Line 2 of one variable, out[i] = grad[i] + residual (its entry i, or its
// one entry when kScalar), in a branch-free pass the compiler vectorizes
// (-O3), for a refresh (the threshold comes from out afterwards). Flags
// non-finite (and NaN) gradient entries.
template <typename T, bool kScalar>
inline void AccumulateLoop(int64_t n, const T* grad, const T* residual,
                           T* out, int* bad, int* nan) {
  int not_finite = 0, not_a_number = 0;
  for (int64_t i = 0; i < n; ++i) {
    const T g = grad[i];
    not_finite |= !(g - g == T(0));  // NaN and +-Inf
    not_a_number |= (g != g);
    // A scalar residual of 0 adds nothing: g is the accumulator already
    // (and -0.0 + 0.0 would turn its -0.0 entries into +0.0).
    out[i] = kScalar ? (residual[0] == T(0) ? g : g + residual[0])
                     : g + residual[i];
  }
  *bad = not_finite;
  *nan = not_a_number;
}

// AccumulateLoop, with out taking over grad's buffer or not: the in-place
// call passes one pointer, so the compiler needs no overlap check (which
// would fall back to scalar code when the two are the same buffer).
template <typename T>
void Accumulate(int64_t n, const T* grad, const T* residual, bool scalar,
                T* out, bool* finite, bool* nan) {
  int bad, not_a_number;
  if (out == grad) {
    scalar ? AccumulateLoop<T, true>(n, out, residual, out, &bad, &not_a_number)
           : AccumulateLoop<T, false>(n, out, residual, out, &bad,
                                      &not_a_number);
  } else {
    scalar ? AccumulateLoop<T, true>(n, grad, residual, out, &bad,
                                     &not_a_number)
           : AccumulateLoop<T, false>(n, grad, residual, out, &bad,
                                      &not_a_number);
  }
  *finite = !bad;
  *nan = not_a_number;
}

// Lines 2 and 9-11 of one variable in one pass over its entries, for a
// threshold known before the pass (a reused tau): out[i] = grad[i] +
// residual as in AccumulateLoop, and the entries with |out[i]| >= tau, zeros
// excepted, packed in position order into (idx, val) and zeroed in out, the
// first `capacity` of them (Pack's result, without a second pass over out).
// Blocks of kBlock entries are accumulated by the vectorized loop; only a
// block holding a selected entry is looked at again, while it is still in
// the cache. Returns the number selected before the capacity cut and flags
// non-finite (and NaN) gradient entries; idx/val beyond the selected are left
// for the caller to pad.
template <typename T, typename V, bool kScalar>
inline int64_t AccumulatePackLoop(int64_t n, const T* grad, const T* residual,
                                  T tau, int64_t capacity, T* out,
                                  int32_t* idx, V* val, int* bad, int* nan) {
  constexpr int64_t kBlock = 32;
  int64_t selected = 0;
  int not_finite = 0, not_a_number = 0;
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t end = std::min(n, start + kBlock);
    int64_t hits = 0;
    for (int64_t i = start; i < end; ++i) {
      const T g = grad[i];
      not_finite |= !(g - g == T(0));
      not_a_number |= (g != g);
      const T a = kScalar ? (residual[0] == T(0) ? g : g + residual[0])
                          : g + residual[i];
      const T magnitude = std::fabs(a);
      hits += (magnitude >= tau) & (magnitude > T(0));
      out[i] = a;
    }
    if (hits == 0) continue;
    for (int64_t i = start; i < end; ++i) {
      const T magnitude = std::fabs(out[i]);
      if (magnitude >= tau && magnitude > T(0)) {          // line 9
        if (selected < capacity) {                          // line 10
          idx[selected] = static_cast<int32_t>(i);
          out[i] = Word<T, V>::Put(out[i], &val[selected]);  // line 11
        }  // else selected but no slot: kept, like the unselected
        ++selected;
      }
    }
  }
  *bad = not_finite;
  *nan = not_a_number;
  return selected;
}

// AccumulatePackLoop with out taking over grad's buffer or not (see
// Accumulate).
template <typename T, typename V>
int64_t AccumulatePack(int64_t n, const T* grad, const T* residual,
                       bool scalar, T tau, int64_t capacity, T* out,
                       int32_t* idx, V* val, bool* finite, bool* nan) {
  int bad, not_a_number;
  int64_t selected;
  if (out == grad) {
    selected = scalar ? AccumulatePackLoop<T, V, true>(n, out, residual, tau,
                                                       capacity, out, idx, val,
                                                       &bad, &not_a_number)
                      : AccumulatePackLoop<T, V, false>(n, out, residual, tau,
                                                        capacity, out, idx, val,
                                                        &bad, &not_a_number);
  } else {
    selected = scalar ? AccumulatePackLoop<T, V, true>(n, grad, residual, tau,
                                                       capacity, out, idx, val,
                                                       &bad, &not_a_number)
                      : AccumulatePackLoop<T, V, false>(n, grad, residual, tau,
                                                        capacity, out, idx, val,
                                                        &bad, &not_a_number);
  }
  *finite = !bad;
  *nan = not_a_number;
  return selected;
}

// Fills the slots after the first `used` of (idx, val) with padding: n and 0.
template <typename V>
void Pad(int64_t n, int64_t used, int64_t capacity, int32_t* idx, V* val) {
  for (int64_t j = used; j < capacity; ++j) {
    idx[j] = static_cast<int32_t>(n);
    val[j] = V(0.0f);
  }
}

// Lines 9-11 of one variable whose accumulator is in `acc`: the mask |acc| >=
// tau, zeros excepted; the first `capacity` selected entries packed in
// position order into (idx, val), padding n and 0, and zeroed in acc (which
// becomes the new residual). Returns the number selected before the capacity
// cut. (Skipping blocks without a selected entry after a vectorized test
// measured no faster at a density of 1%.)
template <typename T, typename V>
int64_t Pack(int64_t n, T tau, int64_t capacity, T* acc, int32_t* idx,
             V* val) {
  int64_t selected = 0;
  for (int64_t i = 0; i < n; ++i) {
    const T magnitude = std::fabs(acc[i]);
    if (magnitude >= tau && magnitude > T(0)) {          // line 9
      if (selected < capacity) {                          // line 10
        idx[selected] = static_cast<int32_t>(i);
        acc[i] = Word<T, V>::Put(acc[i], &val[selected]);  // line 11
      }  // else selected but no slot: kept, like the unselected
      ++selected;
    }
  }
  Pad(n, std::min(selected, capacity), capacity, idx, val);
  return selected;
}

// w_m, the m-th smallest (0-based) of |acc[i]| (lines 4-5), in O(n):
// non-negative floats order like their bit patterns, so one pass counts the
// magnitudes by their top kBucketBits bits, the bucket holding rank m is
// found from the counts, and a second pass gathers that bucket for
// std::nth_element. top_k of k = n - m finds the same value, ties included,
// in O(n log k). The entries must not be NaN (the caller checked).
constexpr int kBucketBits = 12;

template <typename T>
T OrderStatistic(int64_t n, int64_t m, const T* acc) {
  using Bits = typename std::conditional<sizeof(T) == 4, uint32_t,
                                         uint64_t>::type;
  constexpr int kShift = 8 * sizeof(Bits) - kBucketBits;
  const auto bucket = [](T value) {
    Bits bits;
    std::memcpy(&bits, &value, sizeof(bits));
    return static_cast<int64_t>(bits >> kShift);
  };
  std::vector<int64_t> count(int64_t{1} << kBucketBits, 0);
  for (int64_t i = 0; i < n; ++i) ++count[bucket(std::fabs(acc[i]))];
  int64_t target = 0, before = 0;  // the bucket of rank m, entries before it
  while (before + count[target] <= m) before += count[target++];
  std::vector<T> members;
  members.reserve(count[target]);
  for (int64_t i = 0; i < n; ++i) {
    const T value = std::fabs(acc[i]);
    if (bucket(value) == target) members.push_back(value);
  }
  std::nth_element(members.begin(), members.begin() + (m - before),
                   members.end());
  return members[m - before];
}

// Per variable v, by modes[v]:
//   1: refresh: tau = w_m of |acc| (0 when m = 0), then select;
//   0: reuse taus[v], guarded: if the number it selects (counted in the
//      accumulate pass) is below lowest[v] or above highest[v], refresh as
//      for 1 (early[v] = true); then select;
//   2: reuse taus[v]: select.
template <typename T, typename V>
class SelectOp : public OpKernel {
 public:
  explicit SelectOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("N", &num_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("capacities", &capacities_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("below", &below_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("lowest", &lowest_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("highest", &highest_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("messages", &messages_));
    for (const size_t size : {capacities_.size(), below_.size(), lowest_.size(),
                              highest_.size(), messages_.size()}) {
      OP_REQUIRES(ctx, static_cast<int64_t>(size) == num_,
                  InvalidArgument("capacities, below, lowest, highest and "
                                  "messages must have N = ", num_, " entries"));
    }
    for (const int64_t capacity : capacities_) {
      OP_REQUIRES(ctx, capacity >= 1,
                  InvalidArgument("capacities must be >= 1, got ", capacity));
    }
  }

  void Compute(OpKernelContext* ctx) override {
    const auto began = std::chrono::steady_clock::now();
    const Tensor& taus_t = ctx->input(2 * num_);
    const Tensor& modes_t = ctx->input(2 * num_ + 1);
    OP_REQUIRES(ctx, taus_t.NumElements() == num_ && modes_t.NumElements() == num_,
                InvalidArgument("taus and modes must have N = ", num_,
                                " entries"));
    const T* taus = taus_t.flat<T>().data();
    const int32_t* modes = modes_t.flat<int32_t>().data();
    Tensor *new_taus_t, *selected_t, *early_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3 * num_, TensorShape({num_}),
                                             &new_taus_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3 * num_ + 1, TensorShape({num_}),
                                             &selected_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3 * num_ + 2, TensorShape({num_}),
                                             &early_t));
    for (int64_t v = 0; v < num_; ++v) {
      const Tensor& grad = ctx->input(v);
      const Tensor& residual = ctx->input(num_ + v);
      const int64_t n = grad.NumElements();
      OP_REQUIRES(ctx, grad.dims() == 1 && n >= 1 && n < INT32_MAX,
                  InvalidArgument("grads must be rank 1 with 1 to 2^31 - 2 "
                                  "entries, got shape ",
                                  grad.shape().DebugString()));
      bool scalar;
      OP_REQUIRES_OK(ctx, ScalarResidual(grad, residual, &scalar));
      OP_REQUIRES(ctx, below_[v] >= 0 && below_[v] < n,
                  InvalidArgument("below must be in [0, ", n, "), got ",
                                  below_[v]));
      OP_REQUIRES(ctx, modes[v] >= 0 && modes[v] <= 2,
                  InvalidArgument("modes must be 0, 1 or 2, got ", modes[v]));
      Tensor *idx_t, *val_t, *out_t;
      const int64_t capacity = capacities_[v];
      OP_REQUIRES_OK(ctx, ctx->allocate_output(v, TensorShape({capacity}),
                                               &idx_t));
      OP_REQUIRES_OK(ctx, ctx->allocate_output(num_ + v, TensorShape({capacity}),
                                               &val_t));
      // The new residual may take over the gradient's buffer when nothing
      // else holds it (each entry is read before it is written).
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output(
                              {static_cast<int>(v)}, 2 * num_ + v, grad.shape(),
                              &out_t));
      const T* g = grad.flat<T>().data();
      const T* r = residual.flat<T>().data();
      int32_t* idx = idx_t->flat<int32_t>().data();
      V* val = val_t->flat<V>().data();
      T* acc = out_t->flat<T>().data();
      T tau = taus[v];
      bool finite, nan;
      int64_t selected;
      if (modes[v] == 1) {  // refresh: tau comes from the accumulator
        Accumulate(n, g, r, scalar, acc, &finite, &nan);            // line 2
        OP_REQUIRES(ctx, finite, NonFinite(messages_[v], nan));
        tau = below_[v] == 0 ? T(0) : OrderStatistic(n, below_[v], acc);  // lines 4-5
        selected = Pack(n, tau, capacity, acc, idx, val);           // lines 9-11
      } else {  // reuse tau (line 7): one pass
        selected = AccumulatePack(n, g, r, scalar, tau, capacity, acc, idx,
                                  val, &finite, &nan);  // lines 2, 9-11
        OP_REQUIRES(ctx, finite, NonFinite(messages_[v], nan));
        Pad(n, std::min(selected, capacity), capacity, idx, val);
      }
      // The guard refreshes early when the old tau selects too few or too
      // many: the packed entries go back into the accumulator, which is then
      // selected from anew with a fresh tau.
      const bool early = modes[v] == 0 &&
                         (selected < lowest_[v] || selected > highest_[v]);
      if (early) {
        for (int64_t j = 0; j < std::min(selected, capacity); ++j) {
          acc[idx[j]] = Word<T, V>::Restore(val[j], acc[idx[j]]);
        }
        tau = below_[v] == 0 ? T(0) : OrderStatistic(n, below_[v], acc);  // lines 4-5
        selected = Pack(n, tau, capacity, acc, idx, val);           // lines 9-11
      }
      new_taus_t->flat<T>()(v) = tau;
      selected_t->flat<int32_t>()(v) = static_cast<int32_t>(selected);
      early_t->flat<bool>()(v) = early;
    }
    Tensor* seconds_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3 * num_ + 3, TensorShape({}),
                                             &seconds_t));
    seconds_t->scalar<double>()() =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - began)
            .count();
  }

 private:
  int64_t num_;
  std::vector<int64_t> capacities_, below_, lowest_, highest_;
  std::vector<std::string> messages_;
};

// An unsigned little-endian value of `nbytes` bytes, as tf.bitcast lays
// narrower integers into int32 words on this (little-endian) host.
// Fixed-size copies, so that no call to memcpy is made per value.
inline uint32_t ReadLittle(const unsigned char* at, int64_t nbytes) {
  switch (nbytes) {
    case 1:
      return at[0];
    case 2: {
      uint16_t value;
      std::memcpy(&value, at, 2);
      return value;
    }
    case 4: {
      uint32_t value;
      std::memcpy(&value, at, 4);
      return value;
    }
    default: {
      uint32_t value = 0;
      std::memcpy(&value, at, nbytes);
      return value;
    }
  }
}

// The static layout of one vector's index words on the wire, as
// sparse_wire.Encoding gives it: "int32" (chunk 0) sends the positions
// themselves, one word per slot, padding n; the chunked layouts send one
// count per chunk of `chunk` positions (`count_bytes` each), then one offset
// within its chunk per slot (`offset_bytes` each, 0 for padding), each part
// filled to whole little-endian words. Slot j belongs to the chunk whose
// running count first exceeds j, so the positions must be non-decreasing
// with the padding last. "ef" (low_bits = b >= 0, chunk 0) sends one
// little-endian bit stream (bit k is bit k % 32 of word k / 32): the low b
// bits of each slot's position at bits [j b, j b + b) (0 for padding), then
// a bitmap of ((n - 1) >> b) + capacity bits in which the i-th position p_i
// sets bit (p_i >> b) + i; the count is the number of set bits.
struct Layout {
  int64_t n, capacity, chunk, count_bytes, offset_bytes, low_bits;
  int64_t count_words, words;  // derived

  Layout(int64_t n_, int64_t capacity_, int64_t chunk_, int64_t count_bytes_,
         int64_t offset_bytes_, int64_t low_bits_)
      : n(n_), capacity(capacity_), chunk(chunk_), count_bytes(count_bytes_),
        offset_bytes(offset_bytes_), low_bits(low_bits_) {
    count_words = (num_chunks() * count_bytes + 3) / 4;
    words = chunk ? count_words + (capacity * offset_bytes + 3) / 4 : capacity;
    if (elias_fano()) words = (high_at() + high_bits() + 31) / 32;
  }
  int64_t num_chunks() const { return chunk ? (n + chunk - 1) / chunk : 0; }
  bool elias_fano() const { return low_bits >= 0; }
  int64_t high_at() const { return capacity * low_bits; }  // bitmap start
  int64_t high_bits() const { return ((n - 1) >> low_bits) + capacity; }
};

// Low bits of the "ef" layout of c >= 1 slots for a vector of n entries:
// max(0, floor(log2(n / c))) (sparse_wire.ef_low_bits). The exact-size
// exchange lays each replica's "ef" stream out for its c used slots
// (sparse_wire.ef_exact_tables); it fits in the words of the capacity's.
inline int64_t EfLowBits(int64_t n, int64_t c) {
  int64_t q = n / c, b = 0;
  while (q > 1) {
    q >>= 1;
    ++b;
  }
  return b;
}

// The "ef" layout of a vector's stream: at its capacity, or with `exact`
// for the `used` slots (used >= 1) in use.
inline Layout EliasFanoFor(const Layout& layout, bool exact, int64_t used) {
  if (!exact) return layout;
  return Layout(layout.n, used, 0, 0, 0, EfLowBits(layout.n, used));
}

// The positions of vector `v` as the "ef" and chunked layouts take them: in
// [0, n], non-decreasing, the padding (n) last. Sets `*used` to the slots
// before the padding.
absl::Status CheckPositions(const int32_t* idx, const Layout& layout, int64_t v,
                            const char* layout_name, int64_t* used) {
  int64_t previous = -1;
  *used = layout.capacity;
  for (int64_t j = 0; j < layout.capacity; ++j) {
    const int64_t p = idx[j];
    if (p < 0 || p > layout.n) {
      return InvalidArgument("positions of vector ", v, " must be in [0, ",
                             layout.n, "], got ", p);
    }
    if (p == layout.n) {
      *used = std::min(*used, j);
      continue;
    }
    if (*used < layout.capacity || p < previous) {
      return InvalidArgument("positions of vector ", v, " must be "
                             "non-decreasing with the padding last for ",
                             layout_name);
    }
    previous = p;
  }
  return absl::OkStatus();
}

// Writes `value` as `nbytes` little-endian bytes (the inverse of ReadLittle).
inline void WriteLittle(unsigned char* at, uint32_t value, int64_t nbytes) {
  for (int64_t b = 0; b < nbytes; ++b) at[b] = (value >> (8 * b)) & 0xff;
}

// The per-vector attributes of TfDctEncode and TfDctGatherSum, checked: one
// Layout per vector given its capacity.
absl::Status ReadLayouts(OpKernelConstruction* ctx, int64_t num,
                         std::vector<int64_t>* ns, std::vector<int64_t>* chunks,
                         std::vector<int64_t>* count_bytes,
                         std::vector<int64_t>* offset_bytes,
                         std::vector<int64_t>* low_bits) {
  TF_RETURN_IF_ERROR(ctx->GetAttr("low_bits", low_bits));
  TF_RETURN_IF_ERROR(ctx->GetAttr("ns", ns));
  TF_RETURN_IF_ERROR(ctx->GetAttr("chunks", chunks));
  TF_RETURN_IF_ERROR(ctx->GetAttr("count_bytes", count_bytes));
  TF_RETURN_IF_ERROR(ctx->GetAttr("offset_bytes", offset_bytes));
  for (const size_t size : {ns->size(), chunks->size(), count_bytes->size(),
                            offset_bytes->size(), low_bits->size()}) {
    if (static_cast<int64_t>(size) != num) {
      return InvalidArgument("ns, chunks, count_bytes, offset_bytes and "
                             "low_bits must have N = ", num, " entries");
    }
  }
  for (int64_t v = 0; v < num; ++v) {
    if ((*ns)[v] < 1 || (*ns)[v] >= INT32_MAX || (*chunks)[v] < 0 ||
        ((*chunks)[v] > 0 && ((*count_bytes)[v] < 1 || (*count_bytes)[v] > 4 ||
                              (*offset_bytes)[v] < 1 ||
                              (*offset_bytes)[v] > 4))) {
      return InvalidArgument("vector ", v, ": n must be in [1, 2^31 - 1) and "
                             "a chunked layout needs 1-4 bytes per count and "
                             "per offset");
    }
    if ((*low_bits)[v] < -1 || (*low_bits)[v] > 30 ||
        ((*low_bits)[v] >= 0 && (*chunks)[v] != 0)) {
      return InvalidArgument("vector ", v, ": low_bits must be -1 (not "
                             "\"ef\") or in [0, 30] with chunk 0, got ",
                             (*low_bits)[v]);
    }
  }
  return absl::OkStatus();
}

REGISTER_OP("TfDctEncode")
    .Input("idx: N * int32")
    .Input("val: N * T")
    .Output("payload: int32")
    .Attr("T: {float, double, bfloat16}")
    .Attr("N: int >= 1")
    .Attr("ns: list(int)")
    .Attr("chunks: list(int)")
    .Attr("count_bytes: list(int)")
    .Attr("offset_bytes: list(int)")
    .Attr("low_bits: list(int)")
    .Attr("exact: bool = false")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    });

// One replica's contribution to the all-gather of several vectors, as one
// int32 vector: every vector's index words (Layout), in vector order, then
// every vector's values, in vector order, ValueWords<T>(capacity) words each.
// With `exact` each "ef" vector's stream is laid out for its used slots
// (EliasFanoFor), zero-filled to the words of its capacity's.
template <typename T>
class EncodeOp : public OpKernel {
 public:
  explicit EncodeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("N", &num_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("exact", &exact_));
    OP_REQUIRES_OK(ctx, ReadLayouts(ctx, num_, &ns_, &chunks_, &count_bytes_,
                                    &offset_bytes_, &low_bits_));
  }

  void Compute(OpKernelContext* ctx) override {
    std::vector<Layout> layouts;
    int64_t index_words = 0, value_words = 0;
    for (int64_t v = 0; v < num_; ++v) {
      const Tensor& idx = ctx->input(v);
      const Tensor& val = ctx->input(num_ + v);
      OP_REQUIRES(ctx, idx.dims() == 1 && val.dims() == 1 &&
                           idx.NumElements() == val.NumElements() &&
                           idx.NumElements() >= 1,
                  InvalidArgument("idx and val of vector ", v, " must be rank "
                                  "1 of one length >= 1, got ",
                                  idx.shape().DebugString(), " and ",
                                  val.shape().DebugString()));
      layouts.emplace_back(ns_[v], idx.NumElements(), chunks_[v],
                           count_bytes_[v], offset_bytes_[v], low_bits_[v]);
      index_words += layouts.back().words;
      value_words += ValueWords<T>(idx.NumElements());
    }
    Tensor* payload_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            0, TensorShape({index_words + value_words}),
                            &payload_t));
    int32_t* payload = payload_t->flat<int32_t>().data();
    int32_t* words = payload;
    auto* values = reinterpret_cast<unsigned char*>(payload + index_words);
    for (int64_t v = 0; v < num_; ++v) {
      const Layout& layout = layouts[v];
      const int32_t* idx = ctx->input(v).flat<int32_t>().data();
      const T* val = ctx->input(num_ + v).flat<T>().data();
      if (layout.elias_fano()) {
        std::fill(words, words + layout.words, 0);
        auto* bits = reinterpret_cast<uint32_t*>(words);
        int64_t used;
        OP_REQUIRES_OK(ctx, CheckPositions(idx, layout, v, "the \"ef\" layout",
                                           &used));
        const Layout ef = EliasFanoFor(layout, exact_ && used > 0, used);
        const int64_t b = ef.low_bits;
        const uint64_t mask = (uint64_t{1} << b) - 1;
        for (int64_t j = 0; j < used; ++j) {
          const int64_t p = idx[j];
          if (b > 0) {
            const int64_t at = j * b;
            const uint64_t low = (static_cast<uint64_t>(p) & mask) << (at & 31);
            bits[at >> 5] |= static_cast<uint32_t>(low);
            if ((at & 31) + b > 32) bits[(at >> 5) + 1] |= low >> 32;
          }
          const int64_t q = ef.high_at() + (p >> b) + j;
          bits[q >> 5] |= uint32_t{1} << (q & 31);
        }
      } else if (layout.chunk == 0) {  // "int32": the positions themselves
        std::memcpy(words, idx, layout.capacity * sizeof(int32_t));
      } else {
        std::fill(words, words + layout.words, 0);
        auto* counts = reinterpret_cast<unsigned char*>(words);
        auto* offsets = reinterpret_cast<unsigned char*>(words + layout.count_words);
        std::vector<uint32_t> count(layout.num_chunks(), 0);
        int64_t used;
        OP_REQUIRES_OK(ctx, CheckPositions(idx, layout, v, "a chunked layout",
                                           &used));
        for (int64_t j = 0; j < used; ++j) {
          const int64_t p = idx[j];
          ++count[p / layout.chunk];
          WriteLittle(offsets + j * layout.offset_bytes,
                      static_cast<uint32_t>(p % layout.chunk),
                      layout.offset_bytes);
        }
        for (int64_t c = 0; c < layout.num_chunks(); ++c) {
          OP_REQUIRES(ctx, layout.count_bytes == 4 ||
                               count[c] < (uint32_t{1} << (8 * layout.count_bytes)),
                      InvalidArgument("vector ", v, ": chunk ", c, " holds ",
                                      count[c], " positions, more than ",
                                      layout.count_bytes, "-byte counts "
                                      "carry"));
          WriteLittle(counts + c * layout.count_bytes, count[c],
                      layout.count_bytes);
        }
      }
      words += layout.words;
      const int64_t bytes = layout.capacity * sizeof(T);
      std::memcpy(values, val, bytes);
      std::fill(values + bytes, values + 4 * ValueWords<T>(layout.capacity),
                0);  // the filler half of an odd count of bfloat16
      values += 4 * ValueWords<T>(layout.capacity);
    }
  }

 private:
  int64_t num_;
  bool exact_;
  std::vector<int64_t> ns_, chunks_, count_bytes_, offset_bytes_, low_bits_;
};

REGISTER_OP("TfDctGatherSum")
    .Input("payload: int32")
    .Input("counts: int32")
    .Output("dense: N * T")
    .Output("nnz: int64")
    .Attr("T: {float, double}")
    .Attr("V: {float, double, bfloat16}")
    .Attr("N: int >= 1")
    .Attr("ns: list(int)")
    .Attr("capacities: list(int)")
    .Attr("chunks: list(int)")
    .Attr("count_bytes: list(int)")
    .Attr("offset_bytes: list(int)")
    .Attr("low_bits: list(int)")
    .Attr("exact: bool = false")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      int64_t num;
      std::vector<int64_t> ns;
      TF_RETURN_IF_ERROR(c->GetAttr("N", &num));
      TF_RETURN_IF_ERROR(c->GetAttr("ns", &ns));
      if (static_cast<int64_t>(ns.size()) != num) {
        return InvalidArgument("ns must have N = ", num, " entries");
      }
      shape_inference::ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &unused));
      for (int64_t v = 0; v < num; ++v) c->set_output(v, c->Vector(ns[v]));
      c->set_output(num, c->Vector(num));
      return absl::OkStatus();
    });

// The sums of every replica's vectors from the gathered payloads (one
// TfDctEncode output per row), and each sum's number of non-zero entries.
// With `exact` the payloads are those of TfDctEncode with `exact`, and
// `counts` ([rows, N]) gives each row's used slots per vector, hence the
// layout of its "ef" streams; otherwise `counts` is not read. The values are
// words of type V, widened to T (the sums' type) before they are added.
template <typename T, typename V>
class GatherSumOp : public OpKernel {
 public:
  explicit GatherSumOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("N", &num_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("exact", &exact_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("capacities", &capacities_));
    OP_REQUIRES(ctx, static_cast<int64_t>(capacities_.size()) == num_,
                InvalidArgument("capacities must have N = ", num_, " entries"));
    OP_REQUIRES_OK(ctx, ReadLayouts(ctx, num_, &ns_, &chunks_, &count_bytes_,
                                    &offset_bytes_, &low_bits_));
    for (int64_t v = 0; v < num_; ++v) {
      OP_REQUIRES(ctx, capacities_[v] >= 1,
                  InvalidArgument("capacities must be >= 1, got ",
                                  capacities_[v]));
      layouts_.emplace_back(ns_[v], capacities_[v], chunks_[v],
                            count_bytes_[v], offset_bytes_[v], low_bits_[v]);
      index_words_ += layouts_.back().words;
      value_words_ += ValueWords<V>(capacities_[v]);
    }
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& payload_t = ctx->input(0);
    OP_REQUIRES(ctx, payload_t.dims() == 2 &&
                         payload_t.dim_size(1) == index_words_ + value_words_,
                InvalidArgument("payload must be [replicas, ",
                                index_words_ + value_words_, "], got ",
                                payload_t.shape().DebugString()));
    const int64_t rows = payload_t.dim_size(0);
    const int64_t width = payload_t.dim_size(1);
    const int32_t* payload = payload_t.flat<int32_t>().data();
    const Tensor& counts_t = ctx->input(1);
    const int32_t* counts = nullptr;
    if (exact_) {
      OP_REQUIRES(ctx, counts_t.dims() == 2 && counts_t.dim_size(0) == rows &&
                           counts_t.dim_size(1) == num_,
                  InvalidArgument("counts must be [replicas, N] = [", rows,
                                  ", ", num_, "], got ",
                                  counts_t.shape().DebugString()));
      counts = counts_t.flat<int32_t>().data();
      for (int64_t row = 0; row < rows; ++row) {
        for (int64_t v = 0; v < num_; ++v) {
          const int64_t c = counts[row * num_ + v];
          OP_REQUIRES(ctx, c >= 0 && c <= layouts_[v].capacity,
                      InvalidArgument("counts of vector ", v, " must be in "
                                      "[0, ", layouts_[v].capacity, "], got ",
                                      c));
        }
      }
    }
    Tensor* nnz_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(num_, TensorShape({num_}), &nnz_t));
    int64_t words_at = 0, values_at = index_words_;
    for (int64_t v = 0; v < num_; ++v) {
      const Layout& layout = layouts_[v];
      Tensor* dense_t;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(v, TensorShape({layout.n}),
                                               &dense_t));
      T* dense = dense_t->flat<T>().data();
      std::fill(dense, dense + layout.n, T(0));
      // Non-zero entries of dense, kept up to date as each addition turns
      // one entry from zero to non-zero or back (-0.0 counts as zero, as in
      // tf.math.count_nonzero).
      int64_t nnz = 0;
      // Replicas in order, each one's slots in order: the additions happen
      // in the order unsorted_segment_sum makes them on the decoded
      // positions, each position from +0.
      for (int64_t row = 0; row < rows; ++row) {
        const int32_t* w = payload + row * width + words_at;
        const auto* values = reinterpret_cast<const unsigned char*>(
            payload + row * width + values_at);
        const auto add = [&](int64_t p, int64_t j) {
          if (p < 0 || p >= layout.n) return;  // padding
          V word;
          std::memcpy(&word, values + j * sizeof(V), sizeof(V));
          const T value = Word<T, V>::Widen(word);
          const T before = dense[p];
          const T after = before + value;
          dense[p] = after;
          nnz += static_cast<int64_t>(after != T(0)) -
                 static_cast<int64_t>(before != T(0));
        };
        if (layout.elias_fano()) {
          // Set bits of the bitmap in order, word by word: the j-th at
          // bitmap bit q is position ((q - j) << b) | low_j.
          const auto* bits = reinterpret_cast<const uint32_t*>(w);
          const int64_t used = exact_ ? counts[row * num_ + v] : layout.capacity;
          if (used == 0) continue;
          const Layout ef = EliasFanoFor(layout, exact_, used);
          const int64_t b = ef.low_bits;
          const uint64_t mask = (uint64_t{1} << b) - 1;
          const int64_t start = ef.high_at();
          const int64_t end = start + ef.high_bits();
          int64_t j = 0;
          for (int64_t word = start >> 5; word * 32 < end && j < ef.capacity;
               ++word) {
            uint32_t set = bits[word];
            if (word == (start >> 5)) set &= ~uint32_t{0} << (start & 31);
            while (set != 0 && j < ef.capacity) {
              const int64_t q = word * 32 + __builtin_ctz(set) - start;
              set &= set - 1;
              uint64_t low = 0;
              if (b > 0) {
                const int64_t at = j * b;
                uint64_t pair = bits[at >> 5];
                if ((at >> 5) + 1 < ef.words) {
                  pair |= static_cast<uint64_t>(bits[(at >> 5) + 1]) << 32;
                }
                low = (pair >> (at & 31)) & mask;
              }
              add(((q - j) << b) | static_cast<int64_t>(low), j);
              ++j;
            }
          }
          continue;
        }
        if (layout.chunk == 0) {
          for (int64_t j = 0; j < layout.capacity; ++j) add(w[j], j);
          continue;
        }
        const auto* counts = reinterpret_cast<const unsigned char*>(w);
        const auto* offsets =
            reinterpret_cast<const unsigned char*>(w + layout.count_words);
        int64_t j = 0;
        for (int64_t c = 0; c < layout.num_chunks() && j < layout.capacity;
             ++c) {
          const int64_t end =
              j + ReadLittle(counts + c * layout.count_bytes, layout.count_bytes);
          for (; j < end && j < layout.capacity; ++j) {
            add(c * layout.chunk +
                    ReadLittle(offsets + j * layout.offset_bytes,
                               layout.offset_bytes),
                j);
          }
        }
      }
      nnz_t->flat<int64_t>()(v) = nnz;
      words_at += layout.words;
      values_at += ValueWords<V>(layout.capacity);
    }
  }

 private:
  int64_t num_, index_words_ = 0, value_words_ = 0;
  bool exact_;
  std::vector<int64_t> ns_, capacities_, chunks_, count_bytes_, offset_bytes_,
      low_bits_;
  std::vector<Layout> layouts_;
};

// Value words V of accumulators T: T itself, or bfloat16 for float.
#define TF_DCT_REGISTER(T, V)                                           \
  REGISTER_KERNEL_BUILDER(Name("TfDctSelect")                           \
                              .Device(DEVICE_CPU)                       \
                              .TypeConstraint<T>("T")                   \
                              .TypeConstraint<V>("V"),                  \
                          SelectOp<T, V>);                              \
  REGISTER_KERNEL_BUILDER(Name("TfDctGatherSum")                        \
                              .Device(DEVICE_CPU)                       \
                              .TypeConstraint<T>("T")                   \
                              .TypeConstraint<V>("V"),                  \
                          GatherSumOp<T, V>)
TF_DCT_REGISTER(float, float);
TF_DCT_REGISTER(double, double);
TF_DCT_REGISTER(float, bfloat16);
#undef TF_DCT_REGISTER
#define TF_DCT_REGISTER(T)                                              \
  REGISTER_KERNEL_BUILDER(                                              \
      Name("TfDctEncode").Device(DEVICE_CPU).TypeConstraint<T>("T"),    \
      EncodeOp<T>)
TF_DCT_REGISTER(float);
TF_DCT_REGISTER(double);
TF_DCT_REGISTER(bfloat16);
#undef TF_DCT_REGISTER

}  // namespace tf_dct
