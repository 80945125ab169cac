"""The seeded synthetic task suite the embedded model is trained and evaluated on (issue 13).

Why: real checkpoints cannot be downloaded here, so the project trains its own tiny Qwen3-VL-MoE on tasks it
can generate, score and split itself. Every image is drawn with PIL, so each answer is known by construction.
Three task families, one per format the harness scores:

- **OCR** (OCRBench style): a *text-dense* image — one or two lines of capital letters / digits, dark on a
  plain light background — and "what is written in the image?" (answer: the lines joined by a space) or
  "what is the number in the image?" (one line of digits);
- **MCQ** (CCBench style): a *sparse* image — one to four coloured shapes on a plain background — and a
  Chinese multiple-choice question about count, colour or shape (answer: the letter);
- **RAG** (RAG-IGBench style): a query, three short notes, one or two images per note (text or shape
  images); the reference JSON answer copies each note's first clause with its citation and inserts, right
  after a note, the *text* images of that note (``![示意图](IMG#k)``), so placing the images needs to look
  at them.

Design choices that serve the techniques: text lines fill a large share of an OCR image while shapes fill a
small share of a shape image, on plain backgrounds — informative patches are few and well defined, which is
what VisionZip's attention scores must find and what the request-wide budget competes over; the task
families use different token kinds (letters/digits, Chinese option words, JSON/markdown tags), which gives
the MoE router something to specialise on.

Train / held-out split: every item has a *key* (the OCR text, the RAG query + notes, the MCQ question +
layout); ``sha1(key) % 8 == 0`` is held-out, and each split rejects the other's keys, so no held-out
answer is ever trained on. The bundled ``*_sample`` datasets are drawn from the held-out split
(``python -m harness.datasets.synthetic.bundle bundle``), so is every sensitivity test's data.

Only PIL and the standard library (plus the loaders' prompt builders) are imported: the training script runs
on a GPU machine without Hydra.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any

from PIL import Image, ImageDraw, ImageFont

GENERATORS = ("1", "2")  # "2": grid-aligned big glyphs and one-cell shapes (docs/embedded_model.md, "v2")
_VERSION_FILE = __import__("pathlib").Path(__file__).resolve().parents[1] / "bundled" / "GENERATOR"


def _bundled_version() -> str:
    """The generator version the bundled samples (and so ``model=tiny``) were drawn with: ``bundled/GENERATOR``,
    written by :func:`bundle`; "1" where the file is absent (everything before generator 2)."""
    try:
        v = _VERSION_FILE.read_text(encoding="utf-8").strip()
    except OSError:
        return "1"
    return v if v in GENERATORS else "1"


GENERATOR_VERSION = _bundled_version()  # what the bundled samples use; training picks its own (use_generator)
_ACTIVE = {"version": GENERATOR_VERSION}


def use_generator(version: str) -> None:
    """Select the generator version every item function draws with (process-wide; forked workers inherit it)."""
    if version not in GENERATORS:
        raise ValueError(f"generator version must be one of {GENERATORS}, got {version!r}")
    _ACTIVE["version"] = version


def generator_version() -> str:
    return _ACTIVE["version"]

MERGE_PX = 32  # patch 16 × spatial merge 2: one LLM visual token covers 32 × 32 pixels
ALPHABET = "ABCDEFGHJKLMNPRSTUVWXYZ"  # no I / O (they look like 1 / 0)
DIGITS = "0123456789"
OCR_SIZE = (192, 64)  # 6 × 2 LLM tokens; each text line sits in one 32-pixel token row
SHAPE_SIZES = ((128, 128), (128, 96), (96, 128))
READ_Q = "what is written in the image?"
NUMBER_Q = "what is the number in the image?"

COLOURS = {"红色": (215, 40, 40), "绿色": (40, 155, 60), "蓝色": (40, 80, 215), "黄色": (225, 185, 20)}
KINDS = ("圆形", "方形", "三角形", "菱形")
COUNTS = ("一个", "两个", "三个", "四个")
BACKGROUNDS = ((246, 244, 236), (236, 242, 248), (244, 240, 248), (240, 246, 238))

# RAG-IGBench-style queries: the wording decides the query type (what the "category" field must say)
TOPICS = ("蛋糕", "火锅", "咖啡", "面包", "公园", "海边", "手机", "电脑", "猫咪", "小狗", "跑步", "游泳", "基金",
          "防晒", "客厅", "阳台", "花草", "相机", "耳机", "书包", "米饭", "水果", "雪山", "古镇", "地铁", "茶叶")
QUERY_FORMS = {
    "how-to": ("{a}怎么选", "{a}怎么保养", "{a}怎么做才好"),
    "what-is": ("什么是好的{a}", "{a}有什么讲究", "{a}是什么"),
    "yes-or-no": ("{a}值得买吗", "{a}适合新手吗", "{a}可以每天用吗"),
    "head-to-head": ("{a}和{b}哪个好", "{a}和{b}怎么选", "{a}还是{b}"),
}
CLAUSE_HEADS = ("先看", "注意", "记得", "最好", "可以", "不要", "每天", "提前", "尽量", "适当", "重点", "多用")
CLAUSE_TAILS = ("温度", "颜色", "价格", "时间", "材料", "大小", "味道", "品牌", "口碑", "做工", "重量", "季节",
                "位置", "用量", "步骤", "天气")
CLAUSE_ENDS = ("更稳妥", "效果好", "很重要", "省时间", "不踩坑", "更安心", "更方便", "最关键")


def _font(size: int):
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, ImportError, OSError):  # Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


def is_heldout(key: str) -> bool:
    """The split rule: an eighth of all keys are held-out (stable across runs and machines)."""
    return int(hashlib.sha1(key.encode("utf-8")).hexdigest(), 16) % 8 == 0


def _in_split(key: str, split: str) -> bool:
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    return is_heldout(key) == (split == "heldout")


# ------------------------------------------------------------------------------------------- drawing

def text_image(rng: random.Random, lines: list[str], size: tuple[int, int] = OCR_SIZE) -> Image.Image:
    """Dark text lines on a plain light background, line i inside the i-th 32-pixel token row."""
    w, h = size
    img = Image.new("RGB", size, rng.choice(BACKGROUNDS))
    draw = ImageDraw.Draw(img)
    font = _font(24)
    ink = (rng.randint(0, 60), rng.randint(0, 60), rng.randint(0, 80))
    for i, line in enumerate(lines):
        left, top, right, bottom = font.getbbox(line)
        x = rng.randint(2, max(2, w - (right - left) - 4))
        y = i * MERGE_PX + rng.randint(2, 5) - top
        draw.text((x - left, y), line, font=font, fill=ink)
    return img


@dataclass
class Shape:
    kind: str
    colour: str
    box: tuple[int, int, int, int]


def _draw_shape(draw: ImageDraw.ImageDraw, s: Shape) -> None:
    x0, y0, x1, y1 = s.box
    fill = COLOURS[s.colour]
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    if s.kind == "圆形":
        draw.ellipse(s.box, fill=fill)
    elif s.kind == "方形":
        draw.rectangle(s.box, fill=fill)
    elif s.kind == "三角形":
        draw.polygon([(cx, y0), (x1, y1), (x0, y1)], fill=fill)
    else:
        draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=fill)


def random_shapes(rng: random.Random, size: tuple[int, int], n: int) -> list[Shape]:
    """``n`` non-overlapping shapes of distinct colours (kinds may repeat)."""
    w, h = size
    colours = rng.sample(list(COLOURS), n)
    shapes: list[Shape] = []
    for colour in colours:
        for _ in range(200):
            d = rng.randint(20, 30)
            x0, y0 = rng.randint(4, w - d - 4), rng.randint(4, h - d - 4)
            box = (x0, y0, x0 + d, y0 + d)
            if all(box[2] + 4 < o.box[0] or o.box[2] + 4 < box[0] or box[3] + 4 < o.box[1] or o.box[3] + 4 < box[1]
                   for o in shapes):
                shapes.append(Shape(rng.choice(KINDS), colour, box))
                break
    return shapes


def shape_image(rng: random.Random, shapes: list[Shape], size: tuple[int, int]) -> Image.Image:
    img = Image.new("RGB", size, rng.choice(BACKGROUNDS))
    draw = ImageDraw.Draw(img)
    for s in shapes:
        _draw_shape(draw, s)
    if _v2():  # generator 2: each shape alone in one 32-pixel cell (the training-only cell targets, CELLS_KEY)
        img.info[CELLS_KEY] = {(sum(s.box[1::2]) // 2 // MERGE_PX, sum(s.box[::2]) // 2 // MERGE_PX): s.colour
                               for s in shapes}
    return img


# ------------------------------------------------------------------------------- drawing, generator 2
# Why generator 2: with generator 1 the tiny model never learnt to read (glyphs of 24 px at random x offsets,
# two or three characters sharing one 32-pixel LLM token, 33 symbols) nor to answer shape questions above
# chance, and the text images were no denser than the shape images, so the request-wide VisionZip budget
# could not favour them. Generator 2 puts every character, and every shape, in its own 32 × 32 cell (= one
# LLM visual token): reading becomes "classify each cell, in order", a text image is 75-100 % content cells
# and a shape image 6-33 %, which is the OCRBench vs CCBench contrast the budget competition is about.

V2_ALPHABET = "ACEHKLNPRTXY" + DIGITS  # 12 visually distinct capitals + digits, one token each
V2_FONT = 28
# what each content cell of a generator-2 image holds, {(row, col): glyph | colour word}, in ``Image.info``:
# recorded (never drawn from the rng, so items are unchanged) for the training-only cell loss (train_cells.py)
CELLS_KEY = "harness_cells"


def _v2() -> bool:
    return _ACTIVE["version"] == "2"


def text_image_v2(rng: random.Random, lines: list[str], width: int = 4 * MERGE_PX) -> Image.Image:
    """Big glyphs, one per 32-pixel cell (a few pixels of jitter), line i in token row i; height 32 · lines."""
    size = (width, MERGE_PX * len(lines))
    img = Image.new("RGB", size, rng.choice(BACKGROUNDS))
    draw = ImageDraw.Draw(img)
    font = _font(V2_FONT)
    ink = (rng.randint(0, 60), rng.randint(0, 60), rng.randint(0, 80))
    cols = width // MERGE_PX
    cells: dict[tuple[int, int], str] = {}
    img.info[CELLS_KEY] = cells
    for i, line in enumerate(lines):
        start = rng.randint(0, cols - len(line))
        for j, ch in enumerate(line):
            cells[(i, start + j)] = ch
            left, top, right, bottom = font.getbbox(ch)
            x = (start + j) * MERGE_PX + (MERGE_PX - (right - left)) // 2 + rng.randint(-1, 1)
            y = i * MERGE_PX + (MERGE_PX - (bottom - top)) // 2 + rng.randint(-1, 1)
            draw.text((x - left, y - top), ch, font=font, fill=ink)
    return img


def random_shapes_v2(rng: random.Random, size: tuple[int, int], n: int) -> list[Shape]:
    """``n`` shapes of distinct colours, each alone in its own 32 × 32 cell (22-28 px, jittered inside it)."""
    w, h = size
    cells = rng.sample([(cx, cy) for cy in range(h // MERGE_PX) for cx in range(w // MERGE_PX)], n)
    shapes = []
    for colour, (cx, cy) in zip(rng.sample(list(COLOURS), n), cells):
        d = rng.randint(22, 28)
        x0 = cx * MERGE_PX + rng.randint(1, MERGE_PX - d - 1)
        y0 = cy * MERGE_PX + rng.randint(1, MERGE_PX - d - 1)
        shapes.append(Shape(rng.choice(KINDS), colour, (x0, y0, x0 + d, y0 + d)))
    return shapes


def _text_image(rng: random.Random, lines: list[str]) -> Image.Image:
    return text_image_v2(rng, lines) if _v2() else text_image(rng, lines)


def _random_shapes(rng: random.Random, size: tuple[int, int], n: int) -> list[Shape]:
    return random_shapes_v2(rng, size, n) if _v2() else random_shapes(rng, size, n)


# ---------------------------------------------------------------------------------------------- items

@dataclass
class OcrItem:
    key: str
    image: Image.Image
    question: str
    answers: list[str]
    qtype: str


@dataclass
class McqItem:
    key: str
    image: Image.Image
    question: str
    options: dict[str, str]
    answer: str
    category: str


@dataclass
class RagItem:
    key: str
    query: str
    qtype: str
    documents: list[str]
    images: list[list[Image.Image]]
    kinds: list[list[str]]  # "text" | "scene" per image, per note
    answer: str = ""
    raw_answer: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _word(rng: random.Random, lo: int, hi: int, chars: str) -> str:
    return "".join(rng.choice(chars) for _ in range(rng.randint(lo, hi)))


def ocr_item(rng: random.Random, split: str) -> OcrItem:
    """One OCR question of ``split``: 2/3 read-the-lines, 1/3 read-the-number."""
    v2 = _v2()
    while True:
        if rng.random() < 2 / 3:
            lines = ([_word(rng, 3, 4, V2_ALPHABET) for _ in range(rng.randint(1, 2))] if v2 else
                     [_word(rng, 3, 5, ALPHABET + DIGITS) for _ in range(rng.randint(1, 2))])
            question, qtype = READ_Q, "Regular Text Recognition"
        else:
            lines = [_word(rng, 3, 4, DIGITS)] if v2 else [_word(rng, 4, 6, DIGITS)]
            question, qtype = NUMBER_Q, "Digit String Recognition"
        text = " ".join(lines)
        if _in_split("ocr:" + text, split):
            return OcrItem("ocr:" + text, _text_image(rng, lines), question, [text], qtype)


def mcq_item(rng: random.Random, split: str) -> McqItem:
    """One multiple-choice question about a shape image (options in random order: rotations come for free)."""
    while True:
        size = rng.choice(SHAPE_SIZES)
        shapes = _random_shapes(rng, size, rng.randint(1, 4))
        kind = rng.randrange(3)
        if kind == 0:
            question, gold, pool, category = "图中有几个图形？", COUNTS[len(shapes) - 1], list(COUNTS), "Count"
        elif kind == 1:
            s = rng.choice(shapes)
            question, gold, pool, category = f"图中{s.colour[0]}色的图形是什么形状？", s.kind, list(KINDS), "Shape"
        else:
            unique = [s for s in shapes if sum(o.kind == s.kind for o in shapes) == 1]
            if not unique:
                continue
            s = rng.choice(unique)
            question, gold, pool, category = f"图中的{s.kind}是什么颜色？", s.colour, list(COLOURS), "Colour"
        rng.shuffle(pool)
        if rng.random() < 0.15:  # three options (CCBench has such rows: D empty)
            pool.remove(rng.choice([p for p in pool if p != gold]))
        if rng.random() < 0.1:  # a two-line question (a quoted newline in the TSV)
            question = "看图回答。\n" + question
        layout = ";".join(f"{s.kind}{s.colour}{s.box}" for s in shapes)
        key = f"mcq:{question}:{layout}"
        if _in_split(key, split):
            options = dict(zip("ABCD", pool))  # three options: no "D"
            answer = "ABCD"[pool.index(gold)]
            return McqItem(key, shape_image(rng, shapes, size), question, options, answer, category)


def _clause(rng: random.Random) -> str:
    return rng.choice(CLAUSE_HEADS) + rng.choice(CLAUSE_TAILS) + rng.choice(CLAUSE_ENDS)


def rag_answer(query: str, qtype: str, documents: list[str], kinds: list[list[str]]) -> tuple[str, str]:
    """The reference (clean answer, raw JSON answer): each note's first clause with its citation, then the
    note's text images in order."""
    parts, k = [], 0
    for di, (doc, note_kinds) in enumerate(zip(documents, kinds), start=1):
        parts.append(f"{doc.split('，')[0]}<sup>[{di}](DOC#{di})</sup>。")
        for kind in note_kinds:
            k += 1
            if kind == "text":
                parts.append(f"![示意图](IMG#{k})")
    answer = f"**{query}**\n\n" + "\n\n".join(parts)
    raw = json.dumps({"reason": f"用户询问{query}，属于{qtype}类别。", "category": qtype, "answer": answer},
                     ensure_ascii=False)
    return answer, raw


