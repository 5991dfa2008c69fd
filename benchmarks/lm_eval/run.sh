#!/usr/bin/env bash
# Short lm-evaluation-harness run against a running radixserve server (or any OpenAI-compatible
# /v1/completions server), fully offline.
#
#   benchmarks/lm_eval/run.sh BASE_URL TOKENIZER_DIR [MODEL_NAME] [TASKS] [extra lm_eval args...]
#
#   BASE_URL       e.g. http://127.0.0.1:18123  (with or without /v1, /v1/completions)
#   TOKENIZER_DIR  the HF folder the server serves (lm_eval tokenizes locally and sends token ids)
#   MODEL_NAME     the server's served model name (default: basename of TOKENIZER_DIR, which is
#                  radixserve serve's default --served-model-name)
#   TASKS          default radixserve_tiny_mc,radixserve_tiny_gen
#
# Env: LM_EVAL (default: lm_eval on PATH, else /tmp/lmeval/bin/lm_eval), OUT (results folder,
# default benchmarks/lm_eval/results), LIMIT (items per task, default all), BATCH (prompts per
# request, default 1).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[[ $# -ge 2 ]] || { sed -n 2,16p "${BASH_SOURCE[0]}"; exit 2; }
base="${1%/}"; tok="$(cd "$2" && pwd)"; model="${3:-$(basename "$tok")}"
tasks="${4:-radixserve_tiny_mc,radixserve_tiny_gen}"; shift $(( $# < 4 ? $# : 4 ))
base="${base%/completions}"; base="${base%/v1}"; url="$base/v1/completions"
lm_eval="${LM_EVAL:-$(command -v lm_eval || echo /tmp/lmeval/bin/lm_eval)}"
out="${OUT:-$here/results}"

export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export TOKENIZERS_PARALLELISM=false
cd "$here"  # the task YAMLs' data_files are relative to the current directory

args=(--model local-completions
      --model_args "model=$model,base_url=$url,tokenizer_backend=huggingface,tokenizer=$tok,tokenized_requests=True,num_concurrent=1,max_retries=1,max_length=2048,max_gen_toks=16"
      --batch_size "${BATCH:-1}" --include_path "$here" --tasks "$tasks" --output_path "$out" --log_samples --seed 1234)
[[ -n "${LIMIT:-}" ]] && args+=(--limit "$LIMIT")
set -x
exec "$lm_eval" "${args[@]}" "$@"
