"""Static-cache greedy decoding (``harness.engines.hf.graphs``) = ``model.generate``, token for token.

CPU (tiny Qwen3-VL-MoE, float32): the static loop, eager (``use_graphs=False``) and with the capture/replay
bookkeeping emulated (``use_graphs="emulate"``), against ``generate`` on left-padded batches of 3 rows of
different lengths: text only, with images, early EOS, SERE (tokens and statistics), VisionZip (keep 0.6),
reuse of a state by a shorter batch, graphs invalidated by installing / removing SERE, the engine's branch; the
lookahead stop check (``hf_stop.StopFlags``, forced on under "emulate") = the plain loop exactly, off with SERE.

GPU (skipped without CUDA): the same with real CUDA graphs, float32, the fused MoE kernel (the engine's
default on CUDA): tokens = ``generate``, graph = eager static loop, SERE statistics equal, the Python
forward not run on replay, the engine with ``cuda_graphs`` on and off, lookahead on (the default) vs off.
"""

from __future__ import annotations

import random

import pytest
import torch

from harness.engines.hf.graphs import StaticGreedyDecoder, unsupported_reason
from harness.engines.hf.stop import StopFlags
from harness.engines.hf.sere import install_sere
from harness.engines.hf.visionzip import prepare_visionzip_inputs, visionzip_generation
from harness.models.tiny import TinyModelSpec, ensure_tiny_model
from harness.techniques.sere.calibration import find_moe_blocks

try:
    from harness.config.schema import EngineConfig, GenerationConfig, VisionZipConfig
except ImportError:  # a GPU box without hydra/omegaconf: the engine and VisionZip only read these fields
    from types import SimpleNamespace

    def EngineConfig(**kw):  # noqa: N802
        return SimpleNamespace(**{"device": "auto", "dtype": "auto", "batch_size": 4, "attn_implementation": "sdpa",
                                  "experts_implementation": "auto", "cuda_graphs": True, **kw})

    def GenerationConfig(**kw):  # noqa: N802
        return SimpleNamespace(**{"max_new_tokens": 64, **kw})

    def VisionZipConfig(**kw):  # noqa: N802
        return SimpleNamespace(**{"keep": 1.0, "contextual": 0.0, "scope": "request", "layer": -1,
                                  "min_per_image": 1, **kw})

NEW = 10
CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: CUDA-graph capture/replay cannot run on CPU "
                                          "(the CPU tests cover the same loop eagerly and emulated)")


# ------------------------------------------------------------------------------------------------ set-up


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return ensure_tiny_model(TinyModelSpec(), cache_dir=tmp_path_factory.mktemp("graphs-model"))


def load(path, device="cpu"):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    kwargs = {}
    if device == "cuda":
        from harness.engines.hf.experts import register

        register()
        kwargs["experts_implementation"] = "harness_fused_moe"
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, **kwargs).to(device).eval()
    proc = AutoProcessor.from_pretrained(path)
    proc.tokenizer.padding_side = "left"
    return model, proc


@pytest.fixture(scope="module")
def cpu(tiny_path):
    return load(tiny_path)


@pytest.fixture(scope="module")
def images():
    from harness.datasets.synthetic.rag_igbench import plain_scene_image, text_dense_image

    rng = random.Random(0)
    return [text_dense_image(rng, 128, 96), plain_scene_image(rng, 96, 64), text_dense_image(rng, 64, 64)]


def chat(proc, parts):
    return proc.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                    tokenize=False)


def text_batch(proc, device="cpu"):
    texts = [chat(proc, [{"type": "text", "text": t}]) for t in
             ("What is the best food in the city park? answer", "hi", "旅游 美食 2024 answer more words")]
    return {k: v.to(device) for k, v in proc(text=texts, return_tensors="pt", padding=True).items()}


def image_batch(proc, images, device="cpu"):
    """Rows with 2, 0 and 1 images and different text lengths (left padding differs per row)."""
    texts = [chat(proc, [{"type": "image"}, {"type": "text", "text": "请描述这张图片"}, {"type": "image"}]),
             chat(proc, [{"type": "text", "text": "What is the best food in the city park? answer more"}]),
             chat(proc, [{"type": "text", "text": "旅游"}, {"type": "image"}])]
    inputs = proc(text=texts, images=images, return_tensors="pt", padding=True)
    return {k: v.to(device) for k, v in inputs.items()}


