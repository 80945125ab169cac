"""How concentrated an embedded checkpoint's routing is on the text tasks, and what plain top-K truncation costs
it, teacher-forced (issue 28: why plain top-2 leaves the text tasks' answers unchanged).

    python benchmarks/routing_concentration.py [CKPT ...] [--n 32] [--out results/benchmarks/routing_concentration]

CPU, seconds per checkpoint (default: the committed one). Prints a table per checkpoint and task; writes
``--out``.json. ``harness.models.train_eval.routing_concentration`` does the measuring."""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TEXT = ("text_arith", "text_list", "text_lookup", "text_choice")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpts", nargs="*", type=Path)
    ap.add_argument("--tasks", default=",".join(TEXT))
    ap.add_argument("--n", type=int, default=32, help="held-out examples per task")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "results" / "benchmarks" / "routing_concentration")
    args = ap.parse_args(argv)

    import torch
    from tqdm import tqdm
    from transformers import AutoTokenizer, Qwen3VLMoeForConditionalGeneration

    from harness.models.train_data import encode, make_example
    from harness.models.train_eval import routing_concentration
    from harness.models.trained import CHECKPOINT, sha256_file

    ckpts = args.ckpts or [CHECKPOINT]
    result = {"benchmark": "routing_concentration", "argv": " ".join(sys.argv[1:]), "torch": torch.__version__,
              "device": "cpu", "dtype": "float32", "weights": "trained (the checkpoints named)", "n": args.n,
              "split": "heldout", "checkpoints": {}}
    for ckpt in ckpts:
        tok = AutoTokenizer.from_pretrained(ckpt)
        model = Qwen3VLMoeForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32)
        per_task = {}
        for task in tqdm(args.tasks.split(","), desc=ckpt.name, unit="task"):
            rng = random.Random(args.seed)
            exs = [encode(make_example(task, rng, "heldout"), tok, model.config.image_token_id)
                   for _ in range(args.n)]
            per_task[task] = routing_concentration(model, exs)
        result["checkpoints"][str(ckpt)] = {"sha256": sha256_file(ckpt / "model.safetensors"), "tasks": per_task}
        print(f"\n{ckpt} (top-k {model.config.text_config.num_experts_per_tok})\n")
        print("| task | top-1 weight share | top-2 share | answer log-prob top-4 / 2 / 1 | group slots |")
        print("|---|---|---|---|---|")
        for task, r in per_task.items():
            lp = r["answer_logprob"]
            print(f"| {task} | {r['weight_share'][1]:.2f} | {r['weight_share'][2]:.2f} | "
                  f"{' / '.join(f'{v:.3f}' for v in lp.values())} | {r['group_share']} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
