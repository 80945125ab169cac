"""``python -m harness.datasets.prepare rag_igbench``: resumable, atomic, 540 px, polite when offline.

Never touches the network: images come from ``file://`` URLs, and the offline case is a refused connection
to a closed port on this machine (or a patched fetch).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from PIL import Image

from harness.config.schema import DatasetConfig
from harness.datasets import load_samples
from harness.datasets import prepare
from harness.datasets.rag_igbench import url_to_filename


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)


def make_src(tmp_path: Path, urls: list[list[str]]) -> Path:
    rows = [{"id": 1, "query": "q", "documents": [f"d{i}" for i in range(len(urls))], "images": urls,
             "gt_clean_answer": "a ![x](IMG#1)", "split": "dev"}]
    src = tmp_path / "src.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return src


def local_images(tmp_path: Path) -> list[str]:
    srv = tmp_path / "server"
    srv.mkdir()
    Image.new("RGB", (1080, 720), (200, 40, 40)).save(srv / "wide.jpg", quality=90)
    Image.new("RGB", (120, 80), (40, 40, 200)).save(srv / "small.png")
    Image.new("RGB", (900, 300), (40, 200, 40)).save(srv / "wide.webp")
    return [(srv / n).as_uri() for n in ("wide.jpg", "small.png", "wide.webp")]


def run(src: Path, out: Path, *extra: str) -> int:
    return prepare.main(["rag_igbench", "--src", str(src), "--out", str(out), "--no-progress", "--workers", "2",
                         "--retries", "0", *extra])


def test_download_resize_and_resume(tmp_path, monkeypatch, capsys):
    urls = local_images(tmp_path)
    missing = (tmp_path / "server" / "gone.jpg").as_uri()
    src = make_src(tmp_path, [urls[:2], [urls[2], missing, urls[0]]])  # a duplicate URL is fetched once
    out = tmp_path / "images"
    assert run(src, out) == 1  # one image failed, the others are there
    assert "3 downloaded, 0 already present, 1 failed" in capsys.readouterr().err
    for url in urls:
        with Image.open(out / url_to_filename(url)) as im:
            assert im.width <= 540
    with Image.open(out / url_to_filename(urls[0])) as im:
        assert im.size == (540, 360) and im.format == "JPEG"
    with Image.open(out / url_to_filename(urls[1])) as im:
        assert im.size == (120, 80)  # narrow images are kept as they are
    assert missing in (out / "prepare_failures.tsv").read_text(encoding="utf-8")
    assert not list(out.glob(".*.part"))

    # resume: nothing present and complete is fetched again; a truncated file and stale temp files are handled
    fetched: list[str] = []
    real = prepare.fetch_bytes
    monkeypatch.setattr(prepare, "fetch_bytes", lambda url, timeout: fetched.append(url) or real(url, timeout))
    broken = out / url_to_filename(urls[2])
    broken.write_bytes(broken.read_bytes()[:100])
    (out / f".{url_to_filename(urls[0])}.999.part").write_bytes(b"half")
    assert run(src, out) == 1
    assert sorted(fetched) == sorted([urls[2], missing])
    assert "1 downloaded, 2 already present, 1 failed" in capsys.readouterr().err
    assert not list(out.glob(".*.part"))
    with Image.open(broken) as im:
        im.load()

    # the RAG-IGBench loader finds every prepared file by URL
    (tmp_path / "server" / "gone.jpg").write_bytes((tmp_path / "server" / "wide.jpg").read_bytes())
    fetched.clear()
    assert run(src, out) == 0 and fetched == [missing]
    assert not (out / "prepare_failures.tsv").exists()
    (sample,) = load_samples(DatasetConfig(name="rag_igbench", path=str(src), image_root=str(out)))
    assert [im.width for im in sample.load_images()] == [540, 120, 540, 540, 540]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_offline_refuses_politely(tmp_path, capsys):
    urls = local_images(tmp_path)
    out = tmp_path / "images"
    assert run(make_src(tmp_path, [urls[:1]]), out) == 0
    capsys.readouterr()
    src = make_src(tmp_path, [[urls[0], f"http://127.0.0.1:{closed_port()}/img/w/1080/a.jpg"]])
    assert run(src, out) == 3
    err = capsys.readouterr().err
    assert "cannot reach 127.0.0.1" in err and "offline" in err and "resumes" in err
    assert (out / url_to_filename(urls[0])).is_file()  # kept
    assert sorted(p.name for p in out.iterdir()) == [url_to_filename(urls[0])]  # nothing partial left


def test_offline_stops_the_whole_run(tmp_path, monkeypatch, capsys):
    calls: list[str] = []

    def dns_failure(url, timeout):
        calls.append(url)
        raise prepare.Offline("cannot reach sns-img.example.com: [Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(prepare, "fetch_bytes", dns_failure)
    src = make_src(tmp_path, [[f"https://sns-img.example.com/{i}.jpg" for i in range(50)]])
    assert prepare.main(["rag_igbench", "--src", str(src), "--out", str(tmp_path / "o"), "--no-progress",
                         "--workers", "1", "--retries", "1", "--backoff", "0"]) == 3
    assert len(calls) <= 4  # stops after the first unreachable host (with its retry), not after 50 tries
    assert "name resolution" in capsys.readouterr().err


def test_upstream_url_and_bad_source(tmp_path, capsys):
    assert prepare.upstream_url("https://x/abc/w/1080/format/jpg") == "https://x/abc/w/540/format/jpg"
    assert prepare.upstream_url("https://x/abc/w/720") == "https://x/abc/w/540"
    assert run(tmp_path / "nope.jsonl", tmp_path / "o") == 2
    assert "not found" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text(json.dumps({"id": 1}) + "\n", encoding="utf-8")
    assert run(tmp_path / "bad.jsonl", tmp_path / "o") == 2
    assert "no field 'images'" in capsys.readouterr().err
