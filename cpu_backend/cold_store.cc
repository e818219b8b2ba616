#include "cpu_backend/cold_store.h"

#include <cstdlib>
#include <cstring>
#include <new>

namespace pij {
namespace {

constexpr size_t kAlignment = 64;

void CopyInto(AlignedBytes& dst, const void* src, size_t n) {
  if (src == nullptr || n == 0) return;
  dst = AlignedBytes(n);
  std::memcpy(dst.data(), src, n);
}

}  // namespace

size_t RowTypeSize(RowType t) { return t == RowType::kF32 ? 4 : 2; }

AlignedBytes::AlignedBytes(size_t n) : size_(n) {
  // aligned_alloc needs a size that is a multiple of the alignment.
  void* p = std::aligned_alloc(kAlignment, (n + kAlignment - 1) / kAlignment * kAlignment);
  if (p == nullptr) throw std::bad_alloc();
  ptr_.reset(p);
}

void AlignedBytes::Free::operator()(void* p) const { std::free(p); }

int64_t ColdStore::Add(RowType type, int64_t num_neurons, int64_t dim, const void* gate,
                       const void* up, const void* down_t, const float* b_up) {
  auto rows = std::make_unique<ColdRows>();
  rows->type = type;
  rows->num_neurons = num_neurons;
  rows->dim = dim;
  const size_t matrix = static_cast<size_t>(num_neurons * dim) * RowTypeSize(type);
  CopyInto(rows->gate, gate, matrix);
  CopyInto(rows->up, up, matrix);
  CopyInto(rows->down_t, down_t, matrix);
  CopyInto(rows->b_up, b_up, static_cast<size_t>(num_neurons) * sizeof(float));
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t handle = next_handle_++;
  rows_.emplace(handle, std::move(rows));
  return handle;
}

const ColdRows* ColdStore::Get(int64_t handle) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = rows_.find(handle);
  return it == rows_.end() ? nullptr : it->second.get();
}

bool ColdStore::Remove(int64_t handle) {
  std::lock_guard<std::mutex> lock(mutex_);
  return rows_.erase(handle) > 0;
}

size_t ColdStore::Bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t total = 0;
  for (const auto& [handle, r] : rows_) {
    total += r->gate.size() + r->up.size() + r->down_t.size() + r->b_up.size();
  }
  return total;
}

}  // namespace pij
