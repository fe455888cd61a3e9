#!/usr/bin/env bash
# Runs the workspace's tests to the end (--no-fail-fast: a failing test
# binary does not hide the ones after it), keeps the whole output in
# target/test-logs/, and ends with one summary: each failed test by name,
# each test binary that failed without a test result (a crash, a build
# error), the slowest binaries, and the counts.
#
#   integration/suite/run.sh [extra cargo test arguments]
set -uo pipefail
cd "$(dirname "$0")/../.."

logs=target/test-logs
mkdir -p "$logs"
log=$logs/suite-$(date -u +%Y%m%dT%H%M%SZ).log
echo "kvmesh test: the whole output goes to $log" >&2

cargo test --workspace --locked --no-fail-fast "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}

# cargo prints `Running <binary>` (or `Doc-tests <crate>`) before each
# binary's tests, `test <name> ... FAILED` per failure, and one `test
# result:` line per binary; --no-fail-fast ends with the list of binaries
# that failed.
awk -v status="$status" -v logfile="$log" '
    function flush() {
        if (binary != "" && !has_result) crashed[++ncrashed] = binary
    }
    /^ +Running / {
        flush()
        # "Running tests/x.rs (target/debug/deps/x-<hash>)": the name of the
        # binary (its crate, for unit tests) and the source it runs.
        path = $0; sub(/^.*\(/, "", path); sub(/\).*$/, "", path)
        sub(/^.*\//, "", path); sub(/-[0-9a-f]+$/, "", path)
        binary = path " (" $(NF - 1) ")"; has_result = 0
        next
    }
    /^ +Doc-tests / {
        flush()
        binary = "doc-tests of " $2; has_result = 0
        next
    }
    /^test .* \.\.\. FAILED$/ {
        name = $2
        failed[++nfailed] = binary ": " name
        next
    }
    /^test result: / {
        has_result = 1
        for (i = 1; i <= NF; i++) {
            word = $i; sub(/[;,]$/, "", word)
            if (word == "passed") passed += $(i - 1)
            if (word == "failed") nfail += $(i - 1)
            if (word == "ignored") ignored += $(i - 1)
            if (word == "in") { secs = $(i + 1); sub(/s$/, "", secs); took[binary] = secs + 0 }
        }
        next
    }
    END {
        flush()
        print ""
        print "== kvmesh test summary =="
        if (nfailed > 0) {
            print "failed tests:"
            for (i = 1; i <= nfailed; i++) print "  " failed[i]
        }
        if (ncrashed > 0) {
            print "test binaries that ended without a result (crashed, or did not build):"
            for (i = 1; i <= ncrashed; i++) print "  " crashed[i]
        }
        n = 0
        for (b in took) { n++; names[n] = b }
        # The five slowest binaries, slowest first.
        for (k = 1; k <= 5 && k <= n; k++) {
            best = k
            for (j = k + 1; j <= n; j++) if (took[names[j]] > took[names[best]]) best = j
            t = names[k]; names[k] = names[best]; names[best] = t
            if (k == 1) print "slowest test binaries:"
            printf "  %7.1f s  %s\n", took[names[k]], names[k]
        }
        if (status != 0 && nfailed == 0 && ncrashed == 0)
            print "cargo test exited " status " before or after the tests (see " logfile ")"
        print "whole output: " logfile
        printf "summary: %d passed, %d failed, %d skipped\n", passed, nfail + ncrashed, ignored
    }
' "$log"
exit "$status"
