// Cache misses copied from the pinned host banks straight into their device slots: one kernel per layer.
//
// Why (issue 33, item 2: misses at the link's speed). XLA has no operation that copies a host slice to a
// dynamic device offset: each miss of ftjax's XLA path is a host read into a device temporary (kernels that
// read the pinned pages over PCIe), then a device copy into the slot, one loop iteration per miss, and the
// loop's control between misses leaves the link idle (~20 us of ~210 per 9.44 MB expert on an H200).
// FreeToken issues one host-to-slot copy per miss from the host, after reading the miss list back.
// Here the miss list stays on the device: this kernel reads it, and its blocks read each miss's bytes from
// the host bank through its unified (device-visible) address and write them into the slot, all misses of
// the layer in one launch, no read-back and no host synchronisation (so it also runs inside a CUDA graph).
//
// The FFI target (XLA's typed FFI, jax.ffi.ffi_call; ftjax/experts/slot_copy.py builds and registers it):
//   ftjax_slot_copy(bank, flat_ids, slots, count, pool) -> pool (aliased: updated in place)
//   bank: [N, ...] in host memory (pinned_host); pool: [S, ...] on the device, the same row shape and dtype;
//   flat_ids, slots: int32 [M], M <= 65535 (one block row of the grid per entry; those at or past `count` exit at
//   once); count: int32 [] (the first min(count, M) entries are copied; count <= 0: none).
//   slots[:count] must be distinct: two misses into one slot race (the row is then undefined), where XLA's loop
//   lets the later one win. The slot table never gives one slot twice in a layer.
// ftjax_slot_copy_ptr is the same copy with the bank given as its address (attribute `bank_ptr`, int64, and
// `bank_rows`, the bank's row count) instead of an operand, for XLA builds that refuse a host operand.
// Rows whose flat id or slot is out of range are skipped (XLA's loop would clamp them; the engine never passes
// one). Kernel faults surface as XLA runtime errors when the program runs.
//
// ftjax_slot_copy_start / ftjax_slot_copy_wait (a probe of copies beside compute, experiments/probe_copy_stream.py;
// not used by the engine): _start is the same copy launched on a stream of this library's own, after the
// compute stream's work so far, and returns at once (the pool result aliases the pool, its rows being written);
// _wait(pool, flat_ids, slots, count) makes the compute stream wait for the last _start of the same `tag` (mod
// kTags); its index operands are _start's, passed again so that XLA keeps them alive until the copy has read them.
// Between the two, XLA's kernels run beside the copy: the program must neither read nor write the started pool
// except through the _wait (XLA must not copy it either: check the compiled program), and every _start needs its
// _wait before the program ends. Neither is command-buffer compatible (a copy forked inside a captured call must
// join before it returns), so XLA runs them outside its CUDA graphs. One GPU per process (the first device that
// calls _start; another device's call fails with CUDA's error).
#include <cstdint>
#include <mutex>
#include <string>

#include <cuda_runtime.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // loads in flight per thread before its stores: a PCIe read takes ~1-2 us

// grid: (x: blocks per miss, y: miss index). Each thread copies kUnroll vectors per pass.
template <typename V>
__global__ void SlotCopyKernel(const V* __restrict__ bank, V* __restrict__ pool, const int32_t* __restrict__ ids,
                               const int32_t* __restrict__ slots, const int32_t* __restrict__ count,
                               int64_t row_vecs, int64_t bank_rows, int64_t pool_rows) {
  const int m = blockIdx.y;
  if (m >= *count) return;
  const int64_t id = ids[m], slot = slots[m];
  if (id < 0 || id >= bank_rows || slot < 0 || slot >= pool_rows) return;
  const V* src = bank + id * row_vecs;
  V* dst = pool + slot * row_vecs;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x * kUnroll;
  for (int64_t base = ((int64_t)blockIdx.x * blockDim.x) * kUnroll + threadIdx.x; base < row_vecs;
       base += stride) {
    V v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + (int64_t)u * blockDim.x;
      if (i < row_vecs) v[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + (int64_t)u * blockDim.x;
      if (i < row_vecs) dst[i] = v[u];
    }
  }
}