BATCHES = {"text": lambda proc, images, device="cpu": text_batch(proc, device), "images": image_batch}


def eos_of(model):
    eos = model.generation_config.eos_token_id
    return eos if isinstance(eos, list) else [eos]


def stock(model, proc, inputs, n=NEW, eos=None):
    kwargs = {"eos_token_id": eos} if eos is not None else {}
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False,
                             pad_token_id=proc.tokenizer.pad_token_id, **kwargs)
    return out[:, inputs["input_ids"].shape[1]:].tolist()


def decoder(model, proc, use_graphs, eos=None, **kwargs):
    return StaticGreedyDecoder(model, eos or eos_of(model), proc.tokenizer.pad_token_id, use_graphs=use_graphs,
                               **kwargs)


def similarity(model, seed=0):
    """A random [L, E, E] expert similarity (1 on the diagonal): routing only has to move, not be good."""
    blocks = find_moe_blocks(model)
    g = torch.Generator().manual_seed(seed)
    sims = []
    for ref in blocks:
        v = torch.randn(ref.num_experts, 16, generator=g)
        d = torch.cdist(v, v)
        sims.append((1 - d / d.max()).fill_diagonal_(1.0))
    return torch.stack(sims)


def sere(model, k_primary, seed=0):
    """SERE on every MoE block: the fused Triton op on CUDA, the torch reference on CPU (same ids; the
    reference keeps the CPU tests fast under TRITON_INTERPRET)."""
    from harness.techniques.sere.reroute import reroute

    device = next(model.parameters()).device
    op = None if device.type == "cuda" else reroute
    return install_sere(model, similarity(model, seed).to(device), k_primary, 0.0, op=op)


def early_eos(reference: list[list[int]]) -> list[int]:
    """EOS ids that end each row at a different step, so generation stops before the limit."""
    return sorted({reference[0][2], reference[1][4], reference[2][1]})


# ------------------------------------------------------------------------------------------- CPU tests


@pytest.mark.parametrize("use_graphs", [False, "emulate"])
@pytest.mark.parametrize("kind", list(BATCHES))
def test_static_loop_equals_generate(cpu, images, kind, use_graphs):
    model, proc = cpu
    inputs = BATCHES[kind](proc, images)
    assert (inputs["attention_mask"] == 0).any(), "the batch must be left padded"
    ref = stock(model, proc, inputs)
    dec = decoder(model, proc, use_graphs)
    res = dec.generate(inputs, NEW)
    assert res.tokens == ref
    assert len(res.times) == NEW and res.times == sorted(res.times)
    assert res.mode == ("eager" if use_graphs is False else "captured")
    again = dec.generate(inputs, NEW)            # the same state again: rewound cache, graph reused
    assert again.tokens == ref
    if use_graphs == "emulate":
        assert again.mode == "replayed" and again.replays == NEW - 1 and dec.captures == 1


@pytest.mark.parametrize("use_graphs", [False, "emulate"])
def test_early_eos_stops_like_generate(cpu, images, use_graphs):
    model, proc = cpu
    inputs = image_batch(proc, images)
    eos = early_eos(stock(model, proc, inputs))
    ref = stock(model, proc, inputs, eos=eos)
    assert len(ref[0]) < NEW and any(proc.tokenizer.pad_token_id in row for row in ref)
    res = decoder(model, proc, use_graphs, eos=eos).generate(inputs, NEW)
    assert res.tokens == ref and len(res.times) == len(ref[0])


def test_prompt_tokens_and_left_padding_are_masked(cpu, images):
    """Each row decoded alone (no padding) = the same row in the padded batch."""
    model, proc = cpu
    inputs = text_batch(proc)
    dec = decoder(model, proc, False)
    batched = dec.generate(inputs, NEW).tokens
    for row in range(3):
        keep = inputs["attention_mask"][row].bool()
        alone = {"input_ids": inputs["input_ids"][row:row + 1, keep],
                 "attention_mask": inputs["attention_mask"][row:row + 1, keep]}
        assert dec.generate(alone, NEW).tokens[0] == batched[row]


