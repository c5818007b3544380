#!/usr/bin/env bash
# Third-party rings on CPU ranks: installs the pinned ring-flash-attn, yunchang, DeepSpeed and transformers
# (--no-deps: the first two's flash-attn dependency cannot build here, and the ranks use ring-harness's
# flash-attn CPU stand-in, as DeepSpeed's FPDT does; its Ulysses and ALST run torch's SDPA) and runs a short
# `ring-harness check` of each of their 11 adapters, printing each exit status.
#
# Exit 1 of a check (failing cases: the libraries' known bugs, see README "Third-party rings") does not
# fail CI. Anything else does: exit 2 (bad usage or input), a crash (any other status, a signal, or exit 1
# without the check's own last line, i.e. an uncaught exception), a hang (a case whose verdict is hang, or
# the check passing its time limit), or an adapter that is not runnable here. Failing cases are saved to a
# temporary directory, removed at the end. Run from the repository root.
set -uo pipefail

DS_BUILD_OPS=0 python -m pip install -q --no-deps -r ci/requirements-thirdparty.txt || { echo "thirdparty: pip install failed"; exit 1; }

IMPLS=(ring-flash-attn ring-flash-attn-zigzag ring-flash-attn-stripe ring-flash-attn-llama3
       yunchang-ring yunchang-ulysses yunchang-usp deepspeed-ulysses deepspeed-ulysses-seqfirst deepspeed-alst
       deepspeed-fpdt)
# adapters whose local attention is torch's SDPA (no flash-attn, so no stand-in to require)
declare -A SDPA=([deepspeed-ulysses]=1 [deepspeed-ulysses-seqfirst]=1 [deepspeed-alst]=1)
# exit 1 expected (a known library bug or a refusal no capability can express), for the log only
declare -A KNOWN=(
  [ring-flash-attn]="fp16 dq rounded through bf16 (precision check; upstream PR zhuzilin/ring-flash-attention#87)"
  [ring-flash-attn-llama3]="dk/dv partials reduce-scattered in the input dtype (llama3_flash_attn_varlen.py: dkv_buffer dtype=k.dtype): growth check, bf16 dv error x1.45 at W8"
  [ring-flash-attn-zigzag]="odd per-rank length (probe finding; cases/ring-flash-attn-zigzag-odd-local-length*.yaml)"
  [yunchang-ring]="odd per-rank length in zigzag (cases/yunchang-ring-zigzag-odd-local-length.yaml); fp16 dq through bf16"
  [yunchang-usp]="heads without a Ulysses degree, W = 5 or 7, are refused (no capability expresses it)"
  [deepspeed-alst]="masks but causal dropped by its HF wrapper: probe findings (cases/deepspeed-alst-packed-documents.yaml, -sliding-window.yaml)"
  [deepspeed-fpdt]="chunk merge overflows with large scores (fpdt_layer.py _update_out_and_lse; cases/deepspeed-fpdt-merge-overflow*.yaml)"
)
# extra check options: FPDT projects q/k/v itself, so the adapter's identity projection costs S * hidden^2
# multiply-adds in bf16/fp16 on the CPU: its scale stage alone takes ~130 s on 2 cores (run by hand, docs/third-party.md)
declare -A EXTRA=([deepspeed-fpdt]="--no-scale")
LIMIT_S="${THIRDPARTY_CHECK_TIMEOUT:-600}"
save="$(mktemp -d "${TMPDIR:-/tmp}/ring-harness-thirdparty.XXXXXX")"
trap 'rm -rf "$save"' EXIT

impls_out="$(python -m harness impls)" || { echo "thirdparty: ring-harness impls failed"; exit 1; }
bad=0
for impl in "${IMPLS[@]}"; do
  row="$(grep -E "^$impl +" <<<"$impls_out" || true)"
  if ! grep -q " ready " <<<"$row" || { [ -z "${SDPA[$impl]:-}" ] && ! grep -q "kernel: cpu-standin" <<<"$row"; }; then
    echo "thirdparty: $impl is not runnable here with the CPU stand-in: ${row:-not listed}"
    bad=1
    continue
  fi
  start=$(date +%s)
  timeout -k 10 "$LIMIT_S" python -m harness check --impl "$impl" --max-examples 20 --fault-stage none \
    --no-repeat ${EXTRA[$impl]:-} --save-dir "$save/$impl" >"$save/$impl.log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  last="$(tail -n 1 "$save/$impl.log")"
  echo "$last"
  if [ "$rc" -eq 1 ] && ! grep -q "^check FAILED (exit 1)" <<<"$last"; then
    rc=3  # exit 1 without the check's verdict line: an uncaught exception
  elif [ "$rc" -eq 1 ] && grep -qE "^ *[0-9]+/[0-9]+ .* hang |\(hang: " "$save/$impl.log"; then
    rc=4  # a case that hung: never a known bug
  fi
  case "$rc" in
    0) echo "thirdparty: $impl exit 0 (${secs} s)" ;;
    1) echo "thirdparty: $impl exit 1 (${secs} s): failing cases${KNOWN[$impl]:+; known: ${KNOWN[$impl]}}"
       grep -E "^ +(first failure|shrunk to)" "$save/$impl.log" | head -n 4 ;;
    4) echo "thirdparty: $impl exit 1 (${secs} s) with a HANG verdict:"
       grep -E " hang |\(hang: |first failure|shrunk to" "$save/$impl.log" | head -n 6
       echo "thirdparty: the first hang's report (the case before it, its rank stacks):"
       grep -n -B 3 -A 40 -m 1 -E "^ *[0-9]+/[0-9]+ .* hang " "$save/$impl.log" | head -n 60; bad=1 ;;
    124|137) echo "thirdparty: $impl TIMED OUT after ${LIMIT_S} s (a hang); last lines:"; tail -n 20 "$save/$impl.log"; bad=1 ;;
    *) echo "thirdparty: $impl exit $rc (${secs} s): usage error or crash; last lines:"; tail -n 30 "$save/$impl.log"; bad=1 ;;
  esac
done
[ "$bad" -eq 0 ] && echo "thirdparty: done (exit 1 of a check is a finding, not a CI failure)"
exit "$bad"
