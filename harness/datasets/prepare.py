"""Prepare benchmark data that is not shipped as one file.

``python -m harness.datasets.prepare rag_igbench --src RAG_IG_CH.jsonl --out data/rag_igbench/images``
downloads every image URL of a RAG-IGBench file once, into ``OUT/<url_to_filename(url)>`` — the file the
RAG-IGBench loader looks for — with the width limited to 540 px as the benchmark does (its
``download_images.py`` asks the image server for ``w/540`` instead of ``w/720``/``w/1080``; we do the same
and also shrink any image still wider than 540 px, keeping the aspect ratio).

* Resumable: files already present and decodable are skipped; a file that is present but broken is fetched
  again. Each download is written to ``.<name>.part`` and renamed into place only once complete, so an
  interrupted run never leaves a truncated image under a final name.
* Offline: when a host cannot be reached (DNS failure, refused or timed-out connection) the command stops
  at once with a clear message and exit status 3; already downloaded files are kept, so re-running later
  resumes. An image the server refuses (HTTP 404...) or that cannot be decoded is reported, listed in
  ``OUT/prepare_failures.tsv``, and the others go on (exit status 1).

Exit status: 0 all images present; 1 some images failed; 2 bad arguments or source file; 3 offline.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from harness.datasets.rag_igbench import iter_rows, note_images, url_to_filename

MAX_WIDTH = 540
USER_AGENT = "moe-vlm-harness-prepare/1"
_URL = ("http://", "https://", "ftp://", "file://")


class Offline(RuntimeError):
    """A host could not be reached at all: the machine is offline or the host is down."""


class FetchFailed(RuntimeError):
    """One image could not be fetched or decoded (the run goes on)."""


def upstream_url(url: str) -> str:
    """The URL the benchmark's own downloader fetches: the server-side 540 px variant."""
    return url.replace("w/720", "w/540").replace("w/1080", "w/540")


def fetch_bytes(url: str, timeout: float) -> bytes:
    """The body at ``url`` (``urllib``; ``file://`` works too). Connection problems raise :class:`Offline`."""
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    scheme = urllib.parse.urlsplit(url).scheme
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read()
    except urllib.error.HTTPError as e:  # the server answered: this image only
        raise FetchFailed(f"HTTP {e.code} {e.reason}") from e
    except urllib.error.URLError as e:
        if scheme == "file":
            raise FetchFailed(str(e.reason)) from e
        host = urllib.parse.urlsplit(url).netloc
        raise Offline(f"cannot reach {host}: {e.reason}") from e
    except (TimeoutError, ConnectionError) as e:
        raise Offline(f"cannot reach {urllib.parse.urlsplit(url).netloc}: {e}") from e


