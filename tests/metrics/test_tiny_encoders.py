"""The embedded random-weight scorer models (harness/metrics/tiny_encoders.py): determinism, caching,
loading through the production scorers, and the ``tiny`` config value of ``Scorer``. Nothing here needs
open_clip: the tiny CLIP is a transformers CLIPModel, so the default run needs only the base install."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from harness.metrics import rag_igbench as rb
from harness.metrics import tiny_encoders as te
from harness.metrics.encoders import TextEmbedder, TransformersClipScorer

ROOT = Path(__file__).resolve().parents[2]
IMAGES = sorted((ROOT / "harness/datasets/bundled/rag_igbench_sample/images").glob("*"))


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.rglob("*.safetensors")):
        out.update({f"{f.relative_to(directory)}:{k}": v for k, v in load_file(str(f)).items()})
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("harness-cache")


@pytest.fixture(scope="module")
def tiny_clip(cache):
    return te.ensure_tiny_clip(cache)


@pytest.fixture(scope="module")
def tiny_embedder(cache):
    return te.ensure_tiny_text_embedder(cache)


# ------------------------------------------------------------------------------------ build and cache


def test_tiny_clip_is_a_function_of_the_seed(tiny_clip, cache, tmp_path):
    directory = Path(tiny_clip)
    assert directory.name == te.clip_dir_name() and directory.parent == Path(cache)
    assert {"config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"} <= {
        p.name for p in directory.iterdir()}
    marker = json.loads((directory / te.MARKER).read_text())
    assert marker["weights"] == "random-init" and marker["spec"]["seed"] == 0
    again = Path(te.ensure_tiny_clip(tmp_path / "elsewhere", seed=0))
    assert _same(_tensors(directory), _tensors(again))
    other = Path(te.ensure_tiny_clip(tmp_path / "elsewhere", seed=1))
    assert other != again and not _same(_tensors(directory), _tensors(other))


def test_tiny_text_embedder_is_a_function_of_the_seed(tiny_embedder, cache, tmp_path):
    directory = Path(tiny_embedder)
    assert directory.name == te.text_embedder_dir_name() and directory.parent == Path(cache)
    assert json.loads((directory / te.MARKER).read_text())["weights"] == "random-init"
    again = Path(te.ensure_tiny_text_embedder(tmp_path / "elsewhere", seed=0))
    assert _same(_tensors(directory), _tensors(again))
    assert (directory / "tokenizer.json").read_text() == (again / "tokenizer.json").read_text()
    other = Path(te.ensure_tiny_text_embedder(tmp_path / "elsewhere", seed=1))
    assert other != again and not _same(_tensors(directory), _tensors(other))


def test_built_models_are_reused_not_rebuilt(tiny_clip, tiny_embedder, cache, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(te, "build_tiny_clip", fail)
    monkeypatch.setattr(te, "build_tiny_text_embedder", fail)
    assert te.ensure_tiny_clip(cache) == tiny_clip
    assert te.ensure_tiny_text_embedder(cache) == tiny_embedder


def test_a_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken(out, spec=None):
        (Path(out) / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed")

    monkeypatch.setattr(te, "build_tiny_clip", broken)
    with pytest.raises(RuntimeError, match="killed"):
        te.ensure_tiny_clip(tmp_path)
    assert list(tmp_path.iterdir()) == []  # no target, no temporary sibling


def test_home_cache_follows_harness_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    path = te.ensure_tiny_text_embedder()
    assert Path(path).parent == tmp_path / "models"


# ------------------------------------------------------------------------------------------ the scorers


def test_clip_scorer_loads_the_tiny_clip_and_scores_in_range(tiny_clip):
    from safetensors.torch import load_file

    scorer = TransformersClipScorer(tiny_clip, device="cpu")
    texts = ["这是第一张图片，展示了成都火锅的红油锅底和各种新鲜食材"[:25], "a photo of a cat", ""]
    cos = scorer.cosines(IMAGES[:3], texts)
    assert len(cos) == 3 and all(-1.0 <= c <= 1.0 for c in cos)
    assert len(set(cos)) == 3  # inputs matter, even with random weights
    model, processor, tokenizer = scorer._load()
    stored = load_file(str(Path(tiny_clip) / "model.safetensors"))
    assert all(torch.equal(stored[k], v) for k, v in model.state_dict().items() if k in stored)
    assert processor.crop_size["height"] == te.TinyClipSpec().image_size
    ids = tokenizer(["成都火锅，好吃！"])["input_ids"][0]
    # byte-level (CLIP's decoder puts a space at each word end), full-width punctuation kept as the reference does
    assert tokenizer.decode(ids, skip_special_tokens=True).replace(" ", "") == "成都火锅，好吃！"
    # the same numbers by hand: projected features of the model, cosine
    pixels = processor(images=[te_image(p) for p in IMAGES[:3]], return_tensors="pt")["pixel_values"]
    toks = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        img = model.get_image_features(pixel_values=pixels).pooler_output
        txt = model.get_text_features(**toks).pooler_output
    assert cos == pytest.approx(torch.nn.functional.cosine_similarity(img, txt, dim=-1).tolist(), abs=1e-5)
    value = rb.clip_score(IMAGES[:3], texts, scorer)
    assert 0.0 <= value <= 1.0


def te_image(path):
    from PIL import Image

    with Image.open(path) as im:
        return im.convert("RGB")


def test_tiny_clip_builds_and_scores_without_open_clip(tmp_path, monkeypatch):
    """The default run's CLIP score needs only the base install (the old tiny CLIP was an open_clip model)."""
    import sys

    monkeypatch.setitem(sys.modules, "open_clip", None)  # `import open_clip` raises ImportError
    from harness.metrics.scoring import Scorer

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    scorer = Scorer(_cfg(clip_model="tiny"))
    assert isinstance(scorer.clip, TransformersClipScorer)
    assert len(scorer.clip.cosines(IMAGES[:2], ["图片", "风景"])) == 2