def test_shorter_batch_reuses_the_state(cpu, images):
    model, proc = cpu
    dec = decoder(model, proc, "emulate")
    long_inputs, short_inputs = image_batch(proc, images), text_batch(proc)
    assert long_inputs["input_ids"].shape[1] > short_inputs["input_ids"].shape[1]
    assert dec.generate(long_inputs, NEW).tokens == stock(model, proc, long_inputs)
    res = dec.generate(short_inputs, NEW)       # stale keys/values beyond the shorter prompt stay masked
    assert res.tokens == stock(model, proc, short_inputs)
    assert len(dec.states) == 1 and res.mode == "replayed"


def test_tight_cache_holds_the_warmup_steps(cpu, images):
    """No rounding, more warm-up steps than tokens: the warm-up must still fit in the static cache."""
    model, proc = cpu
    inputs = text_batch(proc)
    dec = decoder(model, proc, "emulate", cache_bucket=1, warmup_steps=5)
    res = dec.generate(inputs, 3)
    assert res.mode == "captured" and res.tokens == stock(model, proc, inputs, n=3)


@pytest.mark.parametrize("use_graphs", [False, "emulate"])
def test_sere_tokens_and_statistics_equal_generate(cpu, images, use_graphs):
    model, proc = cpu
    inputs = image_batch(proc, images)
    handle = sere(model, 1)
    try:
        ref = stock(model, proc, inputs)
        ref_stats = handle.stats()
        assert ref_stats["steps"] == NEW - 1 and ref_stats["moved_fraction"] > 0
        handle.reset_stats()
        dec = decoder(model, proc, use_graphs)
        assert dec.generate(inputs, NEW).tokens == ref
        assert handle.stats() == ref_stats
        handle.reset_stats()                    # as the engine does after its warm-up
        res = dec.generate(inputs, NEW)
        assert res.tokens == ref and handle.stats() == ref_stats
        if use_graphs == "emulate":
            assert res.mode == "replayed" and dec.captures == 1
    finally:
        handle.remove()


def test_warmup_batch_captures_and_leaves_no_trace(cpu, images):
    """The engine's 2-token warm-up captures (cache sized by reserve_new_tokens); its warm-up steps leave the
    SERE counters as one decode step left them; the full batch after reset_stats replays."""
    model, proc = cpu
    inputs = image_batch(proc, images)
    handle = sere(model, 2, seed=1)
    try:
        ref = stock(model, proc, inputs)
        ref_stats = handle.stats()
        handle.reset_stats()
        stock(model, proc, inputs, n=2)
        two_stats = handle.stats()
        handle.reset_stats()
        dec = decoder(model, proc, "emulate")
        warm = dec.generate(inputs, 2, reserve_new_tokens=NEW)
        assert warm.mode == "captured" and warm.tokens == [r[:2] for r in ref]
        assert handle.stats() == two_stats
        handle.reset_stats()
        res = dec.generate(inputs, NEW, reserve_new_tokens=NEW)
        assert res.mode == "replayed" and res.tokens == ref and handle.stats() == ref_stats
    finally:
        handle.remove()


def test_installing_or_removing_sere_recaptures(cpu, images):
    model, proc = cpu
    inputs = text_batch(proc)
    plain = stock(model, proc, inputs)
    dec = decoder(model, proc, "emulate")
    assert dec.generate(inputs, NEW).tokens == plain
    handle = sere(model, 1)
    try:
        rerouted = stock(model, proc, inputs)
        assert rerouted != plain                # SERE changes this batch's decode
        res = dec.generate(inputs, NEW)
        assert res.mode == "captured" and res.tokens == rerouted
    finally:
        handle.remove()
    res = dec.generate(inputs, NEW)
    assert res.mode == "captured" and res.tokens == plain and dec.captures == 3


@pytest.mark.parametrize("use_graphs", [False, "emulate"])
def test_visionzip_equals_generate(cpu, images, use_graphs):
    model, proc = cpu
    inputs = image_batch(proc, images)
    cfg = VisionZipConfig(keep=0.6)
    pad = proc.tokenizer.pad_token_id
    with torch.inference_mode():
        new, ctx = prepare_visionzip_inputs(model, inputs, cfg, pad_token_id=pad)
    assert ctx is not None and new["input_ids"].shape[1] < inputs["input_ids"].shape[1]
    with visionzip_generation(model, ctx):
        ref = stock(model, proc, new)
        res = decoder(model, proc, use_graphs).generate(new, NEW)
    assert res.tokens == ref


