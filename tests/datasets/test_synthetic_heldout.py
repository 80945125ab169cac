"""``python -m harness.datasets.synthetic.bundle heldout DIR``: the larger held-out sets the sensitivity tests run
on, in the benchmarks' own formats, drawn only from the held-out split and reproducible."""

from __future__ import annotations

from harness.datasets.synthetic import tasks as st
from harness.datasets.synthetic.bundle import main


def test_heldout_writes_loadable_reproducible_sets(tmp_path, capsys):
    import hashlib

    from pathlib import Path

    from harness.config.schema import DatasetConfig
    from harness.datasets.rag_igbench import load

    assert main(["heldout", str(tmp_path / "a"), "--n", "6"]) == 0
    assert main(["heldout", str(tmp_path / "b"), "--n", "6"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[0].endswith("rag/data.jsonl") and printed[1].endswith("mcq/CCBench_sample.tsv")
    for rel in ("rag/data.jsonl", "mcq/CCBench_sample.tsv"):
        a, b = ((tmp_path / d / rel).read_bytes() for d in ("a", "b"))
        assert hashlib.sha256(a).digest() == hashlib.sha256(b).digest()  # a pure function of (generator, n, seed)
    rows = (tmp_path / "a" / "rag" / "data.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(rows) == 6
    cfg = DatasetConfig(name="rag_igbench", path=str(tmp_path / "a" / "rag" / "data.jsonl"), image_root=None, split=None)
    samples = list(load(cfg, Path.cwd()))
    assert len(samples) == 6 and all(s.images for s in samples)  # the loader reads them, images included
    assert all(st.is_heldout(it.key) for it in st.items("rag", "heldout", 6, 0))


def test_the_command_refuses_a_missing_or_unknown_subcommand_with_its_usage(capsys):
    import pytest

    for argv in ([], ["held"], ["heldout"], ["heldout", "x", "--n", "many"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert "usage: python -m harness.datasets.synthetic.bundle" in capsys.readouterr().err


def test_heldout_honours_the_generator_flag_after_the_subcommand(tmp_path, monkeypatch):
    from harness.datasets.synthetic import bundle

    seen = []
    monkeypatch.setattr(bundle, "use_generator", seen.append)
    monkeypatch.setattr(bundle, "heldout", lambda root, n: {"rag": f"{root}/{n}"})
    assert main(["heldout", str(tmp_path), "--n", "3", "--generator", "1"]) == 0
    assert seen == ["1"]
