"""Files the run reads, read and checked before the model loads (issue 26; harness/run/rules_files.py,
docs/validation.md "Files the run reads"). Every bad file here is a real file on disk: truncated, garbage,
the wrong format, the wrong shape, or built for another model. Each refusal is one line naming the key, the
file and what is wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from harness.config.checks import ConfigError
from harness.run.rules_files import validate_files, validate_model_files
from harness.run.rules_model import ModelFacts

ROOT = Path(__file__).resolve().parents[2]
E = 16  # the embedded model: 16 experts per layer, top-4
FACTS = ModelFacts(num_experts=E, experts_per_token=4, vision_depth=4)


def cfg(**over):
    base = {"sere": {"k": None, "rho": 0.0, "protect": 0, "similarity": None, "protection": None},
            "offload": {"policy": None, "trace": None, "resident_summary": None,
                        "lease": {"score": "recency", "predictor": None}},
            "scoring": {"clip_model": None, "clip_pretrained": None, "embed_model": None, "stopwords": None}}
    c = OmegaConf.create(base)
    for k, v in over.items():
        OmegaConf.update(c, k, v, merge=False)
    return c


def refused(c, model=False) -> str:
    with pytest.raises(ConfigError) as e:
        validate_files(c)
        if model:
            validate_model_files(c, FACTS)
    line = str(e.value)
    assert "\n" not in line and " is not allowed: expected " in line
    return line


def truncate(src: Path, dst: Path, keep: float = 0.5) -> Path:
    data = src.read_bytes()
    dst.write_bytes(data[: int(len(data) * keep)])
    return dst


# ---------------------------------------------------------------------------------------------- SERE


@pytest.fixture
def similarity(tmp_path):
    from harness.techniques.sere.calibration import save_similarity

    return save_similarity(tmp_path / "sim.safetensors", {0: torch.eye(E), 1: torch.eye(E)})


def test_a_good_similarity_file_is_accepted(similarity):
    c = cfg(**{"sere.k": 2, "sere.similarity": str(similarity)})
    validate_files(c)
    validate_model_files(c, FACTS)


def test_similarity_truncated(similarity, tmp_path):
    bad = truncate(similarity, tmp_path / "cut.safetensors")
    line = refused(cfg(**{"sere.k": 2, "sere.similarity": str(bad)}))
    assert line.startswith(f"sere.similarity='{bad}' is not allowed") and "not a readable SERE similarity file" in line


def test_similarity_garbage_and_a_torch_pickle(tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(os.urandom(256))
    assert "not a readable SERE similarity file" in refused(cfg(**{"sere.k": 2, "sere.similarity": str(junk)}))
    pt = tmp_path / "sim.pt"
    torch.save({"similarity.0": torch.eye(E)}, pt)
    assert "not a readable SERE similarity file" in refused(cfg(**{"sere.k": 2, "sere.similarity": str(pt)}))


def test_similarity_wrong_shape_nan_and_no_tensors(tmp_path):
    from safetensors.torch import save_file

    from harness.techniques.sere.calibration import save_similarity

    rect = save_similarity(tmp_path / "rect.safetensors", {0: torch.zeros(E, 8)})
    assert "shape [16, 8], not [E, E]" in refused(cfg(**{"sere.k": 2, "sere.similarity": str(rect)}))
    nan = torch.eye(E)
    nan[0, 1] = float("nan")
    p = save_similarity(tmp_path / "nan.safetensors", {0: nan})
    assert "NaN or infinite" in refused(cfg(**{"sere.k": 2, "sere.similarity": str(p)}))
    other = tmp_path / "other.safetensors"
    save_file({"weight": torch.zeros(2)}, str(other))
    assert "no similarity tensors" in refused(cfg(**{"sere.k": 2, "sere.similarity": str(other)}))


def test_similarity_of_another_model(tmp_path):
    from harness.techniques.sere.calibration import save_similarity

    p = save_similarity(tmp_path / "e8.safetensors", {0: torch.eye(8)})
    line = refused(cfg(**{"sere.k": 2, "sere.similarity": str(p)}), model=True)
    assert "8 x 8, the model has 16 experts per layer" in line


def test_similarity_not_read_when_sere_is_off(tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"x")
    validate_files(cfg(**{"sere.similarity": str(junk)}))  # sere.k=null: the run never reads it


def test_protection_truncated_wrong_n_and_other_model(tmp_path):
    from harness.techniques.sere.protection import save_protection

    mask = torch.zeros(E, dtype=torch.bool)
    mask[:2] = True
    good = save_protection(tmp_path / "prot.safetensors", {0: mask}, {"n": 2})
    validate_files(cfg(**{"sere.k": 2, "sere.protect": 2, "sere.protection": str(good)}))
    cut = truncate(good, tmp_path / "cut.safetensors")
    assert "not a readable SERE protection file" in refused(
        cfg(**{"sere.k": 2, "sere.protect": 2, "sere.protection": str(cut)}))
    line = refused(cfg(**{"sere.k": 2, "sere.protect": 3, "sere.protection": str(good)}))
    assert "sere.protect=3" in line and "no scores to derive n=3" in line
    small = save_protection(tmp_path / "p8.safetensors", {0: torch.zeros(8, dtype=torch.bool)})
    assert "8 experts per layer, the model has 16" in refused(
        cfg(**{"sere.k": 2, "sere.protection": str(small)}), model=True)


# ------------------------------------------------------------------------------------------- offload


@pytest.fixture
def trace(tmp_path):
    from harness.techniques.offload.trace import RoutingTrace, save_trace

    n, nl, k = 6, 2, 4
    t = RoutingTrace(ids=torch.randint(0, E, (n, nl, k)), weights=torch.rand(n, nl, k), embeds=torch.zeros(n, 0),
                     request=torch.zeros(n, dtype=torch.long), step=torch.arange(n), layers=torch.arange(nl))
    return save_trace(t, tmp_path / "trace")


def oc(**over):
    return cfg(**{"offload.policy": "lru", **over})


def test_a_good_trace_is_accepted_by_either_name(trace):
    for name in (trace, trace.with_suffix(".json"), trace.with_suffix("")):
        validate_files(oc(**{"offload.trace": str(name)}))
    validate_model_files(oc(**{"offload.trace": str(trace)}), FACTS)


def test_trace_truncated_garbage_missing_tensor_wrong_shape(trace, tmp_path):
    cut = truncate(trace, tmp_path / "cut.pt")
    assert "not a readable routing trace" in refused(oc(**{"offload.trace": str(cut)}))
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"\x80\x04not a pickle")
    assert "not a readable routing trace" in refused(oc(**{"offload.trace": str(junk)}))
    blob = torch.load(trace, weights_only=True)
    del blob["ids"]
    torch.save(blob, tmp_path / "noids.pt")
    assert "it has no 'ids' tensor" in refused(oc(**{"offload.trace": str(tmp_path / "noids.pt")}))
    blob = torch.load(trace, weights_only=True)
    blob["weights"] = blob["weights"][:, :1]
    torch.save(blob, tmp_path / "shape.pt")
    assert "weights has shape" in refused(oc(**{"offload.trace": str(tmp_path / "shape.pt")}))
    (tmp_path / "meta.pt").write_bytes(trace.read_bytes())
    (tmp_path / "meta.json").write_text("{not json")
    assert "not a readable routing trace (JSONDecodeError" in refused(oc(**{"offload.trace": str(tmp_path / "meta.pt")}))


def test_trace_of_another_model(trace):
    from harness.techniques.offload.trace import load_trace, save_trace

    t = load_trace(trace)
    t.ids[0, 0, 0] = 40
    p = save_trace(t, trace.parent / "big")
    assert "names expert 40, the model has 16" in refused(oc(**{"offload.trace": str(p)}), model=True)


def test_predictor_truncated_and_not_a_predictor(tmp_path):
    from harness.techniques.offload.predictor import PredictorSpec, StabilityPredictor, save_predictor

    good = save_predictor(StabilityPredictor(PredictorSpec(hidden_size=8, num_layers=2)), {}, tmp_path / "pred")
    lease = {"offload.policy": "lease", "offload.lease.score": "predictor"}
    validate_files(cfg(**lease, **{"offload.lease.predictor": str(good)}))
    cut = truncate(good, tmp_path / "cut.pt")
    assert "not a readable stability predictor" in refused(cfg(**lease, **{"offload.lease.predictor": str(cut)}))
    torch.save({"state_dict": {}}, tmp_path / "nospec.pt")
    assert "it has no 'spec' entry" in refused(cfg(**lease, **{"offload.lease.predictor": str(tmp_path / "nospec.pt")}))


def test_resident_summary_not_json_wrong_policy_no_speed(tmp_path):
    p = tmp_path / "summary.json"
    for text, wrong in (("{", "not JSON (line 1"), ("[]", "has no offload block"),
                        (json.dumps({"offload": {"policy": "lru", "tokens_per_s": 5}}), "'lru', not 'none'"),
                        (json.dumps({"offload": {"policy": "none", "tokens_per_s": None}}), "not a number > 0")):
        p.write_text(text)
        assert wrong in refused(oc(**{"offload.resident_summary": str(p)}))
    p.write_bytes(b"\xff\xfe")
    assert "not UTF-8" in refused(oc(**{"offload.resident_summary": str(p)}))
    p.write_text(json.dumps({"offload": {"policy": "none", "tokens_per_s": 12.5}}))
    validate_files(oc(**{"offload.resident_summary": str(p)}))


# --------------------------------------------------------------------------------------------- scorers


def test_clip_model_unknown_name_is_refused():
    pytest.importorskip("open_clip")
    line = refused(cfg(**{"scoring.clip_model": "NoSuchClip-99"}))
    assert line.startswith("scoring.clip_model='NoSuchClip-99' is not allowed: expected a CLIP model the scorer "
                           "can load; not a model open_clip knows")
    validate_files(cfg(**{"scoring.clip_model": "ViT-B-32"}))
    assert "neither a file nor a tag of ViT-B-32" in refused(
        cfg(**{"scoring.clip_model": "ViT-B-32", "scoring.clip_pretrained": "nosuchtag"}))


def test_transformers_and_embed_models_need_a_model_directory_or_hub_id(tmp_path):
    validate_files(cfg(**{"scoring.clip_model": "tiny", "scoring.embed_model": "tiny"}))
    validate_files(cfg(**{"scoring.clip_model": "transformers:openai/clip-vit-large-patch14"}))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "has no config.json" in refused(cfg(**{"scoring.clip_model": f"transformers:{empty}"}))
    assert "neither a directory nor a hub id" in refused(cfg(**{"scoring.clip_model": "transformers:/no/such/dir"}))
    assert "has no config.json" in refused(cfg(**{"scoring.embed_model": str(empty)}))


def test_stopwords_not_utf8(tmp_path):
    p = tmp_path / "stop.txt"
    p.write_bytes(b"\xff\xfeword\n")
    assert "not UTF-8 text" in refused(cfg(**{"scoring.stopwords": str(p)}))


# ------------------------------------------------------------------------------------ the command line


def test_python_m_harness_refuses_a_truncated_similarity_before_the_model_loads(similarity, tmp_path):
    bad = truncate(similarity, tmp_path / "cut.safetensors")
    proc = subprocess.run([sys.executable, "-m", "harness", "sere.k=2", f"sere.similarity={bad}", "wandb.mode=disabled",
                           f"hydra.run.dir={tmp_path / 'run'}", f"cache.path={tmp_path / 'cache'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith(f"error: sere.similarity='{bad}' is not allowed") \
        and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "samples.jsonl").exists()