def rag_item(rng: random.Random, split: str) -> RagItem:
    """One RAG-IGBench-style question: three notes, 1-2 images each, at least one text image."""
    while True:
        qtype = rng.choice(list(QUERY_FORMS))
        a, b = rng.sample(TOPICS, 2)
        query = rng.choice(QUERY_FORMS[qtype]).format(a=a, b=b)
        documents = [f"{_clause(rng)}，{_clause(rng)}。" for _ in range(3)]
        kinds = [[rng.choice(("text", "scene")) for _ in range(rng.randint(1, 2))] for _ in documents]
        if not any("text" in k for k in kinds):
            kinds[rng.randrange(3)][0] = "text"
        key = "rag:" + query + "|" + "|".join(documents)
        if not _in_split(key, split):
            continue
        images = []
        for note_kinds in kinds:
            imgs = []
            for kind in note_kinds:
                if kind == "text":
                    words = ([_word(rng, 3, 4, V2_ALPHABET) for _ in range(2)] if _v2() else
                             [_word(rng, 3, 5, ALPHABET + DIGITS) for _ in range(2)])
                    imgs.append(_text_image(rng, words))
                else:
                    size = rng.choice(SHAPE_SIZES)
                    imgs.append(shape_image(rng, _random_shapes(rng, size, rng.randint(1, 3)), size))
            images.append(imgs)
        answer, raw = rag_answer(query, qtype, documents, kinds)
        return RagItem(key, query, qtype, documents, images, kinds, answer, raw)


