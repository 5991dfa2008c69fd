"""Hold an lm_eval run's log-likelihoods against HF transformers on the same weights.

    python benchmarks/lm_eval/check_against_hf.py MODEL_DIR SAMPLES.jsonl [--out result.json]

For every (context, continuation) of a ``multiple_choice`` task's samples (``--log_samples``), the
continuation's summed log-probability as lm_eval got it from the server, against HF's teacher-forced
log-softmax on the same tokens (lm_eval's split: context encoded alone, the continuation being the
rest of the whole's encoding). Exits 1 when any pair differs by more than ``--tol``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("samples")
    ap.add_argument("--tol", type=float, default=1e-3)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir).eval()
    pairs = []
    for line in Path(args.samples).read_text().splitlines():
        sample = json.loads(line)
        for gen, resp in zip(sample["arguments"].values(), sample["resps"], strict=True):
            context, continuation = gen["arg_0"], gen["arg_1"]
            whole = tok.encode(context + continuation)
            n_ctx = len(tok.encode(context))
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
            ref = sum(lp[i - 1, whole[i]].item() for i in range(n_ctx, len(whole)))
            served = float(resp[0][0])
            pairs.append({"doc_id": sample["doc_id"], "served": served, "hf": ref, "diff": abs(served - ref)})
    worst = max(p["diff"] for p in pairs)
    result = {"pairs": len(pairs), "max_abs_diff": worst, "tolerance": args.tol, "ok": worst <= args.tol}
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps({**result, "each": pairs}, indent=1) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
