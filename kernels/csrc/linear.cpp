// The C++ of kernels/linear_cpu.py (its docstring states what each op computes and guarantees), registered
// as torch.ops.jointrl.* ops; built by kernels/build.py.
#include "prelude.h"
#include "panel.h"

namespace jointrl::linear {

torch::Tensor linear_packed(torch::Tensor x, torch::Tensor packed, int64_t O) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && packed.is_contiguous() && packed.dim() == 3 &&
              packed.size(2) == 16 && packed.size(1) == x.size(1) && packed.size(0) == (O + 15) / 16 &&
              x.scalar_type() == packed.scalar_type(),
              "linear_packed: x [N, K] and packed [ceil(O/16), K, 16] contiguous, one dtype");
  auto y = torch::empty({x.size(0), O}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "linear_packed", [&] {
    // prefetched 4 KB ahead of the first pass over each panel, as moe_cpu's experts are (tests/bench/results.md)
    linear_rows<scalar_t>(x.data_ptr<scalar_t>(), x.size(0), x.size(1), packed.data_ptr<scalar_t>(), O,
                          y.data_ptr<scalar_t>(), 4096);
  });
  return y;
}

}  // namespace jointrl::linear

TORCH_LIBRARY_FRAGMENT(jointrl, m) {
  m.def("linear_packed(Tensor x, Tensor packed, int O) -> Tensor", &jointrl::linear::linear_packed);
}