def items(task: str, split: str, n: int, seed: int = 0) -> list:
    """``n`` items of ``task`` (``ocr`` | ``mcq`` | ``rag``) from ``split``, a pure function of the seed."""
    make = {"ocr": ocr_item, "mcq": mcq_item, "rag": rag_item}[task]
    rng = random.Random(f"{_ACTIVE['version']}:{task}:{split}:{seed}")
    return [make(rng, split) for _ in range(n)]


def corpus_lines() -> list[str]:
    """Text the tokenizer must encode compactly: every word the generator can put in a prompt or answer."""
    lines = [READ_Q, NUMBER_Q, " ".join(ALPHABET), " ".join(DIGITS), " ".join(KINDS), " ".join(COUNTS),
             " ".join(COLOURS), " ".join(c[0] + "色的图形是什么形状？" for c in COLOURS),
             "图中有几个图形？ 图中的 是什么颜色？ Question: Options: A. B. C. D. 请直接回答选项字母。",
             "Image 1: Image 2: Image 3: The question below is about Image 1.", " ".join(TOPICS),
             " ".join(CLAUSE_HEADS), " ".join(CLAUSE_TAILS), " ".join(CLAUSE_ENDS)]
    for forms in QUERY_FORMS.values():
        lines += [f.format(a=t, b=TOPICS[(i + 1) % len(TOPICS)]) for f in forms for i, t in enumerate(TOPICS)]
    rng = random.Random(0)
    for _ in range(200):
        lines.append(rag_answer(*_fake_rag(rng))[1])
    return lines


def _fake_rag(rng: random.Random) -> tuple[str, str, list[str], list[list[str]]]:
    qtype = rng.choice(list(QUERY_FORMS))
    query = rng.choice(QUERY_FORMS[qtype]).format(a=rng.choice(TOPICS), b=rng.choice(TOPICS))
    docs = [f"{_clause(rng)}，{_clause(rng)}。" for _ in range(3)]
    kinds = [[rng.choice(("text", "scene")) for _ in range(rng.randint(1, 2))] for _ in docs]
    return query, qtype, docs, kinds


if __name__ == "__main__":  # the bundling moved to harness.datasets.synthetic.bundle; the old command still works
    import importlib  # by name: synthetic_bundle imports this module, and only the old command needs it back

    raise SystemExit(importlib.import_module("harness.datasets.synthetic.bundle").main(prog="harness.datasets.synthetic.tasks"))
