// The quantized sparse FFN: gate/up rows in their GGUF block format (neuron-major [F, D], as GGUF
// stores ffn_gate / ffn_up), down rows re-blocked per neuron along D ([F, D] in any block format,
// e.g. Q8_0), and the activations x quantized to int8 per block (quant_act.h):
//   gated:     a_i = act(gate_i . x) * (up_i . x + b_up_i)   (integer dots, as llama.cpp)
//   non-gated: a_i = act(up_i . x + b_up_i)
//   y = b_down + sum over active i of a_i * down_t[i]   (float, rows dequantized on the fly)
// Active set: kScores: scores[t][i] > threshold (gate/up rows of the other neurons are never
// read); kOracle: every a_i is computed and |a_i| > threshold (the activations estimate themselves:
// threshold 0 is the dense quantized FFN). Only active neurons' down rows are read. A NaN score or
// activation counts as active (pij_math.h), so a NaN input reaches the output as in a dense FFN.
//
// Work is split into pieces of the candidate neurons (all of them, or those the scores select)
// whose number depends only on the candidate count, never on the thread count; each piece
// accumulates into its own partial output and the partials are summed in piece order, so y is
// bitwise identical run to run and for any number of threads. Decode (T = 1): each piece
// estimates its neurons, prefetches the active ones' down rows into L2 while it goes on, then
// adds them 8 rows per pass over y. Knows nothing of XLA or Python.
#ifndef PIJ_CPU_BACKEND_QSPARSE_FFN_H_
#define PIJ_CPU_BACKEND_QSPARSE_FFN_H_

#include <cstdint>
#include <span>
#include <vector>

#include "cpu_backend/pij_math.h"
#include "cpu_backend/quant_act.h"
#include "cpu_backend/quant_formats.h"
#include "cpu_backend/sparse_ffn.h"
#include "cpu_backend/thread_pool.h"

namespace pij {

struct QFfnWeights {
  const uint8_t* gate = nullptr;  // [F, QRowBytes(gate_type, D)]; nullptr: non-gated FFN
  const uint8_t* up = nullptr;    // [F, QRowBytes(up_type, D)]
  const uint8_t* down = nullptr;  // [F, QRowBytes(down_type, D)]: neuron i's down row along D,
                                  // or with down_groups [F / 32, D * bytes of a block]
  QType gate_type = QType::kQ8_0, up_type = QType::kQ8_0, down_type = QType::kQ8_0;
  // down holds the file's own ffn_down blocks regrouped per 32 neurons (quant_kernels.h
  // AxpyGroup; a 32-weight format, F a multiple of 32): no re-quantization, the file's size.
  bool down_groups = false;
  // gate (and up) rows interleaved by 16 (quant_interleaved.h; F a multiple of 16, Q4_0 / Q4_1
  // / Q8_0, criterion kOracle): each estimate block of 16 neurons is one group's tile. Up rows
  // may stay the file's rows under an interleaved gate when the activation is zero below a zero
  // gate (relu, drelu): then only the neurons whose gate fires read their up row.
  bool gate_interleaved = false;
  bool up_interleaved = false;
  const float* b_up = nullptr;    // [F] or nullptr
  const float* b_down = nullptr;  // [D] or nullptr
  int64_t num_neurons = 0, dim = 0;
};

struct QSparseFfnParams {
  Activation activation = Activation::kSilu;
  Criterion criterion = Criterion::kOracle;  // kScores or kOracle
  float threshold = 0.0f;
  float gate_floor = 0.0f;  // FATReLU's gate threshold (FloorGate, pij_math.h); relu/drelu only
};

struct QSparseFfnScratch {
  QActs act32, act256;
  std::vector<QActView> gate_views, up_views;  // [T]
  std::vector<int32_t> candidates;
  std::vector<uint8_t> marks;
  std::vector<float> partial_y;        // [pieces, chunk tokens, D]
  std::vector<int32_t> partial_count;  // [pieces, chunk tokens]
  std::vector<int64_t> cand_ends;      // [pieces]: candidates up to each piece's end
  std::vector<int64_t> piece_runs;     // [tasks + 1]: the pieces each task runs
  struct Piece {
    std::vector<float> gate, up, act;  // [block neurons, chunk tokens]
    // Per token of the chunk: the piece's active neurons in id order and their a_i. Every
    // token's down rows are summed by AccumulateDown alone, so a token gets the same bits
    // whether it is decoded alone or in a batch (or a prefill).
    std::vector<std::vector<int32_t>> active;
    std::vector<std::vector<float>> coef;
  };
  std::vector<Piece> pieces;
};

// y [T, D], n_active [T]. score_rows: T rows of F floats for kScores, empty for kOracle.
// Preconditions (checked by the caller): D a multiple of each type's block, shapes as stated.
void QSparseFfn(const QFfnWeights& w, std::span<const float* const> x_rows,
                std::span<const float* const> score_rows, const QSparseFfnParams& params, float* y,
                int32_t* n_active, QSparseFfnScratch& scratch, ThreadPool& pool);

}  // namespace pij

#endif  // PIJ_CPU_BACKEND_QSPARSE_FFN_H_
