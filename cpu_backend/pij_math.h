// Scalar math shared by the CPU kernels and the CUDA kernels: activations and 16-bit float
// conversions. Everything here is header-only and `PIJ_HOST_DEVICE`, so the CPU kernel is a
// faithful oracle for the CUDA kernel (same formulas, same constants).
#ifndef PIJ_CPU_BACKEND_PIJ_MATH_H_
#define PIJ_CPU_BACKEND_PIJ_MATH_H_

#include <cstdint>

#include <bit>
#include <cmath>

#if defined(__CUDACC__)
#define PIJ_HOST_DEVICE __host__ __device__
#else
#define PIJ_HOST_DEVICE
#endif

namespace pij {

// Storage types for 16-bit weights. Distinct structs (not uint16_t aliases) so templates and
// overloads can tell bfloat16 from float16.
struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

// Activation functions, numbered as the FFI attribute decoder maps them. kDrelu is dReLU
// (TurboSparse, PowerInfer's "bamboo"): ReLU on the gate AND on the up projection, so a gated
// neuron is active only when both are positive (see GatedActivate); on a non-gated FFN it is ReLU.
enum class Activation : int32_t { kSilu = 0, kRelu = 1, kGelu = 2, kDrelu = 3 };

PIJ_HOST_DEVICE inline float BitsToF32(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  return std::bit_cast<float>(bits);
#endif
}

PIJ_HOST_DEVICE inline uint32_t F32ToBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return std::bit_cast<uint32_t>(f);
#endif
}

// bfloat16 is the top half of a float32, so widening is exact: a shift.
PIJ_HOST_DEVICE inline float ToF32(Bf16 v) { return BitsToF32(uint32_t{v.bits} << 16); }

// Round-to-nearest-even narrowing (NaN kept quiet), matching ml_dtypes / jnp.astype(bfloat16).
PIJ_HOST_DEVICE inline Bf16 ToBf16(float f) {
  uint32_t bits = F32ToBits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return Bf16{static_cast<uint16_t>((bits >> 16) | 0x40u)};
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return Bf16{static_cast<uint16_t>(bits >> 16)};
}

// IEEE half -> float, exact for every input including subnormals, inf and NaN. Portable bit
// manipulation so the same code runs on hosts without F16C and on the device.
PIJ_HOST_DEVICE inline float ToF32(F16 v) {
  const uint32_t sign = uint32_t{v.bits & 0x8000u} << 16;
  const uint32_t exponent = (v.bits >> 10) & 0x1fu;
  const uint32_t mantissa = v.bits & 0x3ffu;
  if (exponent == 0x1f) return BitsToF32(sign | 0x7f800000u | (mantissa << 13));  // inf / NaN
  if (exponent != 0) return BitsToF32(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  // Zero or subnormal: mantissa * 2^-24, exact in float32.
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
  return sign ? -magnitude : magnitude;
}

PIJ_HOST_DEVICE inline float ToF32(float v) { return v; }

PIJ_HOST_DEVICE inline float Relu(float v) { return v > 0.0f ? v : 0.0f; }

// x * sigmoid(x), as jax.nn.silu.
PIJ_HOST_DEVICE inline float Silu(float v) { return v / (1.0f + expf(-v)); }

// The tanh approximation of GELU, as jax.nn.gelu(approximate=True), llama.cpp's ggml_gelu and
// HF's "gelu_pytorch_tanh". Chosen over erf-exact GELU because it is what the GeGLU checkpoints
// we target were trained with and it is cheaper; the reference uses the same formula.
PIJ_HOST_DEVICE inline float Gelu(float v) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  constexpr float kCubicCoeff = 0.044715f;
  return 0.5f * v * (1.0f + tanhf(kSqrt2OverPi * (v + kCubicCoeff * v * v * v)));
}

// Active-set tests, written so NaN (and inf) count as active: `|a| > t` is false for a NaN, which
// silently dropped a NaN neuron and turned a NaN input into an all-zero FFN output. A non-finite
// activation or predictor score must reach the output, as it does in a dense FFN.
PIJ_HOST_DEVICE inline bool ActiveByMagnitude(float a, float threshold) {
  return !(fabsf(a) <= threshold);
}
PIJ_HOST_DEVICE inline bool SelectedByScore(float score, float threshold) {
  return !(score <= threshold);
}

PIJ_HOST_DEVICE inline float Activate(Activation act, float v) {
  switch (act) {
    case Activation::kRelu:
    case Activation::kDrelu:
      return Relu(v);
    case Activation::kGelu:
      return Gelu(v);
    case Activation::kSilu:
    default:
      return Silu(v);
  }
}

// FATReLU's gate (ProSparse's activation threshold shifting): a relu-family neuron whose gate dot
// is at most `floor` (> 0) is off, its activation 0; above it relu(gate) is the gate itself. A
// NaN gate stays NaN (it must reach the output). floor 0 leaves the gate as it is (plain ReLU).
PIJ_HOST_DEVICE inline float FloorGate(float gate, float floor) {
  return floor > 0.0f && gate <= floor ? 0.0f : gate;
}

// A gated neuron's activation from its gate and up dots (up bias included): act(gate) * up, or
// relu(gate) * relu(up) for dReLU. Every kernel computes gated activations through this one
// function, so CPU and CUDA agree on each activation's meaning.
PIJ_HOST_DEVICE inline float GatedActivate(Activation act, float gate, float up) {
  return Activate(act, gate) * (act == Activation::kDrelu ? Relu(up) : up);
}

}  // namespace pij

#endif  // PIJ_CPU_BACKEND_PIJ_MATH_H_
