"""VisionZip in the HF engine (Qwen3-VL-MoE tiny model): pruned prompts generate consistently.

What is checked, and against what:

(a) keep = 1 forced through the pruning machinery = stock ``generate``, token for token; keep = 1 unforced
    installs nothing.
(b) the prompt shrinks by exactly the pruned visual tokens; kept tokens and the text after them keep their
    unpruned mRoPE positions (stock ``get_rope_index`` on the unpruned prompt); ``rope_deltas`` and the
    positions ``generate`` feeds to decode steps continue at max unpruned position + 1.
(c) pruned ``generate`` = a hand-built greedy reference: own scoring (q/k recomputed from the block input,
    reference ``attention_received``), own pruned ``inputs_embeds``/positions/deepstack, full re-forward of
    the language model at every step (no KV cache).
(d) a left-padded batch of requests with different image counts/sizes = each request alone.
(e) one budget per request selects differently from one budget per image (text-dense + plain images).
(f) the deepstack injection receives exactly the pruned (or contextually merged) features at the kept
    image positions.
"""

from __future__ import annotations

import inspect
import random

import pytest
import torch

from harness.config.schema import VisionZipConfig
from harness.engines.hf.visionzip import (
    prepare_visionzip_inputs,
    supports_visionzip,
    visionzip_enabled,
    visionzip_generation,
)
from harness.techniques.visionzip.pruning import (
    attention_received,
    budget,
    compress_image,
    merge_unit_scores,
    merge_units,
    select_tokens,
)

NEW_TOKENS = 5


# ------------------------------------------------------------------------------------------ set-up


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from harness.models.tiny import TinyModelSpec, ensure_tiny_model

    path = ensure_tiny_model(TinyModelSpec(), cache_dir=tmp_path_factory.mktemp("vz-model"))
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(path)
    processor.tokenizer.padding_side = "left"
    return model, processor


@pytest.fixture(scope="module")
def images():
    from harness.datasets.synthetic.rag_igbench import plain_scene_image, text_dense_image

    rng = random.Random(0)
    return {
        "dense_big": text_dense_image(rng, 128, 96),  # 6×8 patches → 12 LLM tokens
        "scene_small": plain_scene_image(rng, 96, 64),  # 4×6 → 6
        "dense_small": text_dense_image(rng, 64, 64),  # 4×4 → 4
        "dense_sq": text_dense_image(rng, 128, 128),  # 8×8 → 16
        "scene_sq": plain_scene_image(rng, 128, 128),  # 8×8 → 16
    }


def _request(imgs: list, words: tuple[str, ...] = ("what", "answer", "more")) -> tuple[list, list[dict]]:
    """Images interleaved with text, so text sits between and after images."""
    parts: list[dict] = []
    for i, _ in enumerate(imgs):
        parts += [{"type": "image"}, {"type": "text", "text": words[i % len(words)]}]
    return imgs, parts


def _batch(processor, requests):
    texts = [processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                           tokenize=False) for _, parts in requests]
    flat = [img for imgs, _ in requests for img in imgs]
    return dict(processor(text=texts, images=flat or None, return_tensors="pt", padding=True))


def _cfg(keep=0.5, contextual=0.0, scope="request", layer=-1, min_per_image=1):
    return VisionZipConfig(keep=keep, contextual=contextual, scope=scope, layer=layer, min_per_image=min_per_image)


def _eos(model):
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def _trim(ids: list[int], eos: set[int]) -> list[int]:
    n = next((j + 1 for j, t in enumerate(ids) if t in eos), len(ids))
    return ids[:n]


def _stock(model, processor, inputs, n=NEW_TOKENS):
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False, pad_token_id=processor.tokenizer.pad_token_id)
    return [_trim(r, _eos(model)) for r in out[:, inputs["input_ids"].shape[1]:].tolist()]


def _pruned(model, processor, inputs, cfg, force=False, n=NEW_TOKENS):
    pad = processor.tokenizer.pad_token_id
    with torch.inference_mode():
        new, ctx = prepare_visionzip_inputs(model, inputs, cfg, pad_token_id=pad, force=force)
        with visionzip_generation(model, ctx):
            out = model.generate(**new, max_new_tokens=n, do_sample=False, pad_token_id=pad)
    tokens = [_trim(r, _eos(model)) for r in out[:, new["input_ids"].shape[1]:].tolist()]
    return tokens, new, ctx