def test_clip_on_every_bundled_image_is_fast(tiny_clip):
    import time

    scorer = TransformersClipScorer(tiny_clip, device="cpu")
    scorer._load()
    t0 = time.perf_counter()
    cos = scorer.cosines(IMAGES, ["图片"] * len(IMAGES))
    assert len(cos) == len(IMAGES) > 0
    assert time.perf_counter() - t0 < 10.0  # ~0.3 s on two CPU cores


def test_text_embedder_loads_the_tiny_embedder_pipeline(tiny_embedder):
    emb = TextEmbedder(tiny_embedder, device="cpu")
    texts = ["这是第一张图片，展示了成都火锅", "上海外滩的夜景特别漂亮", "生僻字：龘靐齉爩 and English", "这是第一张图片，展示了成都火锅"]
    vectors = emb.encode(texts)
    parts = emb._loaded
    assert parts["modes"] == ["mean"] and parts["dense"] is not None and parts["normalize"]
    assert vectors.shape == (4, te.TinyTextEmbedderSpec().dense_out)
    assert torch.allclose(vectors.norm(dim=-1), torch.ones(4), atol=1e-5)
    ids = parts["tokenizer"]("龘靐齉爩")["input_ids"]
    assert parts["tokenizer"].unk_token_id is None and len(ids) > 2  # byte-level: no unknown characters
    cos = vectors @ vectors.T
    assert cos[0, 3] == pytest.approx(1.0, abs=1e-5) and cos[0, 1] < 0.999


def test_alignment_with_the_tiny_embedder(tiny_embedder):
    emb = TextEmbedder(tiny_embedder, device="cpu")
    ref = "推荐大家去北京的天安门广场看升旗![](IMG#1)早上五点就要出发，记得带上外套。然后![](IMG#2)结尾"
    assert rb.alignment_score(ref, ref, emb) == pytest.approx(1.0, abs=1e-5)  # identical contexts, by definition
    other = rb.alignment_score("这家咖啡店的拿铁很好喝![](IMG#2)环境也很安静", ref, emb)
    assert 0.0 <= other <= 1.0


# ---------------------------------------------------------------------------------------- Scorer (config)


def _cfg(**kw):
    return SimpleNamespace(**{"rouge_variant": "reference", "clip_model": None, "clip_pretrained": None,
                              "embed_model": None, **kw})


