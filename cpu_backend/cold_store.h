// Host-resident cold FFN rows, owned by the CPU backend and referenced by an integer handle.
//
// A placed layer's cold neurons (rows [F_hot, F) after the hot-first permutation) are copied here
// once at load, into 64-byte aligned memory, and the custom call names them by handle (an FFI
// attribute) instead of passing them through XLA: they never travel with the program's operands.
// Knows nothing of XLA, CUDA or Python.
#ifndef PIJ_CPU_BACKEND_COLD_STORE_H_
#define PIJ_CPU_BACKEND_COLD_STORE_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

namespace pij {

enum class RowType : int32_t { kF32 = 0, kBf16 = 1, kF16 = 2 };

size_t RowTypeSize(RowType t);

// 64-byte aligned bytes (one cache line / one AVX-512 vector), freed on destruction.
class AlignedBytes {
 public:
  AlignedBytes() = default;
  explicit AlignedBytes(size_t n);
  void* data() const { return ptr_.get(); }
  size_t size() const { return size_; }

 private:
  struct Free {
    void operator()(void* p) const;
  };
  std::unique_ptr<void, Free> ptr_;
  size_t size_ = 0;
};

// One layer's cold rows: gate (optional), up, down_t as [F_cold, D] of `type`; b_up [F_cold] f32
// (optional).
struct ColdRows {
  RowType type = RowType::kF32;
  int64_t num_neurons = 0;  // F_cold
  int64_t dim = 0;          // D
  AlignedBytes gate, up, down_t, b_up;  // gate / b_up empty when absent

  const void* gate_ptr() const { return gate.size() ? gate.data() : nullptr; }
  const float* b_up_ptr() const {
    return b_up.size() ? static_cast<const float*>(b_up.data()) : nullptr;
  }
};

// Handle -> rows. Handles are never reused within a process, so a stale handle is "not found",
// never somebody else's rows.
class ColdStore {
 public:
  // Copies the rows (the caller's buffers may be freed afterwards); nullptr gate / b_up = absent.
  int64_t Add(RowType type, int64_t num_neurons, int64_t dim, const void* gate, const void* up,
              const void* down_t, const float* b_up);
  // nullptr if unknown. The rows stay valid until Remove(handle); callers must not Remove a
  // handle a running computation still uses.
  const ColdRows* Get(int64_t handle) const;
  bool Remove(int64_t handle);
  size_t Bytes() const;

 private:
  mutable std::mutex mutex_;
  std::map<int64_t, std::unique_ptr<ColdRows>> rows_;
  int64_t next_handle_ = 1;
};

}  // namespace pij

#endif  // PIJ_CPU_BACKEND_COLD_STORE_H_
