"""Pieces of the vLLM lane that need no running engine: the compatibility shims, the plugin's settings,
its top-k (bit for bit the HF router's), its re-routing (the reference semantics) and its decode-row mask."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from harness.engines import compat
from harness.engines.vllm import routing, sere
from harness.engines.vllm.settings import ENV_K, SereSettings
from harness.techniques.sere.reroute import reroute


# ------------------------------------------------------------------------------------------ compat
def test_compat_installs_only_what_is_missing():
    st = compat.install()
    assert compat.install() == st  # idempotent
    if compat.torchvision_available():
        assert not any(st.values())
        return
    assert all(st.values()), st
    import transformers
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor, smart_resize

    assert Qwen2VLImageProcessor is pil.Qwen2VLImageProcessorPil and smart_resize is pil.smart_resize
    from transformers.video_processing_utils import VideoProcessorMixin

    assert transformers.VideoProcessorMixin is VideoProcessorMixin


def test_compat_lets_transformers_and_vllm_load_the_processor(tiny_model_path):
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny_model_path)
    assert type(proc).__name__ == "Qwen3VLProcessor"
    assert type(proc.video_processor).__name__ == "Qwen3VLVideoProcessor"
    import vllm.model_executor.models.qwen3_vl_moe  # noqa: F401 - imports transformers' torchvision module


def test_compat_in_a_fresh_process():
    """Nothing imported before: the shims must work from a cold interpreter (as in vLLM's children)."""
    code = ("from harness.engines import compat; s = compat.install(); "
            "import vllm.model_executor.models.qwen3_vl; print('ok', s)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_plugin_entry_point_is_declared():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("moe_vlm_harness") == "harness.engines.vllm.plugin:register", (
        "pyproject.toml must declare [project.entry-points.\"vllm.general_plugins\"] "
        "moe_vlm_harness = \"harness.engines.vllm.plugin:register\" (and the package be reinstalled)")
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.endpoint_plugins")}
    assert eps.get("moe_vlm_harness_endpoint") == "harness.engines.vllm.endpoint:HarnessEndpoint", (
        "pyproject.toml must declare [project.entry-points.\"vllm.endpoint_plugins\"] (vllm serve's "
        "/harness/techniques; and the package be reinstalled)")


# ---------------------------------------------------------------------------------------- settings
def test_settings_round_trip_and_off_by_default():
    assert SereSettings.from_env({}) is None
    assert SereSettings.from_env({ENV_K: ""}) is None
    s = SereSettings(2, 0.35, "/x/sim.safetensors", "/x/prot.safetensors", 3, "/x/t.jsonl")
    assert SereSettings.from_env(s.env()) == s
    with pytest.raises(RuntimeError, match="SIMILARITY"):
        SereSettings.from_env({ENV_K: "2"})


def test_layer_index_from_prefix():
    assert routing.layer_index("language_model.model.layers.7.mlp.experts") == 7
    assert routing.layer_index("model.layers.12.mlp.experts") == 12
    assert routing.layer_index("model.layers.3.mlp.layers.1.experts") == 1  # the innermost index
    assert routing.layer_index("experts") is None


def test_register_without_sere_patches_nothing():
    """In a fresh process without HARNESS_SERE_*: register() installs the shims only (idempotently)."""
    code = ("import os\n"
            "from harness.engines.vllm import plugin as p\n"
            "p.register(); p.register()\n"
            "from vllm.model_executor.models import qwen3_moe\n"
            "from vllm.v1.worker.gpu_model_runner import GPUModelRunner as R\n"
            "s = p.state()\n"
            "assert s['registered'] and s['sere'] is None and not s['factory_patched'], s\n"
            "assert not getattr(qwen3_moe.FusedMoEFactory, '_harness_sere', False)\n"
            "assert not getattr(R._build_attention_metadata, '_harness_sere', False)\n"
            "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARNESS_SERE_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


# ----------------------------------------------------------------------------------------- routing
def test_stock_topk_is_the_hf_router_bit_for_bit(hf_ref):
    """Same logits in → the HF router's weights and ids, bit for bit (float32), for every MoE layer."""
    gen = torch.Generator().manual_seed(0)
    for layer in hf_ref.model.model.language_model.layers:
        gate = layer.mlp.gate
        hidden = torch.randn(257, gate.hidden_dim, generator=gen) * 3
        with torch.no_grad():
            logits, w_hf, ids_hf = gate(hidden)
            w, ids = routing.stock_topk(logits, gate.top_k, True)
        assert torch.equal(ids, ids_hf)
        assert w.dtype == w_hf.dtype and torch.equal(w, w_hf)


def _sim(e=16, seed=0):
    return torch.rand(e, e, generator=torch.Generator().manual_seed(seed))


def _published(mask):
    """A DecodeRows whose buffer holds ``mask`` (as the runner wrapper writes it); None = nothing published
    yet (a fresh buffer: every row False)."""
    rows = routing.DecodeRows()
    if mask is not None:
        rows.steps.write(torch.device("cpu"), mask)
    return rows


@pytest.mark.parametrize("mask", [None, "all", "some", "none"])
def test_routing_function_reroutes_decode_rows_only(monkeypatch, tmp_path, mask):
    t, e, k = 9, 16, 4
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(t, e, generator=gen) * 4
    masks = {None: None, "all": torch.ones(t, dtype=torch.bool), "none": torch.zeros(t, dtype=torch.bool),
             "some": torch.tensor([1, 0, 1, 1, 0, 0, 1, 0, 1], dtype=torch.bool)}
    row_mask = masks[mask]
    monkeypatch.setattr(routing, "DECODE", _published(row_mask))
    sim, prot = _sim(), torch.zeros(e, dtype=torch.bool)
    prot[[3, 7]] = True
    trace = routing.Trace(str(tmp_path / "trace.jsonl"))
    fn = sere.make_routing_function(5, sim, 2, 0.3, prot, trace)
    w, ids = fn(hidden_states=None, gating_output=logits, topk=k, renormalize=True)
    w0, ids0 = routing.stock_topk(logits, k, True)
    assert ids.dtype == torch.int32 and torch.equal(w, w0)
    if row_mask is None:
        assert torch.equal(ids.long(), ids0)  # no step information: every row False, never re-routed
    else:
        assert torch.equal(ids.long(), reroute(ids0, sim, 2, 0.3, prot, row_mask))
        assert torch.equal(ids[~row_mask].long(), ids0[~row_mask])
    import json

    rec = json.loads((tmp_path / "trace.jsonl").read_text().splitlines()[0])
    assert rec["layer"] == 5 and rec["rows"] == t and rec["prefill_changed"] is False
    assert rec["decode_rows"] == ([] if row_mask is None else row_mask.nonzero().reshape(-1).tolist())


def _fake_runner(q_lens, computed, prompt, max_num_tokens=64):
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    return SimpleNamespace(
        device=torch.device("cpu"), max_num_tokens=max_num_tokens,
        query_start_loc=SimpleNamespace(cpu=qsl),
        input_batch=SimpleNamespace(num_computed_tokens_cpu_tensor=torch.tensor(computed, dtype=torch.int32),
                                    num_prompt_tokens_cpu_tensor=torch.tensor(prompt, dtype=torch.int32)))


def test_decode_rows_from_the_schedulers_counters():
    rows = routing.DecodeRows()
    # req0 decoding (prompt 10, 12 computed), req1 last prefill chunk of ONE token (9 of 10 computed),
    # req2 a chunk crossing no boundary (prefill 0..3 of 20), req3 decoding; 2 padding rows.
    runner = _fake_runner([1, 1, 4, 1], computed=[12, 9, 0, 30], prompt=[10, 10, 20, 5])
    rows.publish(runner, num_tokens=7, num_reqs=4, num_tokens_padded=9)
    got = rows.rows(torch.device("cpu"), 9).tolist()
    assert got == [True, False, False, False, False, False, True, False, False]
    # a recomputation after preemption: prompt 4 + 3 generated tokens recomputed in one chunk
    runner = _fake_runner([7], computed=[0], prompt=[4])
    rows.publish(runner, num_tokens=7, num_reqs=1, num_tokens_padded=None)
    assert rows.rows(torch.device("cpu"), 7).tolist() == [False] * 4 + [True] * 3
    # dummy runs publish no decode row
    rows.dummy += 1
    runner = _fake_runner([1, 1], computed=[12, 30], prompt=[10, 5])
    rows.publish(runner, num_tokens=2, num_reqs=2, num_tokens_padded=None)
    assert rows.rows(torch.device("cpu"), 2).tolist() == [False, False]


# ------------------------------------------------------------------------------- engine set-up (no vLLM)
def test_sere_artifacts_are_calibrated_once_when_not_given(tiny_model_path, tmp_path, monkeypatch):
    from harness.engines.vllm.techniques import resolve_sere
    from harness.techniques.sere.calibration import load_similarity
    from harness.techniques.sere.protection import load_protection

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    assert resolve_sere(SimpleNamespace(k=None), tiny_model_path) is None
    cfg = SimpleNamespace(k=2, rho=0.1, protect=2, similarity=None, protection=None)
    setup = resolve_sere(cfg, tiny_model_path)
    assert setup.similarity_path.startswith(str(tmp_path)) and setup.protection_path.startswith(str(tmp_path))
    sims, _ = load_similarity(setup.similarity_path)
    assert sorted(sims) == [0, 1, 2] and all(s.shape == (16, 16) for s in sims.values())
    prot, _ = load_protection(setup.protection_path, n=setup.protect)
    assert all(int(p.sum()) == 2 for p in prot.values())
    # given paths are used as they are (no model load), and the settings reach the plugin unchanged
    again = resolve_sere(SimpleNamespace(k=2, rho=0.1, protect=2, similarity=setup.similarity_path,
                                         protection=setup.protection_path), tiny_model_path)
    assert again == setup
    settings = SereSettings.from_env(again.env())
    assert (settings.k_primary, settings.rho, settings.protect) == (2, 0.1, 2)
    with pytest.raises(FileNotFoundError):
        resolve_sere(SimpleNamespace(k=2, rho=0.1, protect=0, similarity=str(tmp_path / "nope"),
                                     protection=None), tiny_model_path)
