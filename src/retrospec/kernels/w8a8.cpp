// w8a8 matmul as an operator a compiled program can call: fbgemm's integer matmul on int8 weights it has prepacked
// (PyTorch's quantized linear, quantized::linear_with_input_q_dq_qweight_dq_output_fp32), the weights held here.
//
// Why hand-written: fbgemm's packed weights are a TorchScript object, which torch.export cannot take as an input
// of a traced program, so a decoder layer in this format could only be several small programs called between the
// matmuls from Python. This file holds the packed weights under an integer handle and exposes the matmul by
// handle, a plain tensor operator: a whole layer traces as one program. No arithmetic is written here; the result
// is fbgemm's, bitwise the same as calling the quantized op directly.
//
//   w8a8_hold(packed) -> handle          keeps the packed weights until w8a8_release(handle)
//   w8a8_mm(x [T, in] float32, already divided by each row's scale; qweight int8 [out, in] (for the shape);
//           handle int64 [1]) -> [T, out] float32: round(x) as int8 times the weights, times their scales
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <mutex>
#include <vector>

namespace {

std::mutex held_lock;
std::vector<c10::IValue> held;  // handle -> packed weights (None once released)

void hold(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  c10::IValue packed = std::move(stack->back());
  stack->pop_back();
  std::lock_guard<std::mutex> guard(held_lock);
  held.push_back(std::move(packed));
  stack->emplace_back(static_cast<int64_t>(held.size() - 1));
}

void release(int64_t handle) {
  std::lock_guard<std::mutex> guard(held_lock);
  if (handle >= 0 && handle < static_cast<int64_t>(held.size())) held[handle] = c10::IValue();
}

at::Tensor w8a8_mm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& handle) {
  TORCH_CHECK(handle.scalar_type() == at::kLong && handle.numel() == 1, "w8a8_mm: handle must be one int64");
  const int64_t h = handle.data_ptr<int64_t>()[0];
  c10::IValue packed;
  {
    std::lock_guard<std::mutex> guard(held_lock);
    TORCH_CHECK(h >= 0 && h < static_cast<int64_t>(held.size()) && !held[h].isNone(),
                "w8a8_mm: no weights are held under handle ", h);
    packed = held[h];
  }
  static const c10::OperatorHandle linear = c10::Dispatcher::singleton().findSchemaOrThrow(
      "quantized::linear_with_input_q_dq_qweight_dq_output_fp32", "");
  torch::jit::Stack stack{x, 1.0, static_cast<int64_t>(128), std::move(packed)};  // unit input scale, zero point
  linear.callBoxed(&stack);
  at::Tensor y = stack[0].toTensor();
  TORCH_CHECK(y.size(1) == qweight.size(0), "w8a8_mm: the held weights have ", y.size(1), " outputs, not ",
              qweight.size(0));
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(retrospec, m) {
  m.def("w8a8_hold(__torch__.torch.classes.quantized.LinearPackedParamsBase packed) -> int",
        torch::CppFunction::makeFromBoxedFunction<&hold>());
  m.def("w8a8_release(int handle) -> ()", &release);
  m.def("w8a8_mm(Tensor x, Tensor qweight, Tensor handle) -> Tensor");
}
TORCH_LIBRARY_IMPL(retrospec, CPU, m) { m.impl("w8a8_mm", &w8a8_mm); }
