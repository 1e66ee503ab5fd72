#!/bin/bash
# Issue 26: lm-eval's RULER tasks at 1024 tokens through `vtoken serve` (server defaults: chunked prefill,
# 4 concurrent requests) — stock vLLM against the parity setting, decode-only H2O 10 %. Produced this folder:
#   docs/results/lm-eval/run.sh                                   (TASKS=niah_single_1)
#   TASKS=ruler_cwe,ruler_vt docs/results/lm-eval/run.sh
# lm-eval in a venv of its own at /tmp/lmeval (docs/quality.md, "lm-eval against `vtoken serve`").
set -u
cd "$(dirname "$0")/../../.."
TASKS=${TASKS:-niah_single_1}
OUT=${OUT:-/tmp/vtoken-lm-eval}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE=disabled
MODEL_DIR=$HOME/.cache/vtoken/models/smollm2-135m-instruct
run() {  # name, serve args...
  name=$1; shift
  .venv/bin/vtoken serve --port 8123 "$@" > $OUT/lmeval-$name-server.log 2>&1 &
  spid=$!
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:8123/v1/models >/dev/null && break; sleep 5; done
  date; echo "serve $*"
  HF_DATASETS_OFFLINE=1 /tmp/lmeval/bin/lm_eval --model local-completions \
    --model_args model=smollm2-135m-instruct,base_url=http://127.0.0.1:8123/v1/completions,tokenizer=$MODEL_DIR,tokenizer_backend=huggingface,tokenized_requests=False,num_concurrent=4 \
    --tasks $TASKS --metadata '{"max_seq_lengths":[1024]}' --limit 50 \
    --output_path $OUT/lmeval-$name > $OUT/lmeval-$name.log 2>&1
  tail -8 $OUT/lmeval-$name.log
  kill -INT $spid; wait $spid
  date
}
run stock --mode none
run decode-only-10 --mode repack --policy h2o --budget 0.1 --set vtoken.scope=generated
echo ALLDONE
