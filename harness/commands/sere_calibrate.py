"""``python -m harness.commands.sere_calibrate``: compute a MoE model's SERE expert-similarity matrices and save
them (safetensors with metadata). The algorithm lives in :mod:`harness.techniques.sere.calibration`; this is
only its command line, kept out of the technique so the technique imports no loader of models by CLI argument.
"""

from __future__ import annotations

import argparse

from harness.models.load import load_model_for_calibration
from harness.techniques.sere.calibration import (
    DEFAULT_MAX_SEQ_LEN,
    DEFAULT_MAX_TOKENS,
    TEXT_FIELDS,
    compute_similarity,
    save_similarity,
)


def add_common_args(parser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory or hub id")
    parser.add_argument("--out", required=True, help="output .safetensors file")
    parser.add_argument("--text", "--data", dest="text", default=None,
                        help="calibration data: a UTF-8 text file (blank-line separated documents), a .jsonl / "
                             ".json of documents (strings or objects with a text field), or a directory of "
                             "those (default: the shipped ~3k-token text)")
    parser.add_argument("--text-field", default=None,
                        help=f"JSON field holding a document's text (default: the first of {', '.join(TEXT_FIELDS)})")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                        help=f"token budget (default {DEFAULT_MAX_TOKENS} = the reference's 32 x 512)")
    parser.add_argument("--max-seq-len", type=int, default=DEFAULT_MAX_SEQ_LEN, help="tokens per document (512)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    parser.add_argument("--model-id", default=None, help="name recorded in the metadata (default: --model)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.commands.sere_calibrate",
                                     description="Compute SERE expert-similarity matrices of a MoE model.")
    add_common_args(parser)
    args = parser.parse_args(argv)
    model, tokenizer = load_model_for_calibration(args.model, args.device, args.dtype)
    sims, meta = compute_similarity(model, tokenizer, text_path=args.text, max_tokens=args.max_tokens,
                                    max_seq_len=args.max_seq_len, model_id=args.model_id or args.model,
                                    progress=True, text_field=args.text_field)
    out = save_similarity(args.out, sims, meta)
    short = "" if meta["budget_met"] else f" (budget {meta['max_tokens']} not met: the data ran out)"
    print(f"wrote {out}: {len(sims)} layers x [{meta['num_experts']}, {meta['num_experts']}], "
          f"{meta['tokens']} calibration tokens{short}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
