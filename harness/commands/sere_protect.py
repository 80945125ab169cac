"""``python -m harness.commands.sere_protect``: rank each layer's experts by the damage SERE's re-routing does to
them and save the top n as the protected mask. The algorithm lives in :mod:`harness.techniques.sere.protection`;
this is its command line.
"""

from __future__ import annotations

import argparse

from harness.commands.sere_calibrate import add_common_args
from harness.models.load import load_model_for_calibration
from harness.techniques.sere.calibration import load_similarity
from harness.techniques.sere.protection import DEFAULT_BATCH_SIZE, RANK_BY, compute_protection, save_protection


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.commands.sere_protect",
                                     description="Rank experts by SERE re-routing damage; protect the top n.")
    add_common_args(parser)
    parser.add_argument("--similarity", required=True, help="similarity .safetensors (sere_calibration)")
    parser.add_argument("--k", type=int, required=True, help="primary experts per token (sere.k)")
    parser.add_argument("--rho", type=float, required=True, help="similarity threshold (sere.rho)")
    parser.add_argument("--n", type=int, required=True, help="protected experts per layer (sere.protect)")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                        help="tokens per decode-like batch forming P")
    parser.add_argument("--rank-by", choices=RANK_BY, default="total")
    args = parser.parse_args(argv)
    model, tokenizer = load_model_for_calibration(args.model, args.device, args.dtype)
    sims, _ = load_similarity(args.similarity)
    prot, scores, meta = compute_protection(model, tokenizer, sims, args.k, args.rho, args.n, text_path=args.text,
                                            max_tokens=args.max_tokens, max_seq_len=args.max_seq_len,
                                            batch_size=args.batch_size, rank_by=args.rank_by,
                                            model_id=args.model_id or args.model, progress=True,
                                            text_field=args.text_field)
    out = save_protection(args.out, prot, meta, scores)
    print(f"wrote {out}: {len(prot)} layers, {args.n} protected experts per layer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
