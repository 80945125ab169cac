"""The plugin's vLLM-version decisions, without vLLM: which MoE constructor of ``qwen3_moe`` it wraps (vLLM
0.26 builds through ``FusedMoE``, 0.27-0.33 through ``FusedMoEFactory``), that the wrapped constructor injects
the routing function and otherwise behaves as the original (a class keeps ``isinstance`` and its class
attributes), and the environment refusals (docs/vllm.md "Versions")."""

from __future__ import annotations

from types import ModuleType

import pytest

from harness.engines.vllm import plugin
from harness.engines.vllm.state import STATE


class _Provider:
    def __init__(self):
        self.asked = []

    def routing_for(self, prefix, num_experts):
        self.asked.append((prefix, num_experts))
        return f"route:{prefix}"


def _module(**globals_):
    mod = ModuleType("fake_qwen3_moe")
    mod.__dict__.update(globals_)
    return mod


@pytest.fixture(autouse=True)
def _clean_state():
    saved = dict(STATE)
    yield
    STATE.clear()
    STATE.update(saved)


def test_v026_style_function_named_fusedmoe_is_wrapped():
    def FusedMoE(**kwargs):          # vLLM 0.26: a factory function under the class's old name
        return kwargs

    mod = _module(FusedMoE=FusedMoE)
    provider = _Provider()
    plugin._patch_factory(provider, module=mod)
    assert STATE["factory_patched"] == "FusedMoE"
    built = mod.FusedMoE(num_experts=8, top_k=2, prefix="model.layers.3.mlp.experts", renormalize=True)
    assert built["custom_routing_function"] == "route:model.layers.3.mlp.experts"
    assert provider.asked == [("model.layers.3.mlp.experts", 8)]
    plugin._patch_factory(provider, module=mod)          # idempotent: not wrapped twice
    assert mod.FusedMoE._harness_original is FusedMoE


def test_factory_preferred_when_both_exist_and_grouped_or_sigmoid_left_alone():
    def FusedMoEFactory(**kwargs):
        return kwargs

    class FusedMoE:                   # 0.27+ modules may still import the layer class for other uses
        pass

    mod = _module(FusedMoEFactory=FusedMoEFactory, FusedMoE=FusedMoE)
    assert plugin.moe_constructor_name(mod) == "FusedMoEFactory"
    plugin._patch_factory(_Provider(), module=mod)
    assert mod.FusedMoE is FusedMoE                      # untouched
    assert "custom_routing_function" not in mod.FusedMoEFactory(use_grouped_topk=True, prefix="layers.0.x")
    assert "custom_routing_function" not in mod.FusedMoEFactory(scoring_func="sigmoid", prefix="layers.0.x")
    given = mod.FusedMoEFactory(custom_routing_function="theirs", prefix="layers.0.x")
    assert given["custom_routing_function"] == "theirs"  # a model's own routing function is kept


def test_a_wrapped_class_still_answers_isinstance_and_class_attributes():
    class FusedMoE:
        KIND = "moe"

        def __init__(self, **kwargs):
            self.kwargs = kwargs

        @classmethod
        def make_expert_params_mapping(cls, n):
            return [f"e{i}" for i in range(n)]

    mod = _module(FusedMoE=FusedMoE)
    plugin._patch_factory(_Provider(), module=mod)
    layer = mod.FusedMoE(num_experts=4, prefix="layers.1.mlp.experts")
    assert type(layer) is FusedMoE and isinstance(layer, mod.FusedMoE)
    assert layer.kwargs["custom_routing_function"] == "route:layers.1.mlp.experts"
    assert mod.FusedMoE.KIND == "moe" and mod.FusedMoE.make_expert_params_mapping(2) == ["e0", "e1"]
    assert issubclass(FusedMoE, mod.FusedMoE)


def test_unknown_vllm_fails_loudly():
    with pytest.raises(RuntimeError, match="none of"):
        plugin.moe_constructor_name(_module(SomethingElse=lambda: None))


def test_routing_simulator_is_refused_with_sere(monkeypatch):
    from harness.engines.vllm.settings import MoeSettings
    from harness.engines.vllm.techniques import ROUTING_SIMULATION_ENV, V1_RUNNER_ENV, plugin_env

    monkeypatch.delenv(V1_RUNNER_ENV, raising=False)
    monkeypatch.setenv(ROUTING_SIMULATION_ENV, "uniform_random")
    with pytest.raises(ValueError, match="routing simulator"):
        plugin_env(None, moe=MoeSettings(top_k=2))
    monkeypatch.delenv(ROUTING_SIMULATION_ENV)
    assert plugin_env(None, moe=MoeSettings(top_k=2))[V1_RUNNER_ENV] == "0"   # 0.29+: V1 runner asked for


def test_micro_batch_overlap_is_refused_where_the_plugin_routes():
    """vLLM's dual-batch overlap runs two micro-batches' MoE layers at once; the routing op's step scratch is one
    per device, so a routed layer refuses it (a layer the plugin leaves alone, and plain configs, build)."""
    from types import SimpleNamespace

    plugin.refuse_micro_batching(SimpleNamespace(enable_dbo=False, ubatch_size=0))
    plugin.refuse_micro_batching(SimpleNamespace())                   # an older vLLM without the fields
    for cfg in (SimpleNamespace(enable_dbo=True, ubatch_size=0), SimpleNamespace(enable_dbo=False, ubatch_size=2)):
        with pytest.raises(NotImplementedError, match="micro-batch"):
            plugin.refuse_micro_batching(cfg)
    plugin.refuse_micro_batching()                                    # no vLLM config in this process: nothing


def test_a_routed_layer_checks_the_current_vllm_config(monkeypatch):
    def refuse(parallel_config=None):
        raise NotImplementedError("micro-batch")

    monkeypatch.setattr(plugin, "refuse_micro_batching", refuse)
    mod = _module(FusedMoE=lambda **kw: kw)
    plugin._patch_factory(_Provider(), module=mod)
    with pytest.raises(NotImplementedError, match="micro-batch"):
        mod.FusedMoE(num_experts=8, prefix="layers.0.mlp.experts")
    assert mod.FusedMoE(custom_routing_function="theirs", prefix="x")["custom_routing_function"] == "theirs"
