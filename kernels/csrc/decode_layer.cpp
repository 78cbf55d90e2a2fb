// One decoder layer of a pure decode step as one op: the same C++ calls ModelRunner._decode_planned made one
// by one (kernels/decode_cpu.py's docstring states what each computes), in the same order on the same
// buffers, so the result is theirs bit for bit; one registry call per layer instead of nine (each ~1-2.5 us
// of dispatch: tests/bench/results.md). Registered as torch.ops.jointrl.decode_layer; built by kernels/build.py.
#include "prelude.h"

namespace jointrl::decode {
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor qk_norm_rope_store(torch::Tensor qkv, torch::Tensor w, double eps, torch::Tensor cos,
                                 torch::Tensor sin, torch::Tensor kv, torch::Tensor slots, int64_t Hq, int64_t Hkv);
std::vector<torch::Tensor> route_softmax_topk(torch::Tensor logits, int64_t k, bool normalize, double scale);
}  // namespace jointrl::decode
namespace jointrl::linear {
torch::Tensor linear_packed(torch::Tensor x, torch::Tensor packed, int64_t O);
}  // namespace jointrl::linear
namespace jointrl::moe {
torch::Tensor moe_experts_packed(torch::Tensor x, torch::Tensor ids, torch::Tensor wts, torch::Tensor gu,
                                 torch::Tensor down, int64_t I);
}  // namespace jointrl::moe
namespace jointrl::paged_attention {
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv, torch::Tensor slots, torch::Tensor ctx, double scale);
}  // namespace jointrl::paged_attention

namespace jointrl::decode_layer {

// x [N, H] (updated in place: x += attention; x += experts) -> the routed expert ids [N, k].
torch::Tensor decode_layer(torch::Tensor x, torch::Tensor w_in, double eps_in, torch::Tensor qkv_p, int64_t qkv_out,
                           torch::Tensor qkn_w, double qk_eps, torch::Tensor cos, torch::Tensor sin, torch::Tensor kv,
                           torch::Tensor slot, torch::Tensor slots, torch::Tensor ctx, double scale, int64_t Hq,
                           int64_t Hkv, torch::Tensor o_p, int64_t H, torch::Tensor w_post, double eps_post,
                           torch::Tensor gate_p, int64_t E, int64_t top_k, bool norm_topk, double route_scale,
                           torch::Tensor gu, torch::Tensor dn, int64_t I) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decode_layer: x [N, H] contiguous");
  const int64_t N = x.size(0);
  auto qkv = linear::linear_packed(decode::rms_norm(x, w_in, eps_in), qkv_p, qkv_out);
  auto q = decode::qk_norm_rope_store(qkv, qkn_w, qk_eps, cos, sin, kv, slot, Hq, Hkv);
  auto out = paged_attention::paged_decode(q, kv, slots, ctx, scale);
  x.add_(linear::linear_packed(out.view({N, -1}), o_p, H));
  auto h = decode::rms_norm(x, w_post, eps_post);
  auto routed = decode::route_softmax_topk(linear::linear_packed(h, gate_p, E), top_k, norm_topk, route_scale);
  x.add_(moe::moe_experts_packed(h, routed[0], routed[1], gu, dn, I));
  return routed[0];
}

}  // namespace jointrl::decode_layer

TORCH_LIBRARY_FRAGMENT(jointrl, m) {
  m.def("decode_layer(Tensor(a!) x, Tensor w_in, float eps_in, Tensor qkv_p, int qkv_out, Tensor qkn_w, float qk_eps, "
        "Tensor cos, Tensor sin, Tensor(b!) kv, Tensor slot, Tensor slots, Tensor ctx, float scale, int Hq, int Hkv, "
        "Tensor o_p, int H, Tensor w_post, float eps_post, Tensor gate_p, int E, int top_k, bool norm_topk, "
        "float route_scale, Tensor gu, Tensor dn, int I) -> Tensor", &jointrl::decode_layer::decode_layer);
}
