"""Requests, configs and the HF reference shared by the vLLM-lane tests (imported by name: this folder is
on ``sys.path`` under pytest's default import mode)."""

from __future__ import annotations

from types import SimpleNamespace

MAX_NEW = 32


def engine_cfg(**over):
    """An ``engine`` group for tests (what conf/engine/vllm.yaml + CPU settings give)."""
    base = dict(name="vllm", device="auto", dtype="float32", batch_size=8, attn_implementation="sdpa",
                experts_implementation=None, warmup=1, max_model_len=1024, gpu_memory_utilization=0.1,
                enforce_eager=True, tensor_parallel_size=1)
    base.update(over)
    return SimpleNamespace(**base)


def gen_cfg(max_new_tokens: int = MAX_NEW):
    return SimpleNamespace(max_new_tokens=max_new_tokens, do_sample=False)


def _image(rng, h, w):
    import numpy as np
    from PIL import Image

    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


def make_requests():
    """Text-only, one-image and two-image requests (seeded images of different sizes)."""
    import numpy as np

    from harness.engines.base import Request

    rng = np.random.default_rng(0)
    text = [
        Request("text-0", [{"type": "text", "text": "The user asks a question. Answer using the notes."}]),
        Request("text-1", [{"type": "text", "text": "旅游 美食 穿搭 请根据以下笔记回答问题"}]),
        Request("text-2", [{"type": "text", "text": "Output JSON with the keys reason, category and answer."}]),
        # ends on EOS after a few tokens with the seed-0 embedded model (the EOS count is under test)
        Request("text-eos", [{"type": "text", "text": "旅游 家居"}]),
    ]
    images = [
        Request("img2-0", [{"type": "image"}, {"type": "text", "text": "describe both"}, {"type": "image"}],
                [_image(rng, 64, 96), _image(rng, 100, 50)]),
        Request("img2-1", [{"type": "text", "text": "猫 狗 compare"}, {"type": "image"}, {"type": "image"}],
                [_image(rng, 128, 128), _image(rng, 48, 80)]),
        Request("img1-0", [{"type": "text", "text": "what is this"}, {"type": "image"}],
                [_image(rng, 128, 128)]),
    ]
    return text, images



class HFReference:
    """Greedy token ids from transformers (float32, batch 1: no padding), the reference of every test."""

    def __init__(self, path: str, device: str = "cpu"):
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.torch, self.device = torch, device
        self.processor = AutoProcessor.from_pretrained(path)
        self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).to(device).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos])
        self.image_token_id = self.model.config.image_token_id

    def inputs(self, request):
        parts = [{"type": p["type"], "text": p["text"]} if p["type"] == "text" else {"type": "image"}
                 for p in request.content]
        text = self.processor.apply_chat_template([{"role": "user", "content": parts}],
                                                  add_generation_prompt=True, tokenize=False)
        return self.processor(text=[text], images=request.images or None, return_tensors="pt").to(self.device)

    def generate(self, request, max_new_tokens: int = MAX_NEW) -> dict:
        """``{"ids", "prompt_tokens", "visual_tokens"}``; ids cut after the first EOS (kept), as HF counts."""
        inputs = self.inputs(request)
        with self.torch.inference_mode():
            out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        prompt = inputs["input_ids"][0]
        ids = out[0, prompt.shape[0]:].tolist()
        n = next((j + 1 for j, t in enumerate(ids) if t in self.eos), len(ids))
        return {"ids": ids[:n], "prompt_tokens": int(prompt.shape[0]),
                "visual_tokens": int((prompt == self.image_token_id).sum())}

    def generate_visionzip(self, request, vz_cfg, max_new_tokens: int = MAX_NEW) -> dict:
        """HF + VisionZip (``harness.engines.hf.visionzip``): the same fields as :meth:`generate`."""
        from harness.engines.hf.visionzip import prepare_visionzip_inputs, visionzip_generation

        inputs = self.inputs(request)
        new, ctx = prepare_visionzip_inputs(self.model, inputs, vz_cfg,
                                            pad_token_id=self.processor.tokenizer.pad_token_id)
        with self.torch.inference_mode(), visionzip_generation(self.model, ctx):
            out = self.model.generate(**new, max_new_tokens=max_new_tokens, do_sample=False)
        prompt = new["input_ids"][0]
        ids = out[0, prompt.shape[0]:].tolist()
        n = next((j + 1 for j, t in enumerate(ids) if t in self.eos), len(ids))
        return {"ids": ids[:n], "prompt_tokens": int(new["attention_mask"][0].sum()),
                "visual_tokens": int((prompt == self.image_token_id).sum())}


