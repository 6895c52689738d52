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