template <typename V>
void Launch(cudaStream_t stream, const void* bank, void* pool, const int32_t* ids, const int32_t* slots,
            const int32_t* count, int64_t row_bytes, int64_t bank_rows, int64_t pool_rows, int64_t max_misses,
            int blocks_per_miss) {
  const int64_t row_vecs = row_bytes / (int64_t)sizeof(V);
  const int64_t per_block = (int64_t)kThreads * kUnroll;
  int64_t need = (row_vecs + per_block - 1) / per_block;
  const int bx = (int)(need < blocks_per_miss ? (need < 1 ? 1 : need) : blocks_per_miss);
  dim3 grid(bx, (unsigned)max_misses);
  SlotCopyKernel<V><<<grid, kThreads, 0, stream>>>(static_cast<const V*>(bank), static_cast<V*>(pool), ids, slots,
                                                    count, row_vecs, bank_rows, pool_rows);
}

ffi::Error CudaFailure(const char* who, cudaError_t e) {
  return ffi::Error::Internal(std::string(who) + ": " + cudaGetErrorString(e));
}

ffi::Error Copy(cudaStream_t stream, const void* bank, int64_t bank_rows, ffi::Buffer<ffi::S32> ids,
                ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> count, ffi::AnyBuffer pool,
                ffi::Result<ffi::AnyBuffer> out, int64_t blocks_per_miss) {
  auto dims = pool.dimensions();
  if (dims.size() < 1 || dims[0] < 1) return ffi::Error::InvalidArgument("ftjax_slot_copy: empty pool");
  if (out->untyped_data() != pool.untyped_data())
    return ffi::Error::InvalidArgument("ftjax_slot_copy: the pool result must alias the pool operand");
  const int64_t pool_rows = dims[0];
  const int64_t row_bytes = (int64_t)pool.size_bytes() / pool_rows;
  const int64_t m = ids.element_count();
  if ((int64_t)slots.element_count() != m)
    return ffi::Error::InvalidArgument("ftjax_slot_copy: flat_ids and slots differ in length");
  if (m == 0 || row_bytes == 0) return ffi::Error::Success();
  if (m > 65535) return ffi::Error::InvalidArgument("ftjax_slot_copy: more than 65535 misses in one call");
  const int bpm = (int)(blocks_per_miss < 1 ? 1 : blocks_per_miss);
  const uintptr_t align = (uintptr_t)bank | (uintptr_t)pool.untyped_data() | (uintptr_t)row_bytes;
  const int32_t* pi = ids.typed_data();
  const int32_t* ps = slots.typed_data();
  const int32_t* pc = count.typed_data();
  if (align % 16 == 0) {
    Launch<int4>(stream, bank, pool.untyped_data(), pi, ps, pc, row_bytes, bank_rows, pool_rows, m, bpm);
  } else if (align % 4 == 0) {
    Launch<int32_t>(stream, bank, pool.untyped_data(), pi, ps, pc, row_bytes, bank_rows, pool_rows, m, bpm);
  } else {
    Launch<uint8_t>(stream, bank, pool.untyped_data(), pi, ps, pc, row_bytes, bank_rows, pool_rows, m, bpm);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return CudaFailure("ftjax_slot_copy", err);
  return ffi::Error::Success();
}

ffi::Error SlotCopyImpl(cudaStream_t stream, ffi::AnyBuffer bank, ffi::Buffer<ffi::S32> ids,
                        ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> count, ffi::AnyBuffer pool,
                        ffi::Result<ffi::AnyBuffer> out, int64_t blocks_per_miss) {
  auto bd = bank.dimensions();
  if (bd.size() < 1 || bd[0] < 1) return ffi::Error::InvalidArgument("ftjax_slot_copy: a scalar or empty bank");
  const int64_t pool_rows = pool.dimensions().size() ? pool.dimensions()[0] : 0;
  if (bank.element_type() != pool.element_type() || pool_rows < 1 ||
      (int64_t)bank.size_bytes() / bd[0] != (int64_t)pool.size_bytes() / pool_rows)
    return ffi::Error::InvalidArgument("ftjax_slot_copy: bank and pool rows differ in dtype or size");
  return Copy(stream, bank.untyped_data(), bd[0], ids, slots, count, pool, out, blocks_per_miss);
}

ffi::Error SlotCopyPtrImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::S32> slots,
                           ffi::Buffer<ffi::S32> count, ffi::AnyBuffer pool, ffi::Result<ffi::AnyBuffer> out,
                           int64_t bank_ptr, int64_t bank_rows, int64_t blocks_per_miss) {
  if (bank_ptr == 0 || bank_rows < 1)
    return ffi::Error::InvalidArgument("ftjax_slot_copy_ptr: a null bank address or an empty bank");
  return Copy(stream, reinterpret_cast<const void*>(bank_ptr), bank_rows, ids, slots, count, pool, out,
              blocks_per_miss);
}

