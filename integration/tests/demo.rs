//! The demo of the README's Quick start runs to the end, and its kvmesh run
//! serves more of the prompt from cache than its round-robin run.

use std::process::Command;

/// The hit rate (percent) of the summary row of `run` in the demo's output.
fn summary_hit_rate(stdout: &str, run: &str) -> Option<f64> {
    let row = stdout
        .lines()
        .filter_map(|line| line.strip_prefix(run))
        .find(|rest| rest.starts_with(' ') && rest.contains('%'))?;
    row.split_whitespace()
        .find_map(|field| field.strip_suffix('%'))?
        .parse()
        .ok()
}

#[test]
fn demo_exits_0_and_kvmesh_hits_the_cache_more_than_round_robin() {
    // The demo bounds its own calls and stops what it started on any error.
    let output = Command::new(env!("CARGO_BIN_EXE_kvmesh-demo")).output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "kvmesh-demo failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let hit_rate =
        |run| summary_hit_rate(&stdout, run).unwrap_or_else(|| panic!("no summary row {run:?} in:\n{stdout}"));
    let kvmesh = hit_rate("kvmesh");
    let round_robin = hit_rate("round robin");
    assert!(
        kvmesh > round_robin,
        "kvmesh hit rate {kvmesh}% is not above round robin's {round_robin}%:\n{stdout}"
    );
    // Every call of the kvmesh run was routed by kvmesh, and none of the
    // round-robin run went through the filter.
    assert!(
        stdout.contains("kvmesh picks in Envoy: 12 (run 1 only), fail-opens: 0"),
        "{stdout}"
    );
}