def _stock_positions(model, inputs):
    pos, deltas = model.model.get_rope_index(
        inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"],
        image_grid_thw=inputs["image_grid_thw"], attention_mask=inputs["attention_mask"],
    )
    return pos, deltas


def _image_columns(model, inputs, row: int, sizes_of_row: list[int]) -> list[torch.Tensor]:
    """Columns of each image's tokens in one row of the unpruned prompt."""
    cols = (inputs["input_ids"][row] == model.config.image_token_id).nonzero().reshape(-1)
    return list(cols.split(sizes_of_row))


def _merge(model) -> int:
    return model.config.vision_config.spatial_merge_size


def _sizes(model, inputs) -> list[int]:
    return (inputs["image_grid_thw"].prod(-1) // _merge(model) ** 2).tolist()


def _rows_images(model, inputs) -> list[list[int]]:
    sizes, out, j = _sizes(model, inputs), [], 0
    for count in (inputs["input_ids"] == model.config.image_token_id).sum(1).tolist():
        mine = []
        while count > 0:
            mine.append(j)
            count -= sizes[j]
            j += 1
        out.append(mine)
    return out


MIXED = [("dense_big", "scene_small"), ("dense_small",), ("scene_sq", "dense_small", "scene_small")]


def _mixed_batch(tiny, images, which=MIXED):
    model, processor = tiny
    return _batch(processor, [_request([images[k] for k in names]) for names in which])


# --------------------------------------------------------------------------------------- (a) no-op


def test_model_is_supported_and_keep_one_is_off(tiny, images):
    model, processor = tiny
    assert supports_visionzip(model)
    assert not visionzip_enabled(_cfg(keep=1.0)) and visionzip_enabled(_cfg(keep=0.7))
    inputs = _mixed_batch(tiny, images)
    new, ctx = prepare_visionzip_inputs(model, inputs, _cfg(keep=1.0), pad_token_id=processor.tokenizer.pad_token_id)
    assert ctx is None and new.keys() == inputs.keys() and all(new[k] is inputs[k] for k in inputs)
    with visionzip_generation(model, None):
        assert "get_image_features" not in model.model.__dict__ and "get_rope_index" not in model.model.__dict__


def test_forced_keep_one_equals_stock_generate(tiny, images):
    model, processor = tiny
    inputs = _mixed_batch(tiny, images)
    stock = _stock(model, processor, inputs)
    calls = []
    handle = model.model.visual.register_forward_hook(lambda *a: calls.append(1))
    try:
        tokens, new, ctx = _pruned(model, processor, inputs, _cfg(keep=1.0), force=True)
    finally:
        handle.remove()
    assert tokens == stock
    assert len(calls) == 1 and ctx.vision_calls == 1  # the vision tower ran once, in the preparation
    assert torch.equal(new["input_ids"], inputs["input_ids"])
    pos, deltas = _stock_positions(model, inputs)
    assert torch.equal(new["position_ids"][1:], pos) and torch.equal(ctx.rope_deltas, deltas)
    # everything restored after the context
    assert "get_image_features" not in model.model.__dict__ and "get_rope_index" not in model.model.__dict__


# ----------------------------------------------------------------------- (b) lengths and positions


@pytest.mark.parametrize("scope,contextual", [("request", 0.0), ("image", 0.0), ("request", 0.3), ("image", 0.4)])
def test_prompt_shrinks_and_positions_stay_original(tiny, images, scope, contextual):
    model, processor = tiny
    keep = 0.5
    inputs = _mixed_batch(tiny, images)
    unpruned_pos, _ = _stock_positions(model, inputs)
    sizes, rows = _sizes(model, inputs), _rows_images(model, inputs)

    seen = []  # position_ids handed to the language model, per forward
    handle = model.model.language_model.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(kwargs["position_ids"].clone()), with_kwargs=True)
    try:
        tokens, new, ctx = _pruned(model, processor, inputs, _cfg(keep, contextual, scope), n=3)
    finally:
        handle.remove()

    image_id = model.config.image_token_id
    old_len = inputs["attention_mask"].sum(1)
    new_len = new["attention_mask"].sum(1)
    L = new["input_ids"].shape[1]
    assert L == int(new_len.max())  # re-padded to the longest pruned row, on the left
    for b, imgs in enumerate(rows):
        n = [sizes[j] for j in imgs]
        if scope == "image":
            expected = [min(s, max(1, budget(keep, s))) for s in n]
            assert ctx.requests[b].kept_per_image == expected
        total = max(budget(keep, sum(n)), sum(min(1, s) for s in n))
        stats = ctx.requests[b]
        assert stats.tokens_per_image == n and stats.visual_tokens_before == sum(n)
        assert stats.visual_tokens_after == sum(stats.kept_per_image) == total
        assert int(old_len[b] - new_len[b]) == sum(n) - total
        row = new["input_ids"][b]
        assert int((row == image_id).sum()) == total
        assert bool(new["attention_mask"][b, : L - int(new_len[b])].eq(0).all())  # left padding
        assert bool(new["attention_mask"][b, L - int(new_len[b]):].eq(1).all())

        # kept columns, computed here from the kept indices: text columns + kept image columns
        old_real = inputs["attention_mask"][b].bool()
        keep_col = old_real.clone()
        for j, cols in zip(imgs, _image_columns(model, inputs, b, n)):
            flag = torch.zeros(len(cols), dtype=torch.bool)
            flag[ctx.kept_indices[j]] = True
            keep_col[cols[~flag]] = False
        expected_pos = unpruned_pos[:, b, keep_col]
        got_pos = new["position_ids"][1:, b, L - int(new_len[b]):]
        assert torch.equal(got_pos, expected_pos)
        assert torch.equal(new["input_ids"][b, L - int(new_len[b]):], inputs["input_ids"][b, keep_col])
        # text after an image keeps its unpruned position: the last prompt token's position is unchanged
        assert torch.equal(got_pos[:, -1], unpruned_pos[:, b, -1])
        # rope_deltas from the pruned length; decode continues at max unpruned position + 1
        max_pos = int(unpruned_pos[:, b, old_real].max())
        assert int(ctx.rope_deltas[b]) == max_pos + 1 - int(new_len[b])
        assert int(new_len[b]) + int(ctx.rope_deltas[b]) == max_pos + 1
        for step in (1, 2):
            decode = seen[step][1:, b, -1]
            assert decode.tolist() == [max_pos + step] * 3, (b, step)
    assert seen[0].shape[-1] == L and seen[1].shape[-1] == 1
    assert model.model.rope_deltas is not ctx.rope_deltas  # restored after the context


