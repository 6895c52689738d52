// A CPU XLA FFI handler for experiments/probe_host_ffi.py: y = 2 x over float32 elements. The probe asks whether a
// CPU custom call like it runs inside a GPU program's host-compute region (compute_on("device_host")), and at what
// fixed cost against an io_callback: the way a compiled CPU expert kernel could be reached from the decode step
// without a Python callback per layer (issue 33, the CPU as a second link; docs/MISS_POLICY.md).
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static ffi::Error Double(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  const float* in = x.typed_data();
  float* out = y->typed_data();
  for (size_t i = 0, n = x.element_count(); i < n; ++i) out[i] = 2.0f * in[i];
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxProbeDouble, Double,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());

// y = 2 x + bank[row]: x float32 [N, D], bank float32 [R, D] (a host bank, as the expert kernel would read), row
// int32 [] (clamped into [0, R)); an error where D differs. Whether the bank reaches the handler in place, not copied into the host region,
// shows in the call's time against the bank's size.
using Matrix = ffi::Buffer<ffi::F32, 2>;  // aliases: a template's comma would split the handler macro's arguments
using Row = ffi::Buffer<ffi::S32, 0>;
using MatrixOut = ffi::ResultBuffer<ffi::F32, 2>;

static ffi::Error DoubleAddRow(Matrix x, Matrix bank, Row row, MatrixOut y) {
  const int64_t d = bank.dimensions()[1], rows = bank.dimensions()[0];
  if (rows == 0 || x.dimensions()[1] != d || y->element_count() != x.element_count()) {
    return ffi::Error::InvalidArgument("x [N, D] and the bank [R, D] differ in D, the bank is empty, or y is not x's "
                                       "shape");
  }
  int64_t r = row.typed_data()[0];
  r = r < 0 ? 0 : (r >= rows ? rows - 1 : r);
  const float* in = x.typed_data();
  const float* b = bank.typed_data() + static_cast<size_t>(r) * d;
  float* out = y->typed_data();
  for (size_t i = 0, n = x.element_count(); i < n; ++i) out[i] = 2.0f * in[i] + b[i % static_cast<size_t>(d)];
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxProbeDoubleAddRow, DoubleAddRow,
                              ffi::Ffi::Bind()
                                  .Arg<Matrix>()
                                  .Arg<Matrix>()
                                  .Arg<Row>()
                                  .Ret<Matrix>());

// The CPU expert kernel itself (ftjax/experts/native/expert_ffn.c's ftjax_expert_ffn, loaded by the caller) on
// x float32 [N, D] and expert ids int32 [K] (rows of the banks): y float32 [K, N, D]. The kernel's address, its two
// bank descriptors (ftjax_mat, pointing into the pinned host banks in place), a work buffer of at least
// ftjax_expert_ffn_work(...) floats and its row blocks and threads are attributes, fixed when the program is built,
// as the slot-copy kernel takes a bank's address.
typedef int (*ExpertFfn)(const void* gu, const void* dn, const int32_t* ids, int k, int n, const float* x, float* y,
                         int rb1, int rb2, float* work, int threads);
using Ids = ffi::Buffer<ffi::S32, 1>;
using Out3 = ffi::Buffer<ffi::F32, 3>;

static ffi::Error ExpertFfnCall(Matrix x, Ids ids, ffi::ResultBuffer<ffi::F32, 3> y, uint64_t fn, uint64_t gu,
                                uint64_t dn, uint64_t work, int64_t work_floats, int32_t hidden, int32_t experts,
                                int32_t rb1, int32_t rb2, int32_t threads) {
  const int64_t k = ids.dimensions()[0], n = x.dimensions()[0];
  if (x.dimensions()[1] != hidden) return ffi::Error::InvalidArgument("x must be [N, hidden]");
  if (y->dimensions()[0] != k || y->dimensions()[1] != n || y->dimensions()[2] != hidden) {
    return ffi::Error::InvalidArgument("y must be [K, N, D] for ids [K] and x [N, D]");
  }
  for (int64_t i = 0; i < k; ++i) {
    if (ids.typed_data()[i] < 0 || ids.typed_data()[i] >= experts) {
      return ffi::Error::InvalidArgument("an expert id outside [0, experts)");
    }
  }
  (void)work_floats;  // sized by the caller for this k and N (ftjax_expert_ffn_work); kept for the record
  int rc = reinterpret_cast<ExpertFfn>(fn)(reinterpret_cast<const void*>(gu), reinterpret_cast<const void*>(dn),
                                           ids.typed_data(), static_cast<int>(k), static_cast<int>(n),
                                           x.typed_data(), y->typed_data(), rb1, rb2,
                                           reinterpret_cast<float*>(work), threads);
  return rc == 0 ? ffi::Error::Success() : ffi::Error::InvalidArgument("ftjax_expert_ffn refused its arguments");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxProbeExpertFfn, ExpertFfnCall,
                              ffi::Ffi::Bind()
                                  .Arg<Matrix>()
                                  .Arg<Ids>()
                                  .Ret<Out3>()
                                  .Attr<uint64_t>("fn")
                                  .Attr<uint64_t>("gu")
                                  .Attr<uint64_t>("dn")
                                  .Attr<uint64_t>("work")
                                  .Attr<int64_t>("work_floats")
                                  .Attr<int32_t>("hidden")
                                  .Attr<int32_t>("experts")
                                  .Attr<int32_t>("rb1")
                                  .Attr<int32_t>("rb2")
                                  .Attr<int32_t>("threads"));