@pytest.mark.parametrize("use_graphs", [False, "emulate"])
def test_plain_causal_lm(use_graphs):
    """A text-only MoE causal LM (2-D position ids): the same loop, the same tokens as generate."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                            num_experts_per_tok=2, moe_intermediate_size=32, eos_token_id=255, pad_token_id=0)
    model = Qwen3MoeForCausalLM(config).eval()
    ids = torch.randint(1, 250, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :4], mask[2, :2] = 0, 0                    # left padding
    ids = ids.masked_fill(mask == 0, 0)
    inputs = {"input_ids": ids, "attention_mask": mask}
    with torch.inference_mode():
        ref = model.generate(**inputs, max_new_tokens=NEW, do_sample=False, pad_token_id=0)[:, 9:].tolist()
    res = StaticGreedyDecoder(model, [255], 0, use_graphs=use_graphs).generate(inputs, NEW)
    assert res.tokens == ref


def test_logits_processors_are_refused(cpu):
    model, proc = cpu
    assert unsupported_reason(model) is None
    model.generation_config.repetition_penalty = 1.3
    try:
        assert "repetition_penalty" in unsupported_reason(model)
        with pytest.raises(NotImplementedError, match="repetition_penalty"):
            decoder(model, proc, False)
    finally:
        model.generation_config.repetition_penalty = 1.0


def make_engine(path, device, cuda_graphs=True, max_new=NEW):
    from harness.engines.hf.engine import HFEngine

    cfg = EngineConfig(device=device, dtype="float32", batch_size=3, cuda_graphs=cuda_graphs)
    return HFEngine(str(path), cfg, GenerationConfig(max_new_tokens=max_new))


def requests(images):
    from harness.engines.base import Request

    return [Request("a", [{"type": "image"}, {"type": "text", "text": "请描述"}, {"type": "image"}], images[:2]),
            Request("b", [{"type": "text", "text": "What is the best food in the city park? answer"}]),
            Request("c", [{"type": "text", "text": "旅游"}, {"type": "image"}], images[2:])]


def test_engine_branch_uses_the_decoder(tiny_path, images):
    """On CPU the engine keeps ``generate`` (cuda_graphs is CUDA-only); forcing the decoder in gives the same
    generations, with TTFT/TPOT from its per-step times."""
    engine = make_engine(tiny_path, "cpu")
    try:
        assert engine.describe()["cuda_graphs"] is False and engine._graph_decoder is None
        reqs = requests(images)
        stock_gens = engine.generate(reqs)
        engine._graph_decoder = StaticGreedyDecoder(engine.model, engine.eos_ids, engine.pad_id,
                                                    use_graphs="emulate")
        engine.warmup(reqs)
        assert engine._graph_decoder.captures == 1
        gens = engine.generate(reqs)
        assert engine._graph_decoder.captures == 1                 # the warm-up's graph replayed
        for g, s in zip(gens, stock_gens, strict=True):
            assert g.error is None and (g.text, g.output_tokens, g.prompt_tokens) == (s.text, s.output_tokens,
                                                                                        s.prompt_tokens)
            assert 0 < g.ttft_ms <= g.e2e_ms and g.tpot_ms is not None
    finally:
        engine.close()


# ------------------------------------------------------------------------------------------- GPU tests


@pytest.fixture(scope="module")
def gpu_model(tiny_path):
    return load(tiny_path, "cuda")


def forward_calls(model):
    calls = []
    return calls, model.register_forward_pre_hook(lambda *a: calls.append(1))


@gpu
@pytest.mark.parametrize("kind", list(BATCHES))
def test_gpu_graph_equals_generate(gpu_model, images, kind):
    model, proc = gpu_model
    inputs = BATCHES[kind](proc, images, "cuda")
    ref = stock(model, proc, inputs)
    eager = decoder(model, proc, False).generate(inputs, NEW).tokens
    dec = decoder(model, proc, None)
    calls, hook = forward_calls(model)
    try:
        first = dec.generate(inputs, NEW)
        n_captured = len(calls)
        second = dec.generate(inputs, NEW)
    finally:
        hook.remove()
    assert first.mode == "captured" and second.mode == "replayed" and second.replays == NEW - 1
    assert first.tokens == eager, "graph replay differs from the same static loop run eagerly"
    assert first.tokens == ref and second.tokens == ref, f"graph {first.tokens} vs generate {ref}"
    # prefill + warm-up steps + the capture run Python; replays do not
    assert n_captured == 1 + dec.warmup_steps + 1 and len(calls) - n_captured == 1
    assert second.times == sorted(second.times) and len(second.times) == NEW


@gpu
def test_gpu_early_eos_under_replay(gpu_model, images):
    model, proc = gpu_model
    inputs = image_batch(proc, images, "cuda")
    eos = early_eos(stock(model, proc, inputs))
    ref = stock(model, proc, inputs, eos=eos)
    dec = decoder(model, proc, None, eos=eos)
    dec.generate(inputs, NEW)
    res = dec.generate(inputs, NEW)
    assert res.mode == "replayed" and res.tokens == ref


@gpu
@pytest.mark.parametrize("kind", list(BATCHES))
def test_gpu_sere_tokens_and_statistics(gpu_model, images, kind):
    model, proc = gpu_model
    inputs = BATCHES[kind](proc, images, "cuda")
    handle = sere(model, 1)
    try:
        ref = stock(model, proc, inputs)
        ref_stats = handle.stats()
        assert ref_stats["steps"] == NEW - 1 and ref_stats["moved_fraction"] > 0
        handle.reset_stats()
        dec = decoder(model, proc, None)
        warm = dec.generate(inputs, 2, reserve_new_tokens=NEW)     # the engine's warm-up: captures
        handle.reset_stats()
        res = dec.generate(inputs, NEW, reserve_new_tokens=NEW)    # replays into re-attached counters
        assert warm.mode == "captured" and res.mode == "replayed"
        assert res.tokens == ref
        stats = handle.stats()
        for key in ("steps", "tokens_per_step", "expert_union_before", "expert_union_after", "primary_union",
                    "moved_fraction", "by_batch_size"):
            assert stats[key] == ref_stats[key], key
        assert stats == ref_stats
    finally:
        handle.remove()


@gpu
def test_gpu_visionzip_and_sere(gpu_model, images):
    model, proc = gpu_model
    inputs = image_batch(proc, images, "cuda")
    pad = proc.tokenizer.pad_token_id
    handle = sere(model, 2, seed=2)
    try:
        with torch.inference_mode():
            new, ctx = prepare_visionzip_inputs(model, inputs, VisionZipConfig(keep=0.6), pad_token_id=pad)
        with visionzip_generation(model, ctx):
            ref = stock(model, proc, new)
            ref_stats = handle.stats()
            handle.reset_stats()
            res = decoder(model, proc, None).generate(new, NEW)
        assert res.mode == "captured" and res.tokens == ref and handle.stats() == ref_stats
    finally:
        handle.remove()


@gpu
def test_gpu_engine_cuda_graphs_on_and_off(tiny_path, images):
    reqs = requests(images)
    results = {}
    for on in (True, False):
        engine = make_engine(tiny_path, "cuda", cuda_graphs=on)
        try:
            assert engine.describe()["cuda_graphs"] is on
            engine.warmup(reqs)
            results[on] = engine.generate(reqs)
            if on:
                assert engine._graph_decoder.captures == 1
        finally:
            engine.close()
    for g, s in zip(results[True], results[False], strict=True):
        assert g.error is None and s.error is None, (g.error, s.error)
        assert (g.text, g.output_tokens) == (s.text, s.output_tokens)
        assert g.ttft_ms > 0 and g.e2e_ms >= g.ttft_ms


@pytest.mark.parametrize("use_graphs", [False, "emulate"])
def test_sere_with_early_eos_equals_generate(cpu, images, use_graphs):
    """Rows ending at different steps: finished rows leave SERE's P (hf_sere's per-row flags). The emulated
    capture's warm-up steps cross a row's EOS; the flags must be put back with the other step state, or the
    replayed steps would drop that row from P too early (tokens and statistics would differ)."""
    model, proc = cpu
    inputs = image_batch(proc, images)
    handle = sere(model, 1)
    try:
        eos = early_eos(stock(model, proc, inputs))
    finally:
        handle.remove()
    from harness.techniques.sere.reroute import reroute

    handle = install_sere(model, similarity(model), 1, 0.0, op=reroute, eos_token_ids=eos)
    try:
        ref = stock(model, proc, inputs, eos=eos)
        ref_stats = handle.stats()
        assert len(ref[0]) < NEW and ref_stats["tokens_per_step"] < len(ref)   # some steps had finished rows
        handle.reset_stats()
        dec = decoder(model, proc, use_graphs, eos=eos)
        for _ in range(2):                              # captured, then replayed
            res = dec.generate(inputs, NEW)
            assert res.tokens == ref and handle.stats() == ref_stats
            handle.reset_stats()
    finally:
        handle.remove()


@gpu
def test_gpu_sere_with_early_eos_under_replay(gpu_model, images):
    """Real CUDA graphs: the per-row finished flags are updated inside the graph on replay (finished rows leave
    P) and put back after the warm-up steps, so tokens and statistics equal ``generate``'s."""
    model, proc = gpu_model
    inputs = image_batch(proc, images, "cuda")
    eos = early_eos(stock(model, proc, inputs))
    handle = install_sere(model, similarity(model).to("cuda"), 1, 0.0, eos_token_ids=eos)
    try:
        ref = stock(model, proc, inputs, eos=eos)
        ref_stats = handle.stats()
        assert ref_stats["tokens_per_step"] < len(ref)
        handle.reset_stats()
        dec = decoder(model, proc, None, eos=eos)
        for mode in ("captured", "replayed"):
            res = dec.generate(inputs, NEW)
            assert res.mode == mode and res.tokens == ref and handle.stats() == ref_stats
            handle.reset_stats()
    finally:
        handle.remove()


