"""Real-shape models of every family (issue 29; ``harness.models.real_shapes``, ``conf/model/<arch>_shapes.yaml``).

- the real width at reduced depth, built on the meta device (no memory): each checkpoint's tensors of one dense
  and one MoE layer as its safetensors have them (transformers' fused expert layout), and the parameter count at
  full depth = the published total (Mixtral-8x7B 46.70 B, DeepSeek-V2-Lite 15.71 B, OLMoE-1B-7B 6.92 B, gpt-oss-20b
  20.91 B, Qwen2-57B-A14B 57.41 B, Qwen3-30B-A3B 30.53 B; Qwen3.5-35B-A3B's text model 34.66 B, counted
  from its config.json); the family the harness finds in it, its MoE blocks and
  its routing rule's top-k;
- a tiny width of the same config built on the CPU through the HF engine's entry (``shapes_model_for_engine``): a
  forward on ``synthetic_ids`` gives finite logits, the ids avoid every special id (Mixtral's sit at the bottom of
  the vocabulary), the family's settings apply (GPT-OSS: eager attention, transformers' experts instead of the
  fused kernel), and the ``_shapes`` config composes, validates and names the arch.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from harness.models.real_shapes import (ARCHS, _hf_config, family_settings, shapes_config, shapes_model_for_engine,
                                        synthetic_ids, text_parameters)

TEXT_ARCHS = [a for a, spec in ARCHS.items() if spec["vision"] is None]

#: arch → (published total parameters, {tensor of the 2-layer model: shape}) — the checkpoints' shapes, written out
#: from their config.json (heads × head dims, experts × intermediate sizes), not read back from the code
EXPECTED: dict[str, tuple[int, dict[str, tuple[int, ...]]]] = {
    "qwen3_30b_a3b": (30_532_122_624, {
        "model.embed_tokens.weight": (151936, 2048), "model.layers.1.self_attn.q_proj.weight": (32 * 128, 2048),
        "model.layers.1.self_attn.k_proj.weight": (4 * 128, 2048), "model.layers.1.mlp.gate.weight": (128, 2048),
        "model.layers.1.mlp.experts.gate_up_proj": (128, 2 * 768, 2048),
        "model.layers.1.mlp.experts.down_proj": (128, 2048, 768)}),
    "mixtral_8x7b": (46_702_792_704, {
        "model.embed_tokens.weight": (32000, 4096), "model.layers.1.self_attn.q_proj.weight": (32 * 128, 4096),
        "model.layers.1.self_attn.k_proj.weight": (8 * 128, 4096), "model.layers.1.mlp.gate.weight": (8, 4096),
        "model.layers.1.mlp.experts.gate_up_proj": (8, 2 * 14336, 4096),
        "model.layers.1.mlp.experts.down_proj": (8, 4096, 14336)}),
    "deepseek_v2_lite": (15_706_484_224, {
        "model.embed_tokens.weight": (102400, 2048), "model.layers.0.mlp.gate_proj.weight": (10944, 2048),
        "model.layers.1.self_attn.q_proj.weight": (16 * (128 + 64), 2048),
        "model.layers.1.self_attn.kv_a_proj_with_mqa.weight": (512 + 64, 2048),
        "model.layers.1.self_attn.kv_b_proj.weight": (16 * (128 + 128), 512),
        "model.layers.1.self_attn.o_proj.weight": (2048, 16 * 128), "model.layers.1.mlp.gate.weight": (64, 2048),
        "model.layers.1.mlp.experts.gate_up_proj": (64, 2 * 1408, 2048),
        "model.layers.1.mlp.experts.down_proj": (64, 2048, 1408),
        "model.layers.1.mlp.shared_experts.gate_proj.weight": (2 * 1408, 2048)}),
    "olmoe_1b_7b": (6_919_161_856, {
        "model.embed_tokens.weight": (50304, 2048), "model.layers.1.self_attn.q_proj.weight": (2048, 2048),
        "model.layers.1.self_attn.k_norm.weight": (2048,), "model.layers.1.mlp.gate.weight": (64, 2048),
        "model.layers.1.mlp.experts.gate_up_proj": (64, 2 * 1024, 2048),
        "model.layers.1.mlp.experts.down_proj": (64, 2048, 1024)}),
    "gpt_oss_20b": (20_914_757_184, {
        "model.embed_tokens.weight": (201088, 2880), "model.layers.1.self_attn.q_proj.weight": (64 * 64, 2880),
        "model.layers.1.self_attn.k_proj.weight": (8 * 64, 2880), "model.layers.1.self_attn.sinks": (64,),
        "model.layers.1.mlp.router.weight": (32, 2880), "model.layers.1.mlp.router.bias": (32,),
        "model.layers.1.mlp.experts.gate_up_proj": (32, 2880, 2 * 2880),
        "model.layers.1.mlp.experts.down_proj": (32, 2880, 2880)}),
    "qwen2_57b_a14b": (57_408_658_944, {
        "model.embed_tokens.weight": (151936, 3584), "model.layers.1.self_attn.q_proj.weight": (28 * 128, 3584),
        "model.layers.1.self_attn.q_proj.bias": (28 * 128,), "model.layers.1.self_attn.k_proj.weight": (4 * 128, 3584),
        "model.layers.1.mlp.gate.weight": (64, 3584), "model.layers.1.mlp.experts.gate_up_proj": (64, 2 * 2560, 3584),
        "model.layers.1.mlp.experts.down_proj": (64, 3584, 2560),
        "model.layers.1.mlp.shared_expert.gate_proj.weight": (20480, 3584)}),
    # 30 Gated DeltaNet layers (q/k 16 heads x 128, v and the output gate z 32 x 128, conv kernel 4, per-head a/b/dt/A)
    # + 10 gated full-attention layers (q and its gate 2 x 16 x 256, k/v 2 x 256), each with 256 experts of 512 + a
    # shared expert of 512 and its scalar gate; embedding and head of 248320 x 2048
    "qwen3_5_35b_a3b": (
        2 * 248320 * 2048 + 2048
        + 40 * (256 * 2048 + 256 * (2 * 512 * 2048 + 2048 * 512) + 3 * 512 * 2048 + 2048 + 2 * 2048)
        + 30 * ((2 * 2048 + 4096) * 2048 + 4096 * 2048 + 2 * 32 * 2048 + 8192 * 4 + 2 * 32 + 128 + 2048 * 4096)
        + 10 * (2 * 16 * 256 * 2048 + 2 * 2 * 256 * 2048 + 2048 * 16 * 256 + 2 * 256), {
            "model.embed_tokens.weight": (248320, 2048), "model.layers.0.linear_attn.in_proj_qkv.weight": (8192, 2048),
            "model.layers.0.linear_attn.in_proj_z.weight": (4096, 2048),
            "model.layers.0.linear_attn.conv1d.weight": (8192, 1, 4), "model.layers.1.mlp.gate.weight": (256, 2048),
            "model.layers.1.mlp.experts.gate_up_proj": (256, 2 * 512, 2048),
            "model.layers.1.mlp.experts.down_proj": (256, 2048, 512),
            "model.layers.1.mlp.shared_expert.gate_proj.weight": (512, 2048),
            "model.layers.1.mlp.shared_expert_gate.weight": (1, 2048)}),
}

#: arch → text overrides of a CPU-sized model with the same structure (expert / head / MLA keys of its family)
TINY: dict[str, dict] = {
    "qwen3_30b_a3b": dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, num_experts=8, moe_intermediate_size=32, vocab_size=2048),
    "mixtral_8x7b": dict(hidden_size=64, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=2048),
    "deepseek_v2_lite": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
                             num_key_value_heads=4, n_routed_experts=8, kv_lora_rank=32, qk_rope_head_dim=16,
                             qk_nope_head_dim=16, v_head_dim=16, vocab_size=2048),
    "olmoe_1b_7b": dict(hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
                        num_experts=16, vocab_size=2048),
    "gpt_oss_20b": dict(hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, num_local_experts=8, sliding_window=4, vocab_size=2048),
    "qwen2_57b_a14b": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                           shared_expert_intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                           num_experts=16, vocab_size=2048),
    "qwen3_5_35b_a3b": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                            moe_intermediate_size=32, shared_expert_intermediate_size=32, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                            vocab_size=2048),
}


def _meta_model(config):
    import transformers

    with torch.device("meta"):
        return getattr(transformers, config["architectures"][0])._from_config(_hf_config(config))


@pytest.mark.parametrize("arch", TEXT_ARCHS)
def test_real_width_at_two_layers_has_the_checkpoints_tensors(arch):
    from harness.models.families import family_of
    from harness.models.moe_blocks import find_moe_blocks

    total, tensors = EXPECTED[arch]
    config = shapes_config(arch, num_layers=2)
    model = _meta_model(config)
    got = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert {n: got.get(n) for n in tensors} == tensors
    assert not any(".layers.2." in n for n in got)
    family = family_of(model)
    assert family is not None and family.name == ARCHS[arch]["family"]
    moe_layers = [ref.layer for ref in find_moe_blocks(model)]
    assert moe_layers == ([1] if arch == "deepseek_v2_lite" else [0, 1])  # DeepSeek's first layer is dense
    k = ARCHS[arch]["text"]["num_experts_per_tok"]
    router = next(n for n in tensors if n.endswith(("mlp.gate.weight", "mlp.router.weight")))
    logits = torch.randn(3, tensors[router][0])  # [tokens, experts]
    weights, ids = family.routing_rule(model.config).stock(logits, k)
    assert ids.shape == weights.shape == (3, k)
    if arch == "gpt_oss_20b":
        assert config["layer_types"] == ["sliding_attention", "full_attention"]
    if arch == "qwen3_5_35b_a3b":  # cut shorter than its pattern: one full-attention layer kept, the last
        assert config["layer_types"] == ["linear_attention", "full_attention"]
        full = shapes_config(arch)["layer_types"]
        assert len(full) == 40 and full[3::4] == ["full_attention"] * 10 and full.count("linear_attention") == 30
    assert text_parameters(shapes_config(arch)) == total


@pytest.mark.parametrize("arch", TEXT_ARCHS)
def test_tiny_width_builds_on_cpu_and_runs_a_forward(arch):
    cfg = SimpleNamespace(arch=arch, num_layers=2, text=TINY[arch], vision=None, reuse=False)
    model, processor, info = shapes_model_for_engine(cfg, "cpu", "float32", None, seed=0)
    spec = ARCHS[arch]
    assert info["family"] == spec["family"] and info["checkpoint_shapes_of"] == spec["checkpoint"]
    assert info["weights"] == "random-init" and info["num_layers"] == 2
    assert info["parameters"] == text_parameters(info["config"])
    special = {v for k, v in info["config"].items() if k.endswith("_token_id") and isinstance(v, int)}
    assert processor.tokenizer.eos_token_id == info["config"]["eos_token_id"] == model.generation_config.eos_token_id
    ids = synthetic_ids(64, 3, model.config)
    assert not special & set(ids) and max(ids) < 2048
    if arch == "mixtral_8x7b":  # bos 1 / eos 2 at the bottom: the ids are drawn above them
        assert special == {1, 2} and min(ids) > 2
    text_ids = processor.tokenizer("shapes")["input_ids"]
    assert not special & set(text_ids)
    experts, attn, notes = family_settings(arch, "harness_fused_moe", "sdpa")  # what a CUDA run would ask for
    if arch == "gpt_oss_20b":  # transformers has no SDPA for sinks; the fused kernel cannot read its experts
        assert (experts, attn, set(notes)) == (None, "eager", {"attn_implementation", "experts_implementation"})
        assert model.config._attn_implementation == "eager" and "attn_implementation" in info["family_settings"]
    else:
        assert (experts, attn, notes) == ("harness_fused_moe", "sdpa", {}) and "family_settings" not in info
    with torch.inference_mode():
        logits = model(torch.tensor([ids[:12] + text_ids])).logits
    assert logits.shape == (1, 12 + len(text_ids), 2048) and torch.isfinite(logits).all()


def test_shapes_configs_compose_and_validate_for_every_arch():
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from harness.config.paths import CONF_DIR
    from harness.config.schema import register_configs
    from harness.run.validate import ConfigError, validate_config

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(Path(CONF_DIR)), version_base=None):
            for arch in TEXT_ARCHS:
                cfg = compose("config", overrides=[f"model={arch}_shapes", "dataset=synthetic_load",
                                                   "engine.device=cpu", "sere.k=1", "moe.top_k=2"])
                assert cfg.model.shapes.arch == arch and cfg.model.weights == "random-init"
                validate_config(cfg)
            arch = "deepseek_v2_lite"  # one arch for the engine / text-only rules (they read ARCHS, not the name)
            vllm = compose("config", overrides=[f"model={arch}_shapes", "dataset=synthetic_load", "engine=vllm"])
            validate_config(vllm)  # the text-only shapes models run in vLLM with dummy weights
            bad = compose("config", overrides=[f"model={arch}_shapes", "dataset=synthetic_load", "dataset.n_images=1"])
            with pytest.raises(ConfigError, match="dataset.n_images"):
                validate_config(bad)
    finally:
        GlobalHydra.instance().clear()