def forced_inputs(inputs, tokens):
    """``inputs`` (a processor's output for the prompt) extended by ``tokens`` as teacher-forced context: the
    ids, an all-ones mask and the per-token type ids (0 = text) that Qwen3-VL's 3-D positions read; pixel and
    grid tensors as they were."""
    import torch

    n = len(tokens)
    ids = inputs["input_ids"]
    out = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    out["input_ids"] = torch.cat([ids, torch.tensor([tokens], dtype=ids.dtype, device=ids.device)], 1)
    out["attention_mask"] = torch.ones_like(out["input_ids"])
    if "mm_token_type_ids" in inputs:
        types = inputs["mm_token_type_ids"]
        out["mm_token_type_ids"] = torch.cat([types, types.new_zeros(types.shape[0], n)], 1)
    return out


def precision_check(models, inputs, tokens) -> dict:
    """Another engine's greedy ``tokens``, teacher-forced through HF in float32 and in bfloat16 (``models``:
    ``{"float32": m, "bfloat16": m}``, same weights and device): per output position j,

    - ``sensitive[j]``: the position is precision-sensitive *in HF itself*: HF's bf16 logits moved far enough
      from its f32 logits to reorder the f32 top two (f32 margin ≤ 2 · max_t |l_bf16 − l_f32|) or HF's own two
      argmaxes differ. In an MoE a router near-tie anywhere before j flips an expert and moves the logits by
      whole units, so such a position has no engine-independent answer in bf16;
    - ``agree[j]``: the token equals HF's float32 argmax.

    The claim a test makes from it: at every position that is not sensitive, the other engine's bf16 token is
    HF's f32 argmax. A wrong prompt, position, routing or weight layout breaks robust positions too.
    """
    import torch

    full = forced_inputs(inputs, tokens)
    n0 = inputs["input_ids"].shape[1] - 1
    logits = {}
    with torch.inference_mode():
        for name, model in models.items():
            out = model(**full).logits[0, n0:n0 + len(tokens)].float()
            logits[name] = out
    f32, bf16 = logits["float32"], logits["bfloat16"]
    top2 = f32.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    err = (bf16 - f32).abs().max(dim=-1).values
    argmax = f32.argmax(dim=-1)
    sensitive = (margin <= 2 * err) | (argmax != bf16.argmax(dim=-1))
    agree = argmax.cpu() == torch.tensor(tokens)
    return {"tokens": list(tokens), "f32_argmax": argmax.tolist(), "margin": margin.tolist(), "bf16_error": err.tolist(),
            "sensitive": sensitive.tolist(), "agree": agree.tolist(),
            "failures": [j for j in range(len(tokens)) if not sensitive[j] and not agree[j]]}


def assert_robust_agreement(checks: dict, label: str) -> dict:
    """The claim of :func:`precision_check` over a set of requests (``{uid: check}``): no failure at a robust
    position, and at least half the positions robust (a check whose every position were sensitive would pass
    anything). Returns the per-request report ``{uid: (tokens, sensitive, failures)}``, printed under ``label``."""
    report = {uid: (len(c["tokens"]), sum(c["sensitive"]), c["failures"]) for uid, c in checks.items()}
    print(f"{label} (tokens, precision-sensitive, failures):", report)
    assert all(not failures for _, _, failures in report.values()), report
    total = sum(n for n, _, _ in report.values())
    robust = total - sum(s for _, s, _ in report.values())
    assert total >= 2 * len(checks) and robust >= 0.5 * total, (robust, total)
    return report