@gpu
def test_gpu_top_k_under_replay(gpu_model, images):
    """moe.top_k=2 (hf_topk) on the fused MoE kernel with [T, 2] ids: graphs replay = generate, statistics too."""
    from harness.engines.hf.topk import install_topk

    model, proc = gpu_model
    inputs = image_batch(proc, images, "cuda")
    base = stock(model, proc, inputs)
    handle = install_topk(model, 2)
    try:
        ref = stock(model, proc, inputs)
        ref_stats = handle.stats()
        assert ref != base and ref_stats["expert_union_after"] < ref_stats["expert_union_before"]
        handle.reset_stats()
        dec = decoder(model, proc, None)
        for mode in ("captured", "replayed"):
            res = dec.generate(inputs, NEW)
            assert res.mode == mode and res.tokens == ref and handle.stats() == ref_stats
            handle.reset_stats()
    finally:
        handle.remove()


# ------------------------------------------------------- lookahead stop check (hf_stop.StopFlags, issue 17)


def test_stop_flags_answer_for_the_step_before_last():
    flags = StopFlags(torch.device("cpu"))
    done = torch.tensor(False)
    assert not flags.done_before_last()
    flags.record(done)
    assert not flags.done_before_last()           # one record: no step before the last
    done.fill_(True)
    flags.record(done)                            # a snapshot, not a view of the live flag
    assert not flags.done_before_last()           # record 0 said "not done"
    done.fill_(False)
    flags.record(done)
    assert flags.done_before_last() and flags.done_before_last()   # record 1 said "done" (asked twice)
    flags.record(done)
    assert not flags.done_before_last()           # record 2 (the ring slot of record 0, overwritten)


