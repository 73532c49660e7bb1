#!/usr/bin/env bash
# Mutation testing of gradsift's core modules, each against the fast tests that cover it.
# Not part of ./dev test: it takes minutes per module on 2 cores (see report.md).
#
#   scripts/mutation/run.sh [MODULE ...]     MODULE: stats base sidco feedback wire (default: all)
#
# Per module: a scratch copy of src/, tests/ and pyproject.toml in $MUTATION_WORKDIR/MODULE
# (default /tmp/gradsift-mutation), a setup.cfg that names the module and its tests, and
# `mutmut run` under `nice -n 19`. mutmut mutates the module's functions and methods (not
# module-level constants), records which tests cover each function, and runs only those,
# stopping at the first failure. A second run reuses the scratch copy: mutmut re-checks
# the mutants of functions that changed, and this script re-checks every mutant that was
# not killed (against the tests as they are now); MUTATION_FRESH=1 starts from scratch.
# Results land in scripts/mutation/results/:
#   MODULE.json            counts (killed, survived, timeout, ...) and the tests used
#   MODULE-survivors.txt   the diff of every mutant that was not killed
# scripts/mutation/report.md explains each survivor. Environment: MUTATION_JOBS (parallel
# mutants, default 1: the CPU is shared), MUTATION_WORKDIR.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
[ -x .venv/bin/python ] || ./dev setup
.venv/bin/python -m pip install --quiet -r scripts/mutation/requirements.txt
mutmut=$root/.venv/bin/mutmut

# Each module's file (the first that exists: wire.py moves into the exchange layer).
declare -A SOURCE=(
  [stats]=src/gradsift/compressors/stats.py
  [base]=src/gradsift/compressors/base.py
  [sidco]=src/gradsift/compressors/sidco.py
  [feedback]=src/gradsift/hook/feedback.py
  [wire]="src/gradsift/core/wire.py src/gradsift/wire.py"
)
# The fast tests that exercise each module (multi-process and slow tests are deselected:
# test_exchanges, test_hook_options and test_nonfinite run the hook on gloo, minutes per mutant).
declare -A TESTS=(
  [stats]="tests/compressors/test_stats.py tests/compressors/test_fit_references.py tests/compressors/test_sidco_fit.py"
  [base]="tests/core/test_core_api.py tests/compressors/test_compressor_options.py tests/compressors/test_sparsifiers.py tests/compressors/test_quantizers.py tests/core/test_wire.py tests/compressors/test_properties.py"
  [sidco]="tests/compressors/test_sidco.py tests/compressors/test_sidco_fit.py tests/compressors/test_sidco_options.py tests/compressors/test_sidco_loop.py"
  [feedback]="tests/core/test_core_api.py tests/compressors/test_quantizers.py tests/hook/test_feedback_reference.py tests/hook/test_recipe.py tests/core/test_state.py"
  [wire]="tests/core/test_wire.py tests/test_wire_reference.py tests/core/test_core_api.py"
)

modules=("$@")
[ ${#modules[@]} -gt 0 ] || modules=(stats base sidco feedback wire)
workdir=${MUTATION_WORKDIR:-/tmp/gradsift-mutation}
results=$root/scripts/mutation/results
mkdir -p "$results"
# One thread per test process (conftest keeps torch at <= 2), deterministic hypothesis.
export OMP_NUM_THREADS=1 CI=1

for module in "${modules[@]}"; do
  candidates=${SOURCE[$module]:?unknown module $module (stats base sidco feedback wire)}
  source_file=
  for f in $candidates; do if [ -e "$f" ]; then source_file=$f; break; fi; done
  [ -n "$source_file" ] || { echo "[mutation] $module: none of $candidates exists" >&2; exit 1; }
  tests=()
  for t in ${TESTS[$module]}; do
    if [ -e "$t" ]; then tests+=("$t"); else echo "[mutation] $module: $t does not exist, not used" >&2; fi
  done
  dir=$workdir/$module
  [ -z "${MUTATION_FRESH:-}" ] || rm -rf "$dir"
  again=; [ -d "$dir/mutants" ] && again=1
  mkdir -p "$dir"
  rm -rf "$dir/src" "$dir/tests"
  cp -r src tests pyproject.toml "$dir"
  find "$dir/src" "$dir/tests" -name __pycache__ -prune -exec rm -rf {} +
  {
    echo "[mutmut]"
    echo "source_paths = src"
    echo "only_mutate = $source_file"
    echo "pytest_add_cli_args_test_selection ="
    printf '    %s\n' "${tests[@]}"
    echo "pytest_add_cli_args ="
    printf '    %s\n' -q -p no:cacheprovider -m "not slow and not distributed"
    echo "process_isolation = forkserver"
    echo "timeout_multiplier = 10.0"
    echo "timeout_constant = 10.0"
  } > "$dir/setup.cfg"
  echo "[mutation] $module: $source_file against ${tests[*]}"
  started=$(date +%s)
  (cd "$dir" && nice -n 19 "$mutmut" run --max-children "${MUTATION_JOBS:-1}" > mutmut.log 2>&1) \
    || { echo "[mutation] $module: mutmut failed, see $dir/mutmut.log" >&2; tail -20 "$dir/mutmut.log" >&2; exit 1; }
  if [ -n "$again" ]; then  # earlier survivors meet the tests added since
    mapfile -t undetected < <(cd "$dir" && "$mutmut" results 2>/dev/null | sed -n 's/^ *\([^ :]*\): \(survived\|no tests\)$/\1/p')
    [ ${#undetected[@]} -eq 0 ] || (cd "$dir" && nice -n 19 "$mutmut" run --max-children "${MUTATION_JOBS:-1}" "${undetected[@]}" >> mutmut.log 2>&1) \
      || { echo "[mutation] $module: mutmut failed, see $dir/mutmut.log" >&2; tail -20 "$dir/mutmut.log" >&2; exit 1; }
  fi
  (cd "$dir" && "$mutmut" export-cicd-stats > /dev/null)
  .venv/bin/python - "$dir/mutants/mutmut-cicd-stats.json" "$results/$module.json" "$source_file" \
    "$(( $(date +%s) - started ))" "$(cat /proc/loadavg)" "${tests[@]}" <<'PY'
import json, sys
stats_path, out, source, seconds, load, *tests = sys.argv[1:]
counts = json.load(open(stats_path))
# a mutant no test covers ("no tests") counts as undetected, like a survivor
checked = counts["total"] - counts["skipped"]
counts.update(
    module=source,
    tests=tests,
    seconds=int(seconds),
    load_average_after=load.split()[:3],
    # a mutant is detected when a test fails or it runs past the timeout (an infinite loop)
    score=(counts["killed"] + counts["timeout"]) / checked if checked else None,
)
json.dump(counts, open(out, "w"), indent=1)
print(f"[mutation] {source}: score {counts['score']:.3f} ({counts['killed']} killed, "
      f"{counts['timeout']} timeout, {counts['survived']} survived, {counts['no_tests']} without tests) "
      f"in {seconds} s")
PY
  (cd "$dir" && "$mutmut" results 2>/dev/null | sed -n 's/^ *\([^ :]*\): \(survived\|timeout\|no tests\|suspicious\|segfault\)$/\1 \2/p' \
    | while read -r name status; do echo "## $name ($status)"; "$mutmut" show "$name" 2>/dev/null | tail -n +2; echo; done) \
    > "$results/$module-survivors.txt"
done