def test_scorer_tiny_builds_lazily_and_describes_random_weights(tmp_path, monkeypatch):
    from harness.metrics.scoring import Scorer

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    scorer = Scorer(_cfg(clip_model="tiny", clip_pretrained="openai", embed_model="tiny"))
    assert scorer.describe() == {
        "clip_model": te.clip_dir_name(), "clip_pretrained": None, "clip_weights": "random-init", "clip_sha256": None,
        "clip_backend": "transformers", "embed_model": te.text_embedder_dir_name(), "embed_weights": "random-init",
        "embed_sha256": None,
        "allow_random_scorers": False, "stopwords": "public", "stopword_count": len(scorer.stopwords),
        "mcq_extraction": "vlmevalkit", **scorer.conformance()}
    assert scorer.describe()["departures"] == [] and scorer.describe()["reference_faults"] == "score"
    assert not (tmp_path / "models").exists()  # describing builds nothing
    assert scorer.clip.name_or_path == str(tmp_path / "models" / te.clip_dir_name())
    assert scorer.embed.name_or_path == str(tmp_path / "models" / te.text_embedder_dir_name())
    assert scorer.clip._loaded is None and scorer.embed._loaded is None  # loaded on first use
    scorer.prepare()
    assert scorer.clip._loaded is not None and scorer.embed._loaded is not None


def test_scorer_describes_other_settings(tiny_embedder):
    from harness.metrics.scoring import Scorer

    plain = Scorer(_cfg()).describe()
    assert plain == {"clip_model": None, "clip_pretrained": None, "clip_weights": None, "clip_sha256": None,
                     "clip_backend": None, "embed_model": None, "embed_weights": None, "embed_sha256": None,
                     "allow_random_scorers": False, "stopwords": "public", "stopword_count": plain["stopword_count"],
                     "mcq_extraction": "vlmevalkit", **Scorer(_cfg()).conformance()}
    assert plain["stopword_count"] == 752  # the public scorer's list (752 distinct lines, a space among them)
    assert plain["departures"] == []
    paper = Scorer(_cfg(clip_model="ViT-L-14", clip_pretrained="openai",
                        embed_model="TencentBAC/Conan-embedding-v1")).describe()
    assert paper["clip_weights"] == "pretrained" and paper["embed_weights"] == "pretrained"
    assert paper["clip_backend"] == "open_clip"
    hf = Scorer(_cfg(clip_model="transformers:openai/clip-vit-large-patch14", clip_pretrained="ignored")).describe()
    assert (hf["clip_backend"], hf["clip_weights"], hf["clip_pretrained"]) == ("transformers", "pretrained", None)
    assert paper["clip_model"] == "ViT-L-14" and paper["clip_pretrained"] == "openai"
    assert Scorer(_cfg(clip_model="ViT-B-32")).describe()["clip_weights"] == "random-init"  # no weights given
    assert Scorer(_cfg(embed_model=tiny_embedder)).describe()["embed_weights"] == "random-init"  # by its marker


def test_score_sample_through_scorer_with_tiny_models(tmp_path, monkeypatch):
    from harness.metrics.scoring import Scorer

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    scorer = Scorer(_cfg(clip_model="tiny", embed_model="tiny"))
    ref = "推荐大家去北京的天安门广场看升旗![](IMG#1)早上五点就要出发![](IMG#3)记得带上外套。"
    raw = json.dumps({"reason": "r", "category": "c", "answer": ref}, ensure_ascii=False)
    s = rb.score_sample(raw, ref, 3, candidate_images=IMAGES[:3], clip=scorer.clip, embed=scorer.embed)
    assert s["error"] is None
    assert s["rouge1"] == pytest.approx(1.0) and s["edit_score"] == 1.0
    assert s["kendall"] == pytest.approx(rb.kendall_scale(1.0, 3, 2))
    assert s["alignment"] == pytest.approx(1.0, abs=1e-5)
    assert 0.0 <= s["clip_score"] <= 1.0
    agg = rb.aggregate([s])
    assert 0.0 <= agg["comprehensive"] <= 1.0
