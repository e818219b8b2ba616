// The quantized sparse FFN over one layer of a neuron store (neuron_store.h): qsparse_ffn.h's
// sum over the rows wherever they live (the static part, the cache, or read from the bundle file
// now):
//   gated:     a_i = act(gate_i . x) * (up_i . x + b_up_i)     (integer dots, 8-bit activations)
//   non-gated: a_i = act(up_i . x + b_up_i)
//   y = sum over active i of a_i * down_i
// with the down rows as the store keeps them: neuron rows (a PowerInfer GGUF's ffn_down_t, as
// qsparse_ffn's "rows" layout) or code rows with the file's scale planes (its "groups" layout).
// Active set: kScores (scores[t][i] > threshold: only those neurons are asked of the store) or
// kOracle (every neuron, |a_i| > threshold: the dense FFN at threshold 0, the whole layer read).
//
// The work is qsparse_ffn.cc's: the same fixed pieces of neuron ids, each thread a run of
// consecutive pieces, per piece its candidates 16 at a time (gate and up rows in one tile for
// predicted neurons, the next rows requested as these are read), then per token its active
// neurons' down rows in id order. Overlap: the store starts reading the missing bundles before
// the work begins, and a piece's candidates whose reads are still running are left for later:
// a piece with such candidates is finished after the rest of its thread's run, waiting only for
// its own reads. y is bitwise ops.qsparse_ffn's over the same rows, whatever was resident,
// whatever the threads or the reads' timing. Knows nothing of XLA or Python.
#ifndef PIJ_CPU_BACKEND_DISK_FFN_H_
#define PIJ_CPU_BACKEND_DISK_FFN_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cpu_backend/neuron_store.h"
#include "cpu_backend/pij_math.h"
#include "cpu_backend/quant_act.h"
#include "cpu_backend/sparse_ffn.h"
#include "cpu_backend/thread_pool.h"

namespace pij {

struct DiskFfnParams {
  Activation activation = Activation::kRelu;
  Criterion criterion = Criterion::kScores;  // kScores or kOracle
  float threshold = 0.0f;
  float gate_floor = 0.0f;  // FATReLU's gate threshold (FloorGate, pij_math.h); relu/drelu only
};

struct DiskFfnScratch {
  QActs act32, act256;
  std::vector<QActView> gate_views, up_views;  // [T]
  std::vector<int32_t> candidates;             // neuron ids, ascending
  std::vector<int32_t> ahead;                  // the next layer's guessed ids
  std::vector<uint8_t> marks;
  NeuronLease lease;
  std::vector<float> acts;             // [candidates, chunk tokens]
  std::vector<uint8_t> done;           // [candidates]: acts computed for this chunk
  std::vector<int64_t> cand_ends;      // [pieces]
  std::vector<int64_t> piece_runs;     // [tasks + 1]
  std::vector<float> partial_y;        // [pieces, chunk tokens, D]
  std::vector<int32_t> partial_count;  // [pieces, chunk tokens]
  struct Worker {
    std::vector<float> gate, up, act;  // [16 neurons, chunk tokens], padded to whole vectors
    std::vector<int64_t> late;         // the run's pieces whose reads were running
    std::vector<int32_t> active, ids;  // one token's active neurons: candidate indices, ids
    std::vector<float> coef;
  };
  std::vector<Worker> workers;
};

// y [T, D], n_active [T]; score_rows: T rows of F floats for kScores, empty for kOracle.
// next_rows: empty, or T rows of F floats guessing layer + 1's scores: after this layer's reads
// are queued, the next layer's neurons scoring > threshold in any row are read ahead
// (NeuronStore::Prefetch), so they are in flight while this layer computes.
// Returns "" or the reason the call failed (a read error): then y is unspecified.
std::string DiskSparseFfn(NeuronStore& store, int64_t layer, std::span<const float* const> x_rows,
                          std::span<const float* const> score_rows,
                          std::span<const float* const> next_rows, const DiskFfnParams& params,
                          float* y, int32_t* n_active, DiskFfnScratch& scratch, ThreadPool& pool);

}  // namespace pij

#endif  // PIJ_CPU_BACKEND_DISK_FFN_H_