def test_forward_without_position_ids_uses_pruned_positions_and_rope_deltas(tiny, images):
    """Outside generate: a forward without position_ids (patched get_rope_index) and a cached decode step
    that falls back on rope_deltas give the same logits as explicit positions."""
    model, processor = tiny
    inputs = _batch(processor, [_request([images["dense_big"], images["scene_small"]])])
    pad = processor.tokenizer.pad_token_id
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def cache_of(out):
        return getattr(out, "cache", None) if cache_kw == "cache" else out.past_key_values

    with torch.inference_mode():
        new, ctx = prepare_visionzip_inputs(model, inputs, _cfg(0.4), pad_token_id=pad)
        base = {k: v for k, v in new.items() if k != "position_ids"}
        with visionzip_generation(model, ctx):
            explicit = model(**new, use_cache=True)
            implicit = model(**base, use_cache=True)
            torch.testing.assert_close(implicit.logits, explicit.logits, rtol=0, atol=0)
            nxt = explicit.logits[:, -1].argmax(-1, keepdim=True)
            max_pos = int(ctx.unpruned_position_ids.max())
            pos = torch.full((4, 1, 1), max_pos + 1)
            pos[0] = new["input_ids"].shape[1]
            step_explicit = model(input_ids=nxt, position_ids=pos, use_cache=True, **{cache_kw: cache_of(explicit)})
            step_implicit = model(input_ids=nxt, use_cache=True, **{cache_kw: cache_of(implicit)})
    torch.testing.assert_close(step_implicit.logits, step_explicit.logits, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------ (c) hand-built reference


@torch.inference_mode()
def _reference_scores(model, inputs, layer=-1):
    """Own scoring: block input captured, q/k recomputed, rotary applied by hand, reference column sums."""
    attn = model.model.visual.blocks[layer].attn
    got = {}

    def pre(mod, args, kwargs):
        got["h"], got["cu"], got["pe"] = args[0], kwargs["cu_seqlens"], kwargs["position_embeddings"]

    handle = attn.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        out = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"], return_dict=True)
    finally:
        handle.remove()
    h = got["h"]
    q, k, _ = attn.qkv(h).reshape(h.shape[0], 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    cos, sin = (t.unsqueeze(-2).float() for t in got["pe"])

    def rot(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    scores = attention_received(rot(q), rot(k), got["cu"])
    sizes = _sizes(model, inputs)
    ds = out.deepstack_features
    levels = [list(level) if not isinstance(level, torch.Tensor) else list(level.split(sizes)) for level in ds]
    return merge_unit_scores(scores, inputs["image_grid_thw"], _merge(model)), list(out.pooler_output), levels, k


@torch.inference_mode()
def _reference_generate(model, inputs, kept: list[torch.Tensor], pooled, levels, n):
    """Greedy decoding by full re-forward of the language model on a hand-built pruned prompt."""
    image_id = model.config.image_token_id
    unpruned_pos, _ = _stock_positions(model, inputs)
    sizes, rows = _sizes(model, inputs), _rows_images(model, inputs)
    embed = model.model.get_input_embeddings()
    seqs = []  # per row: embeddings [n, D], positions [3, n], is-image [n], deepstack rows per level
    for b, imgs in enumerate(rows):
        real = inputs["attention_mask"][b].bool()
        ids = inputs["input_ids"][b]
        image_cols = {}
        for j, cols in zip(imgs, _image_columns(model, inputs, b, [sizes[j] for j in imgs])):
            for u, c in enumerate(cols.tolist()):
                image_cols[c] = (j, u)
        emb, pos, is_img, ds_rows = [], [], [], [[] for _ in levels]
        kept_sets = {j: kept[j].tolist() for j in imgs}
        for c in real.nonzero().reshape(-1).tolist():
            if int(ids[c]) == image_id:
                j, u = image_cols[c]
                if u not in kept_sets[j]:
                    continue
                r = kept_sets[j].index(u)
                emb.append(pooled[j][r])
                for lvl in range(len(levels)):
                    ds_rows[lvl].append(levels[lvl][j][r])
                is_img.append(True)
            else:
                emb.append(embed(ids[c]))
                is_img.append(False)
            pos.append(unpruned_pos[:, b, c])
        seqs.append((emb, pos, is_img, ds_rows))

    generated = [[] for _ in seqs]
    lm = model.model.language_model
    for _ in range(n):
        L = max(len(s[0]) for s in seqs)
        B, D = len(seqs), model.config.text_config.hidden_size
        E = torch.zeros(B, L, D)
        P = torch.zeros(4, B, L, dtype=torch.long)
        M = torch.zeros(B, L, dtype=torch.long)
        V = torch.zeros(B, L, dtype=torch.bool)
        for b, (emb, pos, is_img, _) in enumerate(seqs):
            s = L - len(emb)
            E[b, s:] = torch.stack(emb)
            P[1:, b, s:] = torch.stack(pos, dim=1)
            P[0, b, s:] = torch.arange(len(emb))
            M[b, s:] = 1
            V[b, s:] = torch.tensor(is_img)
        ds = [torch.stack([r for _, _, _, d in seqs for r in d[lvl]]) for lvl in range(len(levels))]
        hidden = lm(inputs_embeds=E, attention_mask=M, position_ids=P, use_cache=False,
                    visual_pos_masks=V, deepstack_visual_embeds=ds).last_hidden_state
        nxt = model.lm_head(hidden[:, -1]).argmax(-1)
        for b, (emb, pos, is_img, _) in enumerate(seqs):
            t = int(nxt[b])
            generated[b].append(t)
            emb.append(embed(nxt[b]))
            pos.append(pos[-1] + 1)
            is_img.append(False)
    return [_trim(g, _eos(model)) for g in generated]


def test_pruned_generate_equals_hand_built_reference(tiny, images):
    model, processor = tiny
    keep, scope = 0.5, "request"
    inputs = _mixed_batch(tiny, images, which=[("dense_big", "scene_small"), ("dense_small",)])
    scores, pooled, levels, _ = _reference_scores(model, inputs)
    kept = [None] * len(scores)
    for imgs in _rows_images(model, inputs):
        for j, sel in zip(imgs, select_tokens([scores[j] for j in imgs], keep, scope, 1)):
            kept[j] = sel
    tokens, new, ctx = _pruned(model, processor, inputs, _cfg(keep, 0.0, scope), n=NEW_TOKENS)
    for j in range(len(kept)):
        assert torch.equal(ctx.kept_indices[j], kept[j]), j  # same selection as the reference scoring
        torch.testing.assert_close(ctx.image_scores[j], scores[j], rtol=1e-4, atol=1e-5)
    kept_pooled = [pooled[j][kept[j]] for j in range(len(kept))]
    kept_levels = [[lvl[j][kept[j]] for j in range(len(kept))] for lvl in levels]
    reference = _reference_generate(model, inputs, kept, kept_pooled, kept_levels, NEW_TOKENS)
    assert tokens == reference


# --------------------------------------------------------------------------------------- (d) batch


@pytest.mark.parametrize("scope,contextual", [("request", 0.0), ("image", 0.25)])
def test_batched_equals_each_request_alone(tiny, images, scope, contextual):
    model, processor = tiny
    cfg = _cfg(0.5, contextual, scope)
    batch_tokens, new, ctx = _pruned(model, processor, _mixed_batch(tiny, images), cfg)
    kept_counts = {sum(r.kept_per_image) for r in ctx.requests}
    assert len(kept_counts) > 1  # the rows really lost different numbers of tokens
    assert len(set(new["attention_mask"].sum(1).tolist())) > 1
    for b, names in enumerate(MIXED):
        alone_tokens, _, alone_ctx = _pruned(model, processor, _mixed_batch(tiny, images, which=[names]), cfg)
        assert alone_tokens[0] == batch_tokens[b], names
        assert alone_ctx.requests[0] == ctx.requests[b]


# ------------------------------------------------------------------------------------ (e) scopes


def test_request_scope_moves_tokens_between_images(tiny, images):
    model, processor = tiny
    inputs = _batch(processor, [_request([images["dense_sq"], images["scene_sq"]])])
    _, _, per_request = _pruned(model, processor, inputs, _cfg(0.5, 0.0, "request"), n=1)
    _, _, per_image = _pruned(model, processor, inputs, _cfg(0.5, 0.0, "image"), n=1)
    assert per_image.requests[0].kept_per_image == [8, 8]  # two 16-token images, half each
    assert sum(per_request.requests[0].kept_per_image) == 16  # same total budget ...
    assert per_request.requests[0].kept_per_image != [8, 8]  # ... shared unevenly by score
    assert any(not torch.equal(a, b) for a, b in zip(per_request.kept_indices, per_image.kept_indices))
    # the request-wide top-k keeps exactly the 16 best scores of the request
    flat = torch.cat(per_request.image_scores)
    best = set(torch.argsort(-flat, stable=True)[:16].tolist())
    chosen = set(per_request.kept_indices[0].tolist()) | {16 + i for i in per_request.kept_indices[1].tolist()}
    assert chosen == best


# --------------------------------------------------------------------------------- (f) deepstack


@pytest.mark.parametrize("contextual", [0.0, 0.4])
def test_deepstack_features_pruned_with_the_same_indices(tiny, images, monkeypatch, contextual):
    model, processor = tiny
    inputs = _mixed_batch(tiny, images, which=[("dense_big", "scene_small"), ("dense_small",)])
    _, pooled, levels, k_patch = _reference_scores(model, inputs)
    lm = model.model.language_model
    calls = []
    original = lm._deepstack_process

    def spy(hidden_states, visual_pos_masks, visual_embeds):
        calls.append((visual_pos_masks.clone(), visual_embeds.clone()))
        return original(hidden_states, visual_pos_masks, visual_embeds)

    monkeypatch.setattr(lm, "_deepstack_process", spy)
    _, new, ctx = _pruned(model, processor, inputs, _cfg(0.5, contextual, "image"), n=3)
    monkeypatch.undo()

    assert len(calls) == len(levels) == len(model.config.vision_config.deepstack_visual_indexes)  # prefill only
    image_mask = new["input_ids"] == model.config.image_token_id
    keys = merge_units(k_patch, inputs["image_grid_thw"], _merge(model))
    for lvl, (mask, embeds) in enumerate(calls):
        assert torch.equal(mask, image_mask)
        assert embeds.shape == (int(image_mask.sum()), model.config.text_config.hidden_size)
        expected = []
        for j, feats in enumerate(levels[lvl]):
            sel = ctx.kept_indices[j]
            if contextual == 0:
                expected.append(feats[sel])
            else:
                n_keep = budget(0.5, feats.shape[0])
                kept = select_tokens([ctx.image_scores[j]], 0.5, "image", 1)[0]
                assert kept.numel() == n_keep
                idx, rows = compress_image(feats, keys[j], ctx.image_scores[j], kept, contextual)
                assert torch.equal(idx, sel)
                expected.append(rows)
        torch.testing.assert_close(embeds, torch.cat(expected), rtol=1e-5, atol=1e-6)
    if contextual > 0:  # merged tokens really differ from the plain gather somewhere
        plain = torch.cat([levels[0][j][ctx.kept_indices[j]] for j in range(len(levels[0]))])
        assert not torch.allclose(calls[0][1], plain)
    # the merged image tokens follow the same rule
    merged = ctx.image_outputs.pooler_output
    for j, feats in enumerate(pooled):
        if contextual == 0:
            torch.testing.assert_close(merged[j], feats[ctx.kept_indices[j]])
        else:
            kept = select_tokens([ctx.image_scores[j]], 0.5, "image", 1)[0]
            idx, rows = compress_image(feats, keys[j], ctx.image_scores[j], kept, contextual)
            torch.testing.assert_close(merged[j], rows, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------- dense Qwen3-VL, statistics


def test_dense_qwen3_vl_same_machinery(tiny, images):
    """The non-MoE Qwen3-VL (same vision tower, dense text model) goes through the same path."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    moe, processor = tiny
    text = moe.config.text_config
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=text.vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         rope_parameters=dict(text.rope_parameters)),
        vision_config=moe.config.vision_config.to_dict(),
        image_token_id=moe.config.image_token_id, video_token_id=moe.config.video_token_id,
        vision_start_token_id=moe.config.vision_start_token_id, vision_end_token_id=moe.config.vision_end_token_id,
    )
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = moe.generation_config.eos_token_id
    assert supports_visionzip(model)
    inputs = _mixed_batch(tiny, images, which=[("dense_big", "scene_small"), ("dense_small",)])
    stock = _stock(model, processor, inputs)
    forced, _, _ = _pruned(model, processor, inputs, _cfg(keep=1.0), force=True)
    assert forced == stock
    _, new, ctx = _pruned(model, processor, inputs, _cfg(0.5, 0.2, "request", layer=1), n=2)
    assert [sum(r.kept_per_image) for r in ctx.requests] == [9, 2]
    assert new["input_ids"].shape[1] == inputs["input_ids"].shape[1] - 9


def test_qwen3_5_moe_tower_without_deepstack_same_machinery(tmp_path, images):
    """The multimodal Qwen3.5-MoE (its tower has no deepstack levels, a Gated DeltaNet + gated-attention text model):
    forced keep 1.0 reproduces stock greedy generation token for token on a left-padded batch of mixed images, and
    keep 0.5 with a contextual share shortens each row by what it pruned, one budget per request."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from harness.models.families.build import ensure_tiny_family

    path = ensure_tiny_family("qwen3_5_moe", 0, cache_dir=tmp_path, multimodal=True)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(path)
    processor.tokenizer.padding_side = "left"
    assert type(model).__name__ == "Qwen3_5MoeForConditionalGeneration" and supports_visionzip(model)
    assert not hasattr(model.model.visual, "deepstack_merger_list")
    qwen35 = (model, processor)
    inputs = _mixed_batch(qwen35, images, which=[("dense_big", "scene_small"), ("dense_small",)])
    stock = _stock(model, processor, inputs)
    forced, new, _ = _pruned(model, processor, inputs, _cfg(keep=1.0), force=True)
    assert forced == stock and torch.equal(new["input_ids"], inputs["input_ids"])
    sizes, rows = _sizes(model, inputs), _rows_images(model, inputs)
    _, new, ctx = _pruned(model, processor, inputs, _cfg(0.5, 0.2, "request"), n=2)
    for r, images_of_row in zip(ctx.requests, rows):
        before = sum(sizes[j] for j in images_of_row)
        assert r.visual_tokens_before == before
        assert r.visual_tokens_after == max(budget(0.5, before), len(images_of_row))  # min_per_image 1
    lengths = inputs["attention_mask"].sum(1).tolist()
    assert new["input_ids"].shape[1] == max(n - (r.visual_tokens_before - r.visual_tokens_after)
                                            for n, r in zip(lengths, ctx.requests))


# ------------------------------------------------------------------ (g) audit: per-request budget, layer


def test_budget_is_per_request_not_per_batch(tiny, images):
    """scope=request: each row keeps budget(keep, its own visual tokens), chosen among its own images only.
    The rows are built so that a budget shared by the whole batch would move tokens between them: one row
    holds text-dense images, the other a plain scene (its scores are lower), with different token counts."""
    model, processor = tiny
    keep = 0.5
    which = [("dense_sq", "dense_big"), ("scene_sq",), ("dense_small", "scene_small")]
    inputs = _mixed_batch(tiny, images, which=which)
    _, _, ctx = _pruned(model, processor, inputs, _cfg(keep, 0.0, "request"), n=1)
    rows = _rows_images(model, inputs)
    flat_all = torch.cat(ctx.image_scores)
    batch_top = set(torch.argsort(-flat_all, stable=True)[:budget(keep, flat_all.numel())].tolist())
    offsets = [0]
    for s in ctx.image_scores:
        offsets.append(offsets[-1] + s.numel())
    batch_wide_differs = False
    for b, imgs in enumerate(rows):
        n_row = sum(ctx.image_scores[j].numel() for j in imgs)
        assert sum(ctx.requests[b].kept_per_image) == budget(keep, n_row), b
        own = torch.cat([ctx.image_scores[j] for j in imgs])
        best = set(torch.argsort(-own, stable=True)[:budget(keep, n_row)].tolist())
        local = [0]
        for j in imgs:
            local.append(local[-1] + ctx.image_scores[j].numel())
        chosen = {local[i] + int(u) for i, j in enumerate(imgs) for u in ctx.kept_indices[j].tolist()}
        assert chosen == best, b
        in_batch_top = sum(1 for j in imgs for u in range(ctx.image_scores[j].numel())
                           if offsets[j] + u in batch_top)
        batch_wide_differs |= in_batch_top != budget(keep, n_row)
    assert batch_wide_differs  # a batch-wide top-k would have given some row another count: the test bites


@pytest.mark.parametrize("layer", [0, 1, -2])
def test_visionzip_layer_selects_the_scoring_block(tiny, images, layer):
    """``visionzip.layer`` decides which vision block's attention scores the tokens: the scores equal the
    hand-built reference at that block, and differ from the last block's (so ignoring the key would fail)."""
    model, processor = tiny
    inputs = _mixed_batch(tiny, images, which=[("dense_big", "scene_small"), ("dense_sq",)])
    _, _, ctx = _pruned(model, processor, inputs, _cfg(0.5, 0.0, "request", layer=layer), n=1)
    want, _, _, _ = _reference_scores(model, inputs, layer=layer)
    last, _, _, _ = _reference_scores(model, inputs, layer=-1)
    for got, ref in zip(ctx.image_scores, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    assert any(not torch.allclose(a, b, rtol=1e-3, atol=1e-4) for a, b in zip(want, last, strict=True))
    with pytest.raises(ValueError, match="visionzip.layer"):
        _pruned(model, processor, inputs, _cfg(0.5, 0.0, "request", layer=len(model.model.visual.blocks)), n=1)
