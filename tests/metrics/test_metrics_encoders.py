"""CLIP and alignment scores on tiny randomly initialised local models (no download)."""

import json

import pytest
import torch

from harness.metrics import rag_igbench as rb
from harness.metrics.encoders import ClipScorer, TextEmbedder

open_clip = pytest.importorskip("open_clip")

TINY_CLIP = "harness-tiny-clip-test"
CHARS = "我爱北京天安门的喜欢图片好看这里是第一张风景美食成都火锅推荐描述文字很多然后结尾"


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """An open_clip config registered under TINY_CLIP and a random checkpoint of it on disk."""
    d = tmp_path_factory.mktemp("clip")
    cfg = {"embed_dim": 16,
           "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 16, "head_width": 16},
           "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}
    (d / f"{TINY_CLIP}.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(d / f"{TINY_CLIP}.json")
    torch.manual_seed(0)
    model, _, preprocess = open_clip.create_model_and_transforms(TINY_CLIP, pretrained=None)
    ckpt = d / "tiny_clip.pt"
    torch.save(model.state_dict(), ckpt)
    return str(ckpt), model.eval(), preprocess


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    from PIL import Image

    g = torch.Generator().manual_seed(1)
    ims = [Image.fromarray((torch.rand(40, 48, 3, generator=g) * 255).to(torch.uint8).numpy()) for _ in range(3)]
    path = tmp_path_factory.mktemp("img") / "one.png"
    ims[0].save(path)
    return ims, str(path)


def _vocab():
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sorted(set(CHARS)) + list("abcdefghijklmnopqrstuvwxyz")
    return {t: i for i, t in enumerate(tokens)}


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A random 1-layer BERT with a local tokenizer, saved as a plain checkpoint (no modules.json)."""
    from transformers import BertConfig, BertModel, BertTokenizer

    d = tmp_path_factory.mktemp("bert")
    vocab = _vocab()
    BertTokenizer(vocab=vocab).save_pretrained(d)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=64)
    BertModel(cfg).save_pretrained(d)
    return d


# ----------------------------------------------------------------------------------------------- CLIP

def test_clip_scorer_matches_the_model(tiny_clip, images):
    ckpt, model, preprocess = tiny_clip
    ims, path = images
    scorer = ClipScorer(TINY_CLIP, pretrained=ckpt, device="cpu")
    assert scorer._loaded is None  # lazy: nothing loaded at construction
    texts = ["第一张图片", "成都火锅", "a photo"]
    cos = scorer.cosines([path] + ims[1:], texts)
    tokenizer = open_clip.get_tokenizer(TINY_CLIP)
    with torch.no_grad():
        img = model.encode_image(torch.stack([preprocess(im.convert("RGB")) for im in ims]))
        txt = model.encode_text(tokenizer(texts))
    expected = torch.nn.functional.cosine_similarity(img, txt, dim=-1)
    assert cos == pytest.approx(expected.tolist(), abs=1e-5)
    assert scorer.cosines([], []) == []


def test_clip_text_is_tokenised_as_the_reference_clip_tokenizer(tiny_clip):
    """The reference scorer tokenises with transformers' CLIPTokenizer: NFC, whitespace runs → one space, lower
    case, no ftfy (open_clip's own tokenizer runs ftfy, which turns full-width Chinese punctuation into ASCII,
    and unescapes HTML). Checked against open_clip's BPE code fed the reference's normalisation."""
    import unicodedata

    from open_clip.tokenizer import whitespace_clean

    ckpt, _, _ = tiny_clip
    ours = ClipScorer(TINY_CLIP, pretrained=ckpt, device="cpu")._load()[2]
    simple = open_clip.get_tokenizer(TINY_CLIP)
    by_hand = open_clip.tokenizer.SimpleTokenizer()
    by_hand.clean_fn = lambda t: whitespace_clean(unicodedata.normalize("NFC", t)).lower()
    texts = ["推荐大家去北京，早上五点就要出发！", "护肤：清洁、精华“面霜”。", "Tom &amp; Jerry  2024\n", "a photo",
             "成都火锅" * 30]  # the last one is longer than the 77-token context
    ids = ours(texts)
    assert ids.shape == (len(texts), 77)
    for row, text in zip(ids.tolist(), texts):
        expected = [by_hand.sot_token_id, *by_hand.encode(text), by_hand.eot_token_id]
        if len(expected) > 77:
            expected = [*expected[:76], by_hand.eot_token_id]
        assert row == expected + [0] * (77 - len(expected)), text
    # the difference that matters: full-width punctuation survives (open_clip's ftfy makes it ASCII)
    decoded = by_hand.decode([i for i in ids[0].tolist() if i])
    assert "，" in decoded and "！" in decoded and "," not in decoded and "!" not in decoded
    assert not torch.equal(ids[0], simple([texts[0]])[0])
    assert torch.equal(simple([texts[0]])[0], simple(["推荐大家去北京,早上五点就要出发!"])[0])
    assert torch.equal(ids[3], simple([texts[3]])[0])  # plain text: the same tokens either way


def test_clip_score_range_and_mapping(tiny_clip, images):
    ckpt, _, _ = tiny_clip
    ims, _ = images
    scorer = ClipScorer(TINY_CLIP, pretrained=ckpt, device="cpu")
    contexts = ["这里是第一张图片很好看" * 5, "", "成都火锅推荐"]
    value = rb.clip_score(ims, contexts, scorer)
    cos = scorer.cosines(ims, [c[:25] for c in contexts])
    assert 0.0 <= value <= 1.0
    assert value == pytest.approx(sum(rb.clip_map(c) for c in cos) / 3)
    assert rb.clip_score([], [], scorer) == 0.0


def test_clip_score_mapping_with_known_cosines():
    seen = []

    def fake(images, texts):
        seen.extend(texts)
        return [0.25, 0.5, 0.05, 0.4]

    assert rb.clip_score([1, 2, 3, 4], ["x" * 30, "y", "z", "w"], fake) == pytest.approx((0.5 + 1 + 0 + 1) / 4)
    assert seen[0] == "x" * 25  # first 25 characters only


# ------------------------------------------------------------------------------------------ alignment

def test_alignment_mapping_with_known_cosines():
    def fake(texts):  # model contexts → (1, 0); reference contexts → (cos θ, sin θ) with cos θ = 0.85
        half = len(texts) // 2
        return [[1.0, 0.0]] * half + [[0.85, (1 - 0.85**2) ** 0.5]] * half

    pred = "图一![](IMG#1)说明，图二![](IMG#2)说明，图九![](IMG#9)"
    ref = "图二![](IMG#2)不同的说明，图一![](IMG#1)不同"
    assert rb.alignment_score(pred, ref, fake) == pytest.approx(0.5)
    assert rb.alignment_score(pred, "没有图片", fake) == 0.0  # no shared image
    assert rb.alignment_score("", ref, fake) == 0.0


def test_text_embedder_mean_pooling_without_modules(tiny_bert):
    from transformers import AutoModel, AutoTokenizer

    emb = TextEmbedder(str(tiny_bert), device="cpu")
    assert emb._loaded is None
    texts = ["我爱北京天安门", "成都火锅推荐很好看", "图片"]
    got = emb.encode(texts)
    tok, model = AutoTokenizer.from_pretrained(tiny_bert), AutoModel.from_pretrained(tiny_bert).eval()
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    expected = (hidden * mask).sum(1) / mask.sum(1)
    assert got.shape == (3, 16) and torch.allclose(got, expected, atol=1e-5)


def test_text_embedder_follows_sentence_transformers_modules(tiny_bert, tmp_path):
    """CLS pooling, a Dense projection and Normalize, declared the sentence-transformers way."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModel, AutoTokenizer

    d = tmp_path / "st"
    shutil.copytree(tiny_bert, d)
    (d / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
        {"idx": 3, "name": "3", "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]))
    (d / "1_Pooling").mkdir()
    (d / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 16, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    (d / "2_Dense").mkdir()
    (d / "2_Dense" / "config.json").write_text(json.dumps(
        {"in_features": 16, "out_features": 8, "bias": True,
         "activation_function": "torch.nn.modules.linear.Identity"}))
    torch.manual_seed(2)
    w, b = torch.randn(8, 16), torch.randn(8)
    save_file({"linear.weight": w, "linear.bias": b}, str(d / "2_Dense" / "model.safetensors"))
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32, "do_lower_case": False}))

    texts = ["我爱北京天安门", "图片好看"]
    got = TextEmbedder(str(d), device="cpu").encode(texts)
    tok, model = AutoTokenizer.from_pretrained(tiny_bert), AutoModel.from_pretrained(tiny_bert).eval()
    with torch.no_grad():
        cls = model(**tok(texts, padding=True, return_tensors="pt")).last_hidden_state[:, 0]
    expected = torch.nn.functional.normalize(cls @ w.T + b, dim=-1)
    assert got.shape == (2, 8) and torch.allclose(got, expected, atol=1e-5)


def test_alignment_score_with_tiny_embedder(tiny_bert):
    emb = TextEmbedder(str(tiny_bert), device="cpu")
    common = "我爱北京天安门![](IMG#1)图片好看" + "很多" * 10  # more than 20 characters after the tag
    pred, ref = common + "成都火锅![](IMG#2)推荐", common
    value = rb.alignment_score(pred, ref, emb)
    assert value == pytest.approx(1.0, abs=1e-5)  # identical context for the one shared image
    other = rb.alignment_score("成都火锅推荐![](IMG#1)很多然后结尾", ref, emb)
    assert 0.0 <= other <= 1.0


def test_score_sample_with_tiny_models(tiny_clip, tiny_bert, images):
    ckpt, _, _ = tiny_clip
    ims, path = images
    clip = ClipScorer(TINY_CLIP, pretrained=ckpt, device="cpu")
    emb = TextEmbedder(str(tiny_bert), device="cpu")
    raw = '{"reason": "r", "category": "c", "answer": "我爱北京![](IMG#1)天安门，成都火锅![](IMG#3)"}'
    ref = "我爱北京![](IMG#1)天安门，图片![](IMG#2)"
    s = rb.score_sample(raw, ref, 3, candidate_images=[path, ims[1], ims[2]], clip=clip, embed=emb)
    assert s["error"] is None
    for m in rb.METRICS:
        assert 0.0 <= s[m] <= 1.0
    agg = rb.aggregate([s, rb.score_sample("oops", ref, 3, candidate_images=ims, clip=clip, embed=emb)])
    assert agg["comprehensive"] == pytest.approx(rb.comprehensive(*(s[m] for m in rb.METRICS)) / 2)