constexpr int kTags = 64;

struct SideStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t done[kTags] = {};
  cudaError_t error = cudaSuccess;
  cudaEvent_t Done(int64_t tag) const { return done[((tag % kTags) + kTags) % kTags]; }
};

SideStream& Side() {
  static SideStream side;
  static std::once_flag once;
  std::call_once(once, [] {
    cudaError_t e = cudaStreamCreateWithFlags(&side.stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&side.start, cudaEventDisableTiming);
    for (int i = 0; i < kTags && e == cudaSuccess; ++i)
      e = cudaEventCreateWithFlags(&side.done[i], cudaEventDisableTiming);
    side.error = e;
  });
  return side;
}

ffi::Error SlotCopyStartImpl(cudaStream_t stream, ffi::AnyBuffer bank, ffi::Buffer<ffi::S32> ids,
                             ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> count, ffi::AnyBuffer pool,
                             ffi::Result<ffi::AnyBuffer> out, int64_t blocks_per_miss, int64_t tag) {
  SideStream& side = Side();
  if (side.error != cudaSuccess)
    return CudaFailure("ftjax_slot_copy_start", side.error);
  static std::mutex mu;  // one start event: a second thread's record must not fall between this record and wait
  std::lock_guard<std::mutex> lock(mu);
  cudaError_t e = cudaEventRecord(side.start, stream);  // after the compute stream's work so far
  if (e == cudaSuccess) e = cudaStreamWaitEvent(side.stream, side.start, 0);
  if (e != cudaSuccess) return CudaFailure("ftjax_slot_copy_start", e);
  ffi::Error err = SlotCopyImpl(side.stream, bank, ids, slots, count, pool, out, blocks_per_miss);
  if (!err.success()) return err;
  e = cudaEventRecord(side.Done(tag), side.stream);
  if (e != cudaSuccess) return CudaFailure("ftjax_slot_copy_start", e);
  return ffi::Error::Success();
}

ffi::Error SlotCopyWaitImpl(cudaStream_t stream, ffi::AnyBuffer pool, ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::S32>,
                           ffi::Buffer<ffi::S32>, ffi::Result<ffi::AnyBuffer> out, int64_t tag) {
  if (out->untyped_data() != pool.untyped_data())
    return ffi::Error::InvalidArgument("ftjax_slot_copy_wait: the pool result must alias the pool operand");
  SideStream& side = Side();
  if (side.error != cudaSuccess)
    return CudaFailure("ftjax_slot_copy_wait", side.error);
  cudaError_t e = cudaStreamWaitEvent(stream, side.Done(tag), 0);
  if (e != cudaSuccess) return CudaFailure("ftjax_slot_copy_wait", e);
  return ffi::Error::Success();
}

}  // namespace

extern "C" int ftjax_slot_copy_abi() { return 2; }

// (bank, flat_ids, slots, count, pool) -> pool, blocks_per_miss: the binding of ftjax_slot_copy and its _start.
static auto CopyBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Attr<int64_t>("blocks_per_miss");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxSlotCopy, SlotCopyImpl, CopyBinding(), {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxSlotCopyPtr, SlotCopyPtrImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("bank_ptr")
                                  .Attr<int64_t>("bank_rows")
                                  .Attr<int64_t>("blocks_per_miss"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxSlotCopyStart, SlotCopyStartImpl, CopyBinding().Attr<int64_t>("tag"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxSlotCopyWait, SlotCopyWaitImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("tag"));