def counted(dec, inputs, n, monkeypatch, **kwargs):
    """``dec.generate`` with the clock on a counter (exact times to compare) and the StopFlags it built."""
    from types import SimpleNamespace

    import harness.engines.hf.graphs as hf_graphs

    ticks = iter(range(10_000))
    monkeypatch.setattr(hf_graphs, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    made = []

    class Spy(StopFlags):
        def __init__(self, device):
            super().__init__(device)
            made.append(self)

    monkeypatch.setattr(hf_graphs, "StopFlags", Spy)
    try:
        return dec.generate(inputs, n, **kwargs), made
    finally:
        monkeypatch.undo()


def same_result(a, b):
    assert (a.tokens, a.times, a.mode, a.replays) == (b.tokens, b.times, b.mode, b.replays)


def test_lookahead_equals_the_plain_loop(cpu, images, monkeypatch):
    """Emulated graphs, lookahead forced on vs off, early EOS: tokens, times, mode and replays equal exactly for
    limits below, at (the last step sets "all done"), one past (the final step launched is the extra one) and
    well past the stop step, and for 1 and 2 tokens."""
    model, proc = cpu
    inputs = image_batch(proc, images)
    eos = early_eos(stock(model, proc, inputs))
    ref = stock(model, proc, inputs, eos=eos)
    stop = len(ref[0])
    assert 3 <= stop < NEW - 1
    plain = decoder(model, proc, "emulate", eos=eos, lookahead=False)
    ahead = decoder(model, proc, "emulate", eos=eos, lookahead=True)
    for n in (NEW, stop, stop + 1, stop - 1, 2, 1, NEW):
        a, made_a = counted(plain, inputs, n, monkeypatch, reserve_new_tokens=NEW)
        b, made_b = counted(ahead, inputs, n, monkeypatch, reserve_new_tokens=NEW)
        same_result(a, b)
        assert not made_a and len(made_b) == 1, "lookahead must run only where asked"
        assert a.tokens == [row[:n] for row in ref] and len(a.times) == min(n, stop)
        extra = n > stop                                  # all rows stopped before the limit: one step more
        assert made_b[0].count == len(b.times) + extra
    assert plain.captures == ahead.captures == 1


def test_lookahead_no_eos_and_prefill_done(cpu, images, monkeypatch):
    """A batch that runs to max_new_tokens (no row stops) and one whose prefill token ends every row (no step:
    nothing captured for a step that would be dropped, mode as without lookahead)."""
    model, proc = cpu
    inputs = text_batch(proc)
    ref = stock(model, proc, inputs)
    plain = decoder(model, proc, "emulate", lookahead=False)
    ahead = decoder(model, proc, "emulate", lookahead=True)
    for _ in range(2):                                     # captured, then replayed
        a, _made = counted(plain, inputs, NEW, monkeypatch)
        b, _made = counted(ahead, inputs, NEW, monkeypatch)
        same_result(a, b)
        assert b.tokens == ref and len(b.times) == NEW
    eos = sorted({row[0] for row in ref})
    plain = decoder(model, proc, "emulate", eos=eos, lookahead=False)
    ahead = decoder(model, proc, "emulate", eos=eos, lookahead=True)
    for _ in range(2):
        a, _made = counted(plain, inputs, NEW, monkeypatch)
        b, _made = counted(ahead, inputs, NEW, monkeypatch)
        same_result(a, b)
        assert len(b.times) == 1 and b.mode == "eager" and ahead.captures == plain.captures == 0


def test_lookahead_is_off_with_sere(cpu, images, monkeypatch):
    """SERE installed: even lookahead=True keeps the plain loop (an extra step would change its statistics)."""
    model, proc = cpu
    inputs = image_batch(proc, images)
    eos = early_eos(stock(model, proc, inputs))
    handle = sere(model, 1)
    try:
        dec = decoder(model, proc, "emulate", eos=eos, lookahead=True)
        res, made = counted(dec, inputs, NEW, monkeypatch)
        assert not made and res.tokens == stock(model, proc, inputs, eos=eos)
    finally:
        handle.remove()


@gpu
def test_gpu_lookahead_equals_the_plain_loop(gpu_model, images, monkeypatch):
    """Real CUDA graphs, lookahead on (the default there) vs off, early EOS: same tokens, step counts, modes and
    replays, for limits at, one past and well past the stop step, and with every row done at the prefill."""
    model, proc = gpu_model
    inputs = image_batch(proc, images, "cuda")
    eos = early_eos(stock(model, proc, inputs))
    ref = stock(model, proc, inputs, eos=eos)
    stop = len(ref[0])
    assert stop < NEW - 1
    plain = decoder(model, proc, None, eos=eos, lookahead=False)
    ahead = decoder(model, proc, None, eos=eos)
    for n in (NEW, stop, stop + 1, NEW):
        a, made_a = counted(plain, inputs, n, monkeypatch, reserve_new_tokens=NEW)
        b, made_b = counted(ahead, inputs, n, monkeypatch, reserve_new_tokens=NEW)
        assert not made_a and len(made_b) == 1 and made_b[0].cuda
        assert (a.tokens, len(a.times), a.mode, a.replays) == (b.tokens, len(b.times), b.mode, b.replays)
        assert b.tokens == [row[:n] for row in ref] and b.times == sorted(b.times)
        assert made_b[0].count == len(b.times) + (n > stop)
    done0 = sorted({row[0] for row in ref})
    plain = decoder(model, proc, None, eos=done0, lookahead=False)
    ahead = decoder(model, proc, None, eos=done0)
    a, b = plain.generate(inputs, NEW), ahead.generate(inputs, NEW)
    assert (a.tokens, len(a.times), a.mode) == (b.tokens, len(b.times), b.mode) and len(b.times) == 1
    assert ahead.captures == plain.captures == 0