def shrink(data: bytes, max_width: int = MAX_WIDTH) -> bytes:
    """``data`` unchanged if it decodes and is at most ``max_width`` wide, else re-encoded narrower."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise FetchFailed(f"not a decodable image: {e}") from e
    if img.width <= max_width:
        return data
    fmt = img.format if img.format in {"JPEG", "PNG", "WEBP"} else "JPEG"
    height = max(1, round(img.height * max_width / img.width))
    if fmt == "JPEG" and img.mode not in {"RGB", "L"}:
        img = img.convert("RGB")
    out = io.BytesIO()
    img.resize((max_width, height), Image.LANCZOS).save(out, format=fmt, **({"quality": 90} if fmt != "PNG" else {}))
    return out.getvalue()


def is_complete(path: Path) -> bool:
    """A final file that exists, is not empty and decodes (a truncated image does not)."""
    from PIL import Image

    if not path.is_file() or path.stat().st_size == 0:
        return False
    try:
        with Image.open(path) as img:
            img.load()
        return True
    except Exception:  # noqa: BLE001 - any decoding problem means "fetch again"
        return False


def image_urls(src: Path) -> Iterator[str]:
    """Every image URL of a RAG-IGBench file, first occurrence order, without duplicates."""
    seen: set[str] = set()
    for lineno, row in iter_rows(src):
        if not isinstance(row, dict) or "images" not in row:
            raise ValueError(f"{src}: line {lineno} has no field 'images'")
        if not isinstance(row["images"], list):
            raise ValueError(f"{src}: line {lineno}: field 'images' must be a list, got {type(row['images']).__name__}")
        for i, note in enumerate(row["images"]):
            try:
                urls = note_images(note, i)
            except ValueError as e:  # a RowFault: name the line
                raise ValueError(f"{src}: line {lineno}: {e}") from e
            for url in urls:
                if url.startswith(_URL) and url not in seen:
                    seen.add(url)
                    yield url


def download_one(url: str, out: Path, timeout: float, retries: int, backoff: float, max_width: int) -> bool:
    """Fetch, shrink and atomically store one image; False when a complete file was already there."""
    name = url_to_filename(url)
    if is_complete(out / name):
        return False
    for attempt in range(retries + 1):
        try:
            data = fetch_bytes(upstream_url(url), timeout)
            break
        except Offline:
            if attempt == retries:
                raise
            time.sleep(backoff * (2**attempt))
    data = shrink(data, max_width)
    tmp = out / f".{name}.{os.getpid()}.part"
    try:
        tmp.write_bytes(data)
        os.replace(tmp, out / name)
    finally:
        tmp.unlink(missing_ok=True)
    return True


def prepare_rag_igbench(src: Path, out: Path, workers: int = 8, timeout: float = 30.0, retries: int = 2,
                        backoff: float = 1.0, max_width: int = MAX_WIDTH, progress: bool = True) -> int:
    """Download the images of ``src`` into ``out``; returns the exit status (see the module docstring)."""
    from tqdm.auto import tqdm

    if not src.is_file():
        print(f"error: source file not found: {src}", file=sys.stderr)
        return 2
    try:
        urls = list(image_urls(src))
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(".*.part"):  # left by an interrupted run
        stale.unlink(missing_ok=True)
    failures: list[tuple[str, str]] = []
    offline: Offline | None = None
    done = skipped = 0
    bar = tqdm(total=len(urls), desc="rag_igbench images", unit="img", disable=not progress)
    pool = ThreadPoolExecutor(max_workers=max(1, workers))
    # The first unreachable host stops every worker, not only the loop below: a worker that raced ahead of the
    # main thread (it fails fast, the main thread may not be scheduled for a while) would otherwise try every
    # remaining URL before cancel_futures drops them.
    stop = threading.Event()

    def one(url: str) -> bool | None:
        if stop.is_set():
            return None
        try:
            return download_one(url, out, timeout, retries, backoff, max_width)
        except Offline:
            stop.set()
            raise

    try:  # the completeness check (a full decode) runs in the workers too, so the bar moves from the start
        futures = {pool.submit(one, u): u for u in urls}
        for future in as_completed(futures):
            try:
                got = future.result()
                if got is None:      # not started: another worker found the host unreachable
                    continue
                if got:
                    done += 1
                else:
                    skipped += 1
            except Offline as e:
                offline = e
                break
            except FetchFailed as e:
                failures.append((futures[future], str(e)))
            bar.update(1)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # after an Offline: drop what has not started
    bar.close()
    failures_file = out / "prepare_failures.tsv"
    failures_file.unlink(missing_ok=True)  # a previous run's list is stale now
    if failures:
        with open(failures_file, "w", encoding="utf-8") as f:
            f.write("url\tfile\treason\n")
            for url, reason in failures:
                f.write(f"{url}\t{url_to_filename(url)}\t{reason}\n")
    if offline:
        print(
            f"\nrag_igbench prepare: {offline}.\nThis machine seems to be offline (or the image host is down), "
            "so no more images can be downloaded now. Nothing is lost: the images already in "
            f"{out} are kept and a later run resumes where this one stopped. "
            "Run the same command on a machine with network access (or copy a prepared folder here) and point "
            "dataset.image_root at it.",
            file=sys.stderr,
        )
        return 3
    print(f"rag_igbench prepare: {len(urls)} images — {done} downloaded, {skipped} already present, "
          f"{len(failures)} failed" + (f" (listed in {failures_file}; re-run to retry)" if failures else ""),
          file=sys.stderr)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.datasets.prepare", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="dataset", required=True)
    rag = sub.add_parser("rag_igbench", help="download the images of a RAG-IGBench file (resumable)")
    rag.add_argument("--src", type=Path, required=True, help="RAG_IG_CH.jsonl or RAG_IG_EN.json")
    rag.add_argument("--out", type=Path, required=True, help="image folder (dataset.image_root)")
    rag.add_argument("--workers", type=int, default=8, help="parallel downloads (default 8)")
    rag.add_argument("--timeout", type=float, default=30.0, help="seconds per request (default 30)")
    rag.add_argument("--retries", type=int, default=2, help="retries after a connection failure (default 2)")
    rag.add_argument("--backoff", type=float, default=1.0, help="first retry delay in seconds, doubled each time")
    rag.add_argument("--max-width", type=int, default=MAX_WIDTH, help="shrink wider images (default 540)")
    rag.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    return prepare_rag_igbench(args.src, args.out, workers=args.workers, timeout=args.timeout,
                               retries=args.retries, backoff=args.backoff, max_width=args.max_width,
                               progress=not args.no_progress)


if __name__ == "__main__":
    sys.exit(main())
