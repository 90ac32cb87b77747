#!/usr/bin/env bash
# One H200 call made of named stages (run from the repository root on the device machine):
#   bash scripts/h200_run.sh STAGE [STAGE ...]
# Stages:
#   setup         the fla-core wheel from .whl/ onto the path, a Triton cache from .tcache/ when carried
#   tests         the GPU tests named in $GPU_TESTS
#   prefill       bench_prefill at 8K / 32K / 128K (4 layers, chunks of 8,192)
#   prefill_binv  bench_prefill at 8K / 32K in the batch-invariant mode
#   prefill_1m    bench_prefill of one 1,048,000-token prompt
#   sweep         bench_invariant_linear --sweep (then --apply here)
#   binv          bench_e2e plain with the batch-invariant mode off and on (its cost)
#   binv_spec     bench_e2e plain / MTP K=3 / oracle K=3 in the mode (speculative vs plain greedy)
#   fp8           bench_e2e plain and overlap-scheduler decode with bf16 and FP8 weights, with --quality and the
#                 costliest kernels of a step
#   fp8_pdl       bench_e2e FP8 decode with programmatic dependent launch off and on (TRTLLM_GLM_PDL=0,1)
#   fp8_pdl_late  issue 44: bench_e2e FP8 decode, the PDL chain's trigger at the start / after the main loop
#                 (TRTLLM_GLM_PDL=1, TRTLLM_GLM_PDL_TRIGGER=start,end), then PDL off / on with the late trigger
#                 (GPU tests: GPU_TESTS="tests/unittest/quant/test_pdl.py tests/unittest/quant/test_fp8_gpu.py")
#   fp8_head      bench_e2e decode with lm_head in FP8 too (--fp8-skip none), batch 1 / 16, bf16 and FP8 weights, and
#                 --quality's FP8-head row beside the bf16 floor (issue 44: the head's default, fp8_lm_head)
#   fp8_sweep     bench_fp8_linear --sweep --quick (then --apply here)
#   decode_fuse   issue 44: bench_e2e FP8 decode, batch 1 / 16, plain and overlap, with the decode fusions off and on
#                 (TRTLLM_GLM_DECODE_FUSE=0,1: the fused mHC sites, the LM head's cast in the greedy kernel and the fused
#                 KDA decode step; their GPU tests: GPU_TESTS="tests/unittest/mhc/test_decode_fusions_gpu.py
#                 tests/unittest/kda/test_kda_fused_decode_gpu.py")
#   kda_fuse      issue 44: the fused KDA decode step alone off / on (TRTLLM_GLM_KDA_FUSED_DECODE=0,1), FP8 decode at
#                 batch 1 / 16 / 64, plain and overlap
#   latent_fp8    issue 44: the FP8 latent cache (latent_dtype fp8): its quality on the 4-layer slice beside the bf16
#                 floor (4K prompt), then decode at batch 1 / 16 with the bf16 and the FP8 latent (4K prompts)
#   prefix        bench_prefix_workloads on the 4-layer slice
#   serve         bench_serve at default settings on the 4-layer bf16 slice: 30-token prompts at concurrency 16 and 64,
#                 1K-token prompts at 16, the engine alone at the same batch (server / engine ratio), and LLM.generate of
#                 16 x 512-token prompts at the defaults against max_num_tokens 4096 / 16384 (issue 42's 90 % goal)
#   serve_wait    issue 42: the serve stage's 30-token runs (concurrency 16, 64) with admissions held while the batch
#                 decodes (batch_wait_timeout_iters: WAIT_ITERS, default 8; batch_wait_max_tokens_ratio: 0.25)
#   serve_proc    issue 42: the same server with the engine on a thread (engine_process: false) and in its own process
#                 (the default), back to back: 30-token prompts at concurrency 16 and 64, the engine alone at the same
#                 batch (the in-process run's baseline)
#   mixed         bench_mixed_step on the 4-layer bf16 slice at default settings: D requests decoding admit N prompts of
#                 L tokens (MIXED_DECODE, MIXED_NEW, MIXED_LEN; MIXED_PROFILE=N adds host / kernel / idle profiles)
#   mixed_short   issue 42: the same admission steps (15 decoding admit 1 / 16 prompts of 30 tokens) with KDA's short
#                 prefill off and on (TRTLLM_GLM_KDA_SHORT_PREFILL=0, then =64: chunks up to 64 rows through the
#                 verify kernels), back to back
#   mixed_ride    issue 42: the mixed-step stage's admissions with KDA decode rows riding the short prefills' verify
#                 grid off and on (TRTLLM_GLM_KDA_DECODE_RIDE=0, then 512), back to back
#   mixed_pw      issue 42: the same admissions eager and as piecewise graphs with the KDA cores inside the segments
#                 (TRTLLM_GLM_PIECEWISE=0, then 1), back to back; then the server with TRTLLM_GLM_PIECEWISE=1 at concurrency 16
#                 and 64 (GPU test: GPU_TESTS=tests/unittest/runtime/test_piecewise_gpu.py)
#   serve_chain   issue 42: the serve stage's 30-token runs (concurrency 16, 64) with admission steps chained
#                 (the default) and not (TRTLLM_GLM_CHAIN_ADMISSIONS=0), back to back; then 1K-token prompts at
#                 concurrency 16 (no kernel may compile while serving)
#   serve_chunk   issue 42: the serve stage's 30-token runs (concurrency 16, 64; CHUNK_REQS requests, default 256) at
#                 defaults (with the engine alone) and with each option of CHUNKS (KEY=VALUE, default
#                 mixed_prefill_budget=16 and =8): admissions spread over steps, what that does to ITL p99 / p50 and
#                 TTFT; each level prints the server's own ITL (ENGINE_BASELINE=0: no engine-alone run)
#   mixed_verify  issues 42 / 43: what an admission costs a batch that verifies MTP drafts (K = 3, adaptive off, 4-layer
#                 slice, 15 decoding + 1 / 16 prompts of 30 tokens): the step with verify rows piecewise (default since
#                 2026-12-08) against wholly eager (TRTLLM_GLM_PIECEWISE=0, how it ran before)
#   structured    issue 45: bench_structured at batch 16 (free, json, ngram, ngram-json): what a grammar costs a step
#   serve_old     the same server with the settings before issue 42 (max_batch_size 8, max_num_tokens 512,
#                 graph padding off, no warm-up) at concurrency 16
#   spec_real     issue 43, 4-layer slice, batch 1 / 16: plain, overlap, MTP K=3 fixed and adaptive, MTP rounds at oracle
#                 acceptance 0.7 (the MTP layer's full cost; also with a 32,768-token draft head, and adaptive), the
#                 oracle without the MTP layer
#   spec_real64   the same at batch 64 (fewer modes)
#   spec_small    issue 43, trained small, bf16 then fp32, batch 1 / 16 / 64: plain, overlap, MTP K=3 fixed and
#                 adaptive, each with and without the 32-token draft vocabulary
#                 (256 tokens per request in the spec stages: the adaptive policy's first ~6 rounds measure)
#   spec_overlap  issue 43 item 1, MTP drafting rounds under the overlap scheduler (+ov; the rows' overlap and
#                 rounds_ahead columns): trained small, bf16 then fp32, batch 1 / 16 / 64, plain, overlap, mtp3,
#                 mtp3+ov, mtp3+adaptive, mtp3+adaptive+ov; then the 4-layer slice, batch 1 / 16 (random weights:
#                 nothing accepted, the round's cost): plain, overlap, mtp3, mtp3+ov
#   spec_lag      issue 43, adaptive MTP with the catch-up lag under the overlap scheduler alone (+os, the LLM default):
#                 trained small bf16, batch 1 / 16 / 64, overlap, mtp3+os, mtp3+adaptive+os (512 tokens: the policy's
#                 re-measurements amortised); then the 4-layer slice, batch 1 / 16, overlap and MTP-oracle 0.7 K = 3
#   spec_default  issue 43, trained small bf16, batch 1 / 16 / 64, one process: overlap, mtp3 (overlap scheduler off),
#                 mtp3+os (on: the LLM default), mtp3+ed / mtp3+ed+os (drafts launched before the read-back:
#                 early_draft), mtp3+adaptive+os; rows carry timed_compiles (kernels compiled inside the timed steps) and
#                 lag_flushes: whether the adaptive policy now holds plain speed where K = 3 loses
#   spec_real_ed  issue 43, 4-layer slice, batch 1 / 16 (random weights: mtp3 accepts nothing, the round's cost): overlap,
#                 mtp3+noed, mtp3 (early drafts), mtporacle0.7k3 and +dv32768 (the MTP layer's cost at oracle acceptance)
#   spec_ed       issue 43 with early drafts on by default: trained small bf16, batch 1 / 16 / 64, overlap, mtp3+noed+os,
#                 mtp3+os, mtp3+adaptive+os (early drafts while the policy chooses K), mtp3+mc8+os
#   spec_adapt    issue 43, trained small bf16, batch 1 / 16 / 64: overlap, mtp3+os, mtp3+adaptive+os, mtp3+mc8+os (rows
#                 carry the policy's final acceptance, costs and first choices: adaptive_state)
#   spec_flush    issue 43, as spec_adapt at batch 16 / 64 (overlap, mtp3+adaptive+os, mtp3+mc8+os) with the held rows
#                 caught up by one eager forward (TRTLLM_GLM_MTP_FLUSH=eager) instead of catch-up graph slices
#   round_host    issue 43: bench_round_host on the GPU (trained small bf16, batch 16 / 64): a plain overlapped step, a
#                 width-one round of the speculative executor (mtp3+k0) and an MTP K=3 round: host ms and reads / puts
#                 per round, then sync_sites for plain, mtp3+k0 and mtp3 with graphs at the last batch (ROUND_BATCHES,
#                 default "16 64")
#   spec_order    issue 43, trained small bf16, batch 1: overlap, then MTP K=3 modes in an order that repeats one
#                 (mtp3+mc8+os, mtp3+os, mtp3+adaptive+os, mtp3+os): whether the first speculative mode of a process
#                 runs slower rounds than the same mode later (the 2026-12-07 H100 rows: mtp3+os 1.59 ms, then mc8 1.14)
#   spec_prof64   issue 43, trained small bf16, batch 64: overlap and mtp3+os with the costliest kernels and GPU-idle sites
#                 (where a verify round's time goes against a plain step)
#   spec_fp8h     issue 43 item 3, 4-layer slice, batch 1: MTP K=3 rounds at oracle acceptance 0.7 with the draft head in
#                 bf16 and as an FP8 copy (+fp8h), over the full vocabulary and 32,768 tokens, against an overlapped step
#   spec_w1       issue 43, trained small bf16, batch 64: overlap, mtp3+mc8+os (above max_concurrency: rounds
#                 without drafts) with host-by-function and GPU-idle profiles over 70 steps: where a width-one round's
#                 time goes against a plain step
#   prefill_tests issue 32: the prefill GPU tests (indexer + sparse MLA at a 1M context, a 128K prompt across chunk
#                 sizes, the fused MoE at prefill and decode sizes)
#   prefill_all   issue 32: bench_prefill at 8K / 32K / 128K / 1M in one run, 16 tokens decoded after each, the
#                 costliest kernels, and up to 32K the TTFT with the MoE's per-expert loop (--env-ab: ttft_ms_ab)
#   binv_tests    issue 31: the batch-invariant mode's GPU tests (row invariance at real shapes; speculative == plain
#                 and alone == in batch, bit for bit, on the 4-layer slice)
#   binv_linear   issue 31: bench_invariant_linear --quick --fp8 (the invariant GEMM's cost per weight)
#   binv_modes    issue 31: bench_e2e plain / MTP K=3 / n-gram K=7 with the mode off and on, then its [goal] lines
#   binv_attn     issue 31: the attention part's GPU tests (bitwise row invariance, the verify kernel's accuracy) and
#                 bench_binv_attention --quick (default vs mode per changed launch); with BASE=<commit> also the new
#                 tests on the code before the mode's fixes (KDA and sparse-MLA tests must fail, indexer pass)
#   cache         the Triton cache to $OUT in 15 MB parts (carry them as .tcache/ next time)
# Each stage has its own time limit and a failing stage does not stop the next; logs and JSON go to ${OUT:-/tmp/out}.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=/tmp/triton_cache
O=${OUT:-/tmp/out}
mkdir -p "$O" "$TRITON_CACHE_DIR"
PY=${PYTHON:-python3}
for stage in "$@"; do
  echo "=== $stage $(date -u +%T)"
  case $stage in
    setup)
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
      export PYTHONPATH="/tmp/site:$PYTHONPATH"
      if ls .tcache/tcache_* >/dev/null 2>&1; then cat .tcache/tcache_* | tar xzf - -C "$TRITON_CACHE_DIR"; fi
      nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader ;;
    tests)
      timeout "${T_TESTS:-200}" "$PY" -m pytest -q -p no:xdist -m gpu -rf ${GPU_TESTS:?} 2>&1 | tee "$O/gpu_tests.log" ;;
    prefill)
      timeout "${T_PREFILL:-200}" "$PY" -m benchmarks.bench_prefill --layers 4 --lens 8192 32768 131072 \
        --chunks 8192 --decode 16 --profile-kernels 20 --json "$O/prefill.json" 2>&1 | tee "$O/prefill.log" ;;
    prefill_binv)
      timeout "${T_PREFILL_BINV:-120}" "$PY" -m benchmarks.bench_prefill --layers 4 --lens 8192 32768 --chunks 8192 \
        --decode 0 --batch-invariant on --json "$O/prefill_binv.json" 2>&1 | tee "$O/prefill_binv.log" ;;
    prefill_1m)
      timeout "${T_PREFILL_1M:-150}" "$PY" -m benchmarks.bench_prefill --layers 4 --lens 1048000 --chunks 8192 \
        --decode 16 --json "$O/prefill_1m.json" 2>&1 | tee "$O/prefill_1m.log" ;;
    sweep)
      timeout "${T_SWEEP:-240}" "$PY" -m benchmarks.bench_invariant_linear --sweep --json "$O/sweep.json" 2>&1 \
        | tee "$O/sweep.log" ;;
    binv)
      timeout "${T_BINV:-200}" "$PY" -m benchmarks.bench_e2e --layers 4 --batch 1 16 --modes plain --cuda-graphs on \
        --prompt-len 256 --gen 32 --batch-invariant both --json "$O/binv.json" 2>&1 | tee "$O/binv.log" ;;
    binv_spec)
      timeout "${T_BINV_SPEC:-200}" "$PY" -m benchmarks.bench_e2e --layers 4 --batch 1 16 --modes plain mtp3 oracle0.7k3 \
        --cuda-graphs on --prompt-len 256 --gen 32 --batch-invariant on --json "$O/binv_spec.json" 2>&1 \
        | tee "$O/binv_spec.log" ;;
    fp8)
      timeout "${T_FP8:-240}" "$PY" -m benchmarks.bench_e2e --layers 4 --batch 1 16 --modes plain overlap \
        --cuda-graphs on --prompt-len 256 --gen 32 --weights bf16 fp8 --quality --profile-kernels 40 \
        --json "$O/fp8.json" 2>&1 | tee "$O/fp8.log" ;;
    fp8_pdl)
      timeout "${T_FP8_PDL:-200}" "$PY" -m benchmarks.bench_e2e --layers 4 --batch 1 16 --modes plain overlap \
        --cuda-graphs on --prompt-len 256 --gen 32 --weights fp8 --env-ab TRTLLM_GLM_PDL=0,1 \
        --json "$O/fp8_pdl.json" 2>&1 | tee "$O/fp8_pdl.log" ;;
    fp8_pdl_late)
      TRTLLM_GLM_PDL=1 timeout "${T_FP8_PDL_LATE:-200}" "$PY" -m benchmarks.bench_e2e --layers 4 --batch 1 16 \
        --modes plain overlap --cuda-graphs on --prompt-len 256 --gen 32 --weights fp8 \
        --env-ab TRTLLM_GLM_PDL_TRIGGER=start,end --json "$O/fp8_pdl_trigger.json" 2>&1 | tee "$O/fp8_pdl_trigger.log"
      TRTLLM_GLM_PDL_TRIGGER=end timeout "${T_FP8_PDL_LATE:-200}" "$PY" -m benchmarks.bench_e2e --layers 4 --batch 1 16 \
        --modes plain overlap --cuda-graphs on --prompt-len 256 --gen 32 --weights fp8 \
        --env-ab TRTLLM_GLM_PDL=0,1 --json "$O/fp8_pdl_late.json" 2>&1 | tee "$O/fp8_pdl_late.log" ;;
    fp8_head)
      timeout "${T_FP8_HEAD:-180}" "$PY" -m benchmarks.bench_e2e --layers 4 --batch 1 16 --modes plain overlap \
        --cuda-graphs on --prompt-len 256 --gen 32 --weights bf16 fp8 --fp8-skip none --quality \
        --json "$O/fp8_head.json" 2>&1 | tee "$O/fp8_head.log" ;;
    decode_fuse)
      timeout "${T_DECODE_FUSE:-220}" "$PY" -m benchmarks.bench_e2e --layers 4 --batch 1 16 --modes plain overlap \
        --cuda-graphs on --prompt-len 256 --gen 32 --weights fp8 --env-ab TRTLLM_GLM_DECODE_FUSE=0,1 \
        --json "$O/decode_fuse.json" 2>&1 | tee "$O/decode_fuse.log" ;;
    kda_fuse)
      timeout "${T_KDA_FUSE:-240}" "$PY" -m benchmarks.bench_e2e --layers 4 --batch 1 16 64 --modes plain overlap \
        --cuda-graphs on --prompt-len 256 --gen 32 --weights fp8 --env-ab TRTLLM_GLM_KDA_FUSED_DECODE=0,1 \
        --json "$O/kda_fuse.json" 2>&1 | tee "$O/kda_fuse.log" ;;
    latent_fp8)
      timeout "${T_LATENT_FP8:-150}" "$PY" -m benchmarks.bench_e2e --layers 4 --batch 1 --modes plain --weights bf16 \
        --latent-dtype fp8 --quality --prompt-len 4096 --gen 8 --json "$O/latent_fp8_quality.json" 2>&1 \
        | tee "$O/latent_fp8_quality.log"
      for ld in auto fp8; do
        timeout "${T_LATENT_FP8:-150}" "$PY" -m benchmarks.bench_e2e --layers 4 --batch 1 16 --modes plain overlap \
          --cuda-graphs on --prompt-len 4096 --gen 32 --latent-dtype $ld --json "$O/latent_$ld.json" 2>&1 \
          | tee "$O/latent_$ld.log"
      done ;;
    fp8_sweep)
      timeout "${T_FP8_SWEEP:-420}" "$PY" -m benchmarks.bench_fp8_linear --sweep --quick --json "$O/fp8_sweep.json" \
        2>&1 | tee "$O/fp8_sweep.log" ;;
    prefix)
      timeout "${T_PREFIX:-200}" "$PY" -m benchmarks.bench_prefix_workloads --preset glm-5.3-flash --layers 4 \
        --json "$O/prefix.json" 2>&1 | tee "$O/prefix.log" ;;
    serve)
      timeout "${T_SERVE:-420}" "$PY" -m benchmarks.bench_serve --model glm-5.3-flash --layers 4 --dtype bfloat16 \
        --concurrency 16,64 --input-len 30 --output-len 128 --num-requests 128 --engine-baseline \
        --generate-check 16x512x64 --json "$O/serve.json" 2>&1 | tee "$O/serve.log"
      timeout "${T_SERVE_1K:-240}" "$PY" -m benchmarks.bench_serve --model glm-5.3-flash --layers 4 --dtype bfloat16 \
        --concurrency 1,16 --input-len 1024 --output-len 128 --num-requests 48 \
        --json "$O/serve_1k.json" 2>&1 | tee "$O/serve_1k.log" ;;
    serve_wait)
      printf 'batch_wait_timeout_iters: %s\nbatch_wait_max_tokens_ratio: 0.25\n' "${WAIT_ITERS:-8}" > /tmp/serve_wait.yaml
      timeout "${T_SERVE_WAIT:-240}" "$PY" -m benchmarks.bench_serve --model glm-5.3-flash --layers 4 --dtype bfloat16 \
        --config /tmp/serve_wait.yaml --concurrency 16,64 --input-len 30 --output-len 128 --num-requests 128 \
        --json "$O/serve_wait.json" 2>&1 | tee "$O/serve_wait.log" ;;
    serve_proc)
      for ep in false true; do
        printf 'engine_process: %s\n' "$ep" > "/tmp/serve_ep_$ep.yaml"
        timeout "${T_SERVE_PROC:-420}" "$PY" -m benchmarks.bench_serve --model glm-5.3-flash --layers 4 \
          --dtype bfloat16 --config "/tmp/serve_ep_$ep.yaml" --concurrency 16,64 --input-len 30 --output-len 128 \
          --num-requests 128 $([ "$ep" = false ] && echo --engine-baseline) --json "$O/serve_ep_$ep.json" 2>&1 \
          | tee "$O/serve_ep_$ep.log"
      done ;;
    mixed)
      timeout "${T_MIXED:-300}" "$PY" -m benchmarks.bench_mixed_step --layers 4 --decode ${MIXED_DECODE:-15 63} \
        --new ${MIXED_NEW:-1 16} --prompt-len ${MIXED_LEN:-30 1024} --profile ${MIXED_PROFILE:-0} \
        --json "$O/mixed.json" 2>&1 | tee "$O/mixed.log" ;;
    mixed_short)
      for sp in 0 64; do
        TRTLLM_GLM_KDA_SHORT_PREFILL=$sp timeout "${T_MIXED_SHORT:-90}" "$PY" -m benchmarks.bench_mixed_step --layers 4 \
          --decode 15 --new 1 16 --prompt-len 30 --json "$O/mixed_short_$sp.json" 2>&1 | tee "$O/mixed_short_$sp.log"
      done ;;
    mixed_ride)
      for ride in 0 512; do
        TRTLLM_GLM_KDA_DECODE_RIDE=$ride timeout "${T_MIXED_RIDE:-150}" "$PY" -m benchmarks.bench_mixed_step --layers 4 \
          --decode 15 63 --new 1 16 --prompt-len 30 --json "$O/mixed_ride_$ride.json" 2>&1 | tee "$O/mixed_ride_$ride.log"
      done ;;
    mixed_pw)
      for pw in 0 1; do
        TRTLLM_GLM_PIECEWISE=$pw timeout "${T_MIXED_PW:-150}" "$PY" -m benchmarks.bench_mixed_step --layers 4 \
          --decode 15 63 --new 1 16 --prompt-len 30 --json "$O/mixed_pw_$pw.json" 2>&1 | tee "$O/mixed_pw_$pw.log"
      done
      TRTLLM_GLM_PIECEWISE=1 timeout "${T_SERVE_PW:-200}" "$PY" -m benchmarks.bench_serve --model glm-5.3-flash \
        --layers 4 --dtype bfloat16 --concurrency 16,64 --input-len 30 --output-len 128 --num-requests 128 \
        --json "$O/serve_pw.json" 2>&1 | tee "$O/serve_pw.log" ;;
    serve_chain)
      for ch in 1 0; do
        TRTLLM_GLM_CHAIN_ADMISSIONS=$ch timeout "${T_SERVE_CHAIN:-240}" "$PY" -m benchmarks.bench_serve \
          --model glm-5.3-flash --layers 4 --dtype bfloat16 --concurrency 16,64 --input-len 30 --output-len 128 \
          --num-requests 128 $([ "$ch" = 1 ] && echo --engine-baseline) --json "$O/serve_chain_$ch.json" 2>&1 \
          | tee "$O/serve_chain_$ch.log"
      done
      timeout "${T_SERVE_1K:-200}" "$PY" -m benchmarks.bench_serve --model glm-5.3-flash --layers 4 --dtype bfloat16 \
        --concurrency 16 --input-len 1024 --output-len 128 --num-requests 48 --json "$O/serve_1k.json" 2>&1 \
        | tee "$O/serve_1k.log" ;;
    serve_chunk)
      for kv in ${CHUNKS:-none mixed_prefill_budget=16 mixed_prefill_budget=8}; do
        cfg="" name=${kv//=/_}
        if [ "$kv" != none ]; then
          printf '%s: %s\n' "${kv%%=*}" "${kv#*=}" > "/tmp/serve_$name.yaml"; cfg="--config /tmp/serve_$name.yaml"; fi
        timeout "${T_SERVE_CHUNK:-320}" "$PY" -m benchmarks.bench_serve --model glm-5.3-flash --layers 4 \
          --dtype bfloat16 $cfg --concurrency 16,64 --input-len 30 --output-len 128 \
          --num-requests "${CHUNK_REQS:-256}" $([ "$kv" = none ] && [ "${ENGINE_BASELINE:-1}" = 1 ] && echo --engine-baseline) \
          --json "$O/serve_$name.json" 2>&1 | tee "$O/serve_$name.log"
      done ;;
    mixed_verify)
      for pw in 0 1; do
        TRTLLM_GLM_PIECEWISE=$pw timeout "${T_MIXED_VERIFY:-240}" "$PY" -m benchmarks.bench_mixed_step --layers 4 \
          --decode 15 --new 1 16 --prompt-len 30 --reps 5 --json "$O/mixed_verify_pw$pw.json" \
          --llm-args '{"speculative_config": {"decoding_type": "MTP", "max_draft_len": 3, "adaptive": false}}' 2>&1 \
          | tee "$O/mixed_verify_pw$pw.log"
      done ;;
    structured)
      timeout "${T_STRUCTURED:-150}" "$PY" -m benchmarks.bench_structured --layers 4 --batch 16 --gen 64 \
        --modes free json ngram ngram-json --json "$O/structured.json" 2>&1 | tee "$O/structured.log" ;;
    serve_old)
      printf 'max_batch_size: 8\nmax_num_tokens: 512\nwarmup: false\ncuda_graph_config:\n  enable_padding: false\n' \
        > /tmp/serve_old.yaml
      timeout "${T_SERVE_OLD:-300}" "$PY" -m benchmarks.bench_serve --model glm-5.3-flash --layers 4 --dtype bfloat16 \
        --config /tmp/serve_old.yaml --concurrency 16 --input-len 30 --output-len 128 --num-requests 64 \
        --json "$O/serve_old.json" 2>&1 | tee "$O/serve_old.log" ;;
    spec_real)
      timeout "${T_SPEC_REAL:-540}" "$PY" -m benchmarks.bench_e2e --layers 4 --batch 1 16 --modes plain overlap mtp3 \
        mtp3+adaptive mtporacle0.7k3 mtporacle0.7k3+dv32768 mtporacle0.7k3+adaptive oracle0.7k3 --cuda-graphs on \
        --prompt-len 256 --gen 256 --json "$O/spec_real.json" 2>&1 | tee "$O/spec_real.log" ;;
    spec_real64)
      timeout "${T_SPEC_REAL64:-540}" "$PY" -m benchmarks.bench_e2e --layers 4 --batch 64 --modes plain overlap \
        mtp3+adaptive mtporacle0.7k3 mtporacle0.7k3+adaptive --cuda-graphs on --prompt-len 256 --gen 256 \
        --json "$O/spec_real64.json" 2>&1 | tee "$O/spec_real64.log" ;;
    spec_small)
      for dt in bfloat16 float32; do
        timeout "${T_SPEC_SMALL:-270}" "$PY" -m benchmarks.bench_e2e --trained --preset small --dtype $dt \
          --batch 1 16 64 --gen 256 --modes plain overlap mtp3 mtp3+dv32 mtp3+adaptive mtp3+adaptive+dv32 --cuda-graphs on \
          --json "$O/spec_small_$dt.json" 2>&1 | tee "$O/spec_small_$dt.log"
      done ;;
    spec_overlap)
      for dt in bfloat16 float32; do
        timeout "${T_SPEC_OVERLAP:-300}" "$PY" -m benchmarks.bench_e2e --trained --preset small --dtype $dt \
          --batch 1 16 64 --gen 256 --modes plain overlap mtp3 mtp3+ov mtp3+adaptive mtp3+adaptive+ov \
          --cuda-graphs on --json "$O/spec_overlap_small_$dt.json" 2>&1 | tee "$O/spec_overlap_small_$dt.log"
      done
      timeout "${T_SPEC_OVERLAP_REAL:-420}" "$PY" -m benchmarks.bench_e2e --layers 4 --batch 1 16 --modes plain overlap \
        mtp3 mtp3+ov --cuda-graphs on --prompt-len 256 --gen 256 --json "$O/spec_overlap_real.json" 2>&1 \
        | tee "$O/spec_overlap_real.log" ;;
    spec_lag)
      timeout "${T_SPEC_LAG:-240}" "$PY" -m benchmarks.bench_e2e --trained --preset small --dtype bfloat16 \
        --batch 1 16 64 --gen 512 --modes overlap mtp3+os mtp3+adaptive+os --cuda-graphs on \
        --json "$O/spec_lag_small.json" 2>&1 | tee "$O/spec_lag_small.log"
      timeout "${T_SPEC_LAG_REAL:-300}" "$PY" -m benchmarks.bench_e2e --layers 4 --batch 1 16 --prompt-len 256 \
        --gen 256 --modes overlap mtporacle0.7k3+os mtporacle0.7k3+adaptive+os --cuda-graphs on \
        --json "$O/spec_lag_real.json" 2>&1 | tee "$O/spec_lag_real.log" ;;
    spec_default)
      timeout "${T_SPEC_DEFAULT:-300}" "$PY" -m benchmarks.bench_e2e --trained --preset small --dtype bfloat16 \
        --batch 1 16 64 --gen 384 --modes overlap mtp3 mtp3+os mtp3+ed mtp3+ed+os mtp3+adaptive+os --cuda-graphs on \
        --json "$O/spec_default.json" 2>&1 | tee "$O/spec_default.log" ;;
    spec_real_ed)
      timeout "${T_SPEC_REAL_ED:-300}" "$PY" -m benchmarks.bench_e2e --layers 4 --batch 1 16 --prompt-len 256 --gen 128 \
        --modes overlap mtp3+noed mtp3 mtporacle0.7k3 mtporacle0.7k3+dv32768 --cuda-graphs on \
        --json "$O/spec_real_ed.json" 2>&1 | tee "$O/spec_real_ed.log" ;;
    spec_ed)
      timeout "${T_SPEC_ED:-300}" "$PY" -m benchmarks.bench_e2e --trained --preset small --dtype bfloat16 \
        --batch 1 16 64 --gen 384 --modes overlap mtp3+noed+os mtp3+os mtp3+adaptive+os mtp3+mc8+os --cuda-graphs on \
        --json "$O/spec_ed.json" 2>&1 | tee "$O/spec_ed.log" ;;
    spec_adapt)
      timeout "${T_SPEC_ADAPT:-300}" "$PY" -m benchmarks.bench_e2e --trained --preset small --dtype bfloat16 \
        --batch 1 16 64 --gen 384 --modes overlap mtp3+os mtp3+adaptive+os mtp3+mc8+os --cuda-graphs on \
        --json "$O/spec_adapt.json" 2>&1 | tee "$O/spec_adapt.log" ;;
    spec_flush)
      TRTLLM_GLM_MTP_FLUSH=eager timeout "${T_SPEC_FLUSH:-200}" "$PY" -m benchmarks.bench_e2e --trained --preset small \
        --dtype bfloat16 --batch 16 64 --gen 384 --modes overlap mtp3+adaptive+os mtp3+mc8+os --cuda-graphs on \
        --json "$O/spec_flush.json" 2>&1 | tee "$O/spec_flush.log" ;;
    round_host)
      rb=${ROUND_BATCHES:-16 64}
      for b in $rb; do
        timeout "${T_ROUND_HOST:-120}" "$PY" -m benchmarks.bench_round_host --preset small --modes overlap mtp3+k0 mtp3 \
          --batch $b --rounds 48 --warmup 16 2>&1 | tee "$O/round_host_b$b.log"
      done
      timeout "${T_ROUND_HOST:-120}" "$PY" -m benchmarks.sync_sites --preset small --dtype bfloat16 --cuda-graphs \
        --batch ${rb##* } --modes plain mtp3+k0 mtp3 2>&1 | tee "$O/sync_sites_round.log" ;;
    spec_order)
      timeout "${T_SPEC_ORDER:-150}" "$PY" -m benchmarks.bench_e2e --trained --preset small --dtype bfloat16 --batch 1 \
        --gen 384 --modes overlap mtp3+mc8+os mtp3+os mtp3+adaptive+os mtp3+os --cuda-graphs on \
        --json "$O/spec_order.json" 2>&1 | tee "$O/spec_order.log" ;;
    spec_prof64)
      timeout "${T_SPEC_PROF64:-150}" "$PY" -m benchmarks.bench_e2e --trained --preset small --dtype bfloat16 --batch 64 \
        --gen 128 --modes overlap mtp3+os --cuda-graphs on --profile-kernels 30 --profile-idle 20 --profile-steps 12 \
        --json "$O/spec_prof64.json" 2>&1 | tee "$O/spec_prof64.log" ;;
    spec_fp8h)
      timeout "${T_SPEC_FP8H:-240}" "$PY" -m benchmarks.bench_e2e --layers 4 --batch 1 --prompt-len 256 --gen 128 \
        --modes overlap mtporacle0.7k3 mtporacle0.7k3+fp8h mtporacle0.7k3+dv32768 mtporacle0.7k3+dv32768+fp8h \
        --cuda-graphs on --json "$O/spec_fp8h.json" 2>&1 | tee "$O/spec_fp8h.log" ;;
    spec_w1)
      timeout "${T_SPEC_W1:-300}" "$PY" -m benchmarks.bench_e2e --trained --preset small --dtype bfloat16 --batch 64 \
        --gen 256 --modes overlap mtp3+mc8+os --cuda-graphs on --profile-host 30 --profile-idle 25 \
        --profile-steps 70 --json "$O/spec_w1.json" 2>&1 | tee "$O/spec_w1.log" ;;
    prefill_tests)
      timeout "${T_PREFILL_TESTS:-200}" "$PY" -m pytest -q -s -p no:xdist tests/unittest/runtime/test_prefill_gpu.py \
        tests/unittest/moe/test_fused_moe_gpu.py 2>&1 | tee "$O/prefill_gpu_tests.log" ;;
    prefill_all)
      timeout "${T_PREFILL_ALL:-300}" "$PY" -m benchmarks.bench_prefill --layers 4 --lens 8192 32768 131072 1048000 \
        --chunks 8192 --decode 16 --profile-kernels 20 --env-ab TRTLLM_GLM_MOE_BACKEND=torch \
        --json "$O/prefill_all.json" 2>&1 | tee "$O/prefill_all.log" ;;
    binv_tests)
      timeout "${T_BINV_TESTS:-300}" "$PY" -m pytest -q -p no:xdist -m gpu -rf \
        tests/unittest/numerics/test_batch_invariant_gpu.py \
        2>&1 | tee "$O/batch_invariant_gpu_tests.log" ;;
    binv_linear)
      timeout "${T_BINV_LINEAR:-240}" "$PY" -m benchmarks.bench_invariant_linear --quick --fp8 \
        --json "$O/invariant_linear.json" 2>&1 | tee "$O/invariant_linear.log" ;;
    binv_modes)
      timeout "${T_BINV_MODES:-300}" "$PY" -m benchmarks.bench_e2e --layers 4 --batch 1 16 --modes plain mtp3 ngram7 \
        --cuda-graphs on --prompt-len 256 --gen 32 --batch-invariant both --json "$O/e2e_batch_invariant.json" 2>&1 \
        | tee "$O/e2e_batch_invariant.log"
      grep '\[goal\]' "$O/e2e_batch_invariant.log" | grep batch-invariant ;;
    binv_attn)
      timeout "${T_BINV_ATTN:-240}" "$PY" -m pytest -q -p no:xdist -m gpu tests/unittest/attention/test_binv_attention_gpu.py \
        tests/unittest/kda/test_kda_verify_kernel_gpu.py 2>&1 | tee "$O/binv_attention_gpu_tests.log"
      timeout "${T_BINV_ATTN:-240}" "$PY" -m benchmarks.bench_binv_attention --quick \
        --json "$O/bench_binv_attention.json" 2>&1 | tee "$O/bench_binv_attention.log"
      if [ -n "${BASE:-}" ]; then
        tmp=$(mktemp -d)
        git worktree add -q --detach "$tmp" "$BASE"
        mkdir -p "$tmp/tests/unittest/attention"
        cp tests/unittest/attention/test_binv_attention_gpu.py "$tmp/tests/unittest/attention/"
        echo "== the new tests on $BASE (the fixes removed): failures expected =="
        (cd "$tmp" && PYTHONPATH=$tmp timeout "${T_BINV_ATTN:-240}" "$PY" -m pytest -q -p no:xdist -m gpu -rf \
          tests/unittest/attention/test_binv_attention_gpu.py) 2>&1 | tee "$O/binv_attention_base_tests.log"
        git worktree remove --force "$tmp"
      fi ;;
    cache)
      tar czf - -C "$TRITON_CACHE_DIR" . | split -b 15M - "$O/tcache_" && ls -la "$O" ;;
    *) echo "h200_run: unknown stage $stage" ;;
  esac
done
