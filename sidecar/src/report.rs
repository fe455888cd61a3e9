//! The agent report: what agents gained over a window, per tenant and
//! harness, as JSON (what the admin server's `/debug/report` serves) and as
//! text tables (what `kvmesh-sidecar report` prints). Ids, counts and
//! section positions only: never prompt text.
//!
//! Pure rendering: the admin edge reads the ledger and fetches the JSON.

use std::fmt::Write as _;

use kvmesh_core::{BreakPoint, Report, SectionKind, Totals};
use serde_json::{Value, json};

/// Where a break point is, in words: "tools", "system" or "message 3".
fn section_name(point: &BreakPoint) -> String {
    match point.kind {
        SectionKind::Message => format!("message {}", point.index),
        kind => kind.as_str().to_owned(),
    }
}

fn row_json(harness: &str, tenant: &str, t: &Totals) -> Value {
    let moves: serde_json::Map<String, Value> = t.moves_by_reason().map(|(r, n)| (r.to_owned(), json!(n))).collect();
    let breaks: serde_json::Map<String, Value> = t.breaks_by_section().map(|(s, n)| (s.to_owned(), json!(n))).collect();
    let mut row = serde_json::Map::new();
    row.insert("harness".to_owned(), json!(harness));
    row.insert("tenant".to_owned(), json!(tenant));
    for (name, value) in t.figures() {
        // Counts print as integers.
        let whole = value.fract() == 0.0 && (0.0..9e15).contains(&value);
        row.insert(name.to_owned(), if whole { json!(value as u64) } else { json!(value) });
    }
    row.insert("moves".to_owned(), Value::Object(moves));
    row.insert("prefix_breaks".to_owned(), Value::Object(breaks));
    Value::Object(row)
}

/// The report as the admin server serves it.
pub(crate) fn to_json(report: &Report) -> Value {
    let rows: Vec<Value> = report
        .rows
        .iter()
        .map(|(harness, tenant, t)| row_json(harness, tenant, t))
        .collect();
    // A break point's share of its harness's checked calls.
    let checks = |harness: &str| -> u64 {
        report
            .rows
            .iter()
            .filter(|r| r.0 == harness)
            .map(|r| r.2.prefix_checks)
            .sum()
    };
    let breakers: Vec<Value> = report
        .breakers
        .iter()
        .take(20)
        .map(|(harness, point, stats)| {
            let checked = checks(harness);
            json!({
                "harness": harness,
                "section": section_name(point),
                "kind": point.kind.as_str(),
                "index": point.index,
                "count": stats.count,
                "share_of_checked_calls": if checked > 0 { stats.count as f64 / checked as f64 } else { 0.0 },
                "first_block_min": stats.first_block_min,
                "first_block_max": stats.first_block_max,
            })
        })
        .collect();
    let retention: Vec<Value> = report
        .retention
        .iter()
        .filter(|(_, r)| r.idle_sessions > 0)
        .map(|(harness, r)| {
            json!({
                "harness": harness,
                "idle_sessions": r.idle_sessions,
                "kv_bytes": r.kv_bytes,
                "recompute_seconds": r.recompute_ms / 1000.0,
                "longest_idle_seconds": r.max_idle_ms as f64 / 1000.0,
            })
        })
        .collect();
    json!({
        "window_seconds": report.window_ms / 1000,
        "rows": rows,
        "breakers": breakers,
        "retention": retention,
    })
}

fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or(0.0)
}

fn text(v: &Value) -> &str {
    v.as_str().unwrap_or("?")
}

/// Human units: 1234567 → "1.23M".
fn si(x: f64) -> String {
    let (value, unit) = match x.abs() {
        a if a >= 1e12 => (x / 1e12, "T"),
        a if a >= 1e9 => (x / 1e9, "G"),
        a if a >= 1e6 => (x / 1e6, "M"),
        a if a >= 1e3 => (x / 1e3, "k"),
        _ => (x, ""),
    };
    if unit.is_empty() {
        format!("{value:.0}")
    } else {
        format!("{value:.2}{unit}")
    }
}

fn percent(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

/// The report as tables, for a terminal.
pub(crate) fn render_text(report: &Value) -> String {
    let mut out = String::new();
    let window = report["window_seconds"].as_u64().unwrap_or(0);
    let _ = writeln!(out, "kvmesh agent report, last {window} s\n");
    let _ = writeln!(
        out,
        "{:<16} {:<12} {:>7} {:>10} {:>10} {:>10} {:>7} {:>7} {:>7} {:>9} {:>9} {:>11}",
        "tenant",
        "harness",
        "calls",
        "computed",
        "reused",
        "repeated",
        "reuse",
        "r/w",
        "sticky",
        "gpu s",
        "gpu s",
        "idle KV"
    );
    let _ = writeln!(
        out,
        "{:<16} {:<12} {:>7} {:>10} {:>10} {:>10} {:>7} {:>7} {:>7} {:>9} {:>9} {:>11}",
        "", "", "", "tokens", "tokens", "prefix", "share", "ratio", "rate", "saved", "computed", "GB·s"
    );
    let rows = report["rows"].as_array().map(Vec::as_slice).unwrap_or_default();
    for row in rows {
        let read = num(&row["cache_read_tokens"]);
        let written = num(&row["cache_written_tokens"]);
        let reuse = if read + written > 0.0 {
            read / (read + written)
        } else {
            0.0
        };
        let _ = writeln!(
            out,
            "{:<16} {:<12} {:>7} {:>10} {:>10} {:>10} {:>7} {:>7.2} {:>7} {:>9.1} {:>9.1} {:>11.1}",
            clip(text(&row["tenant"]), 16),
            text(&row["harness"]),
            row["calls"].as_u64().unwrap_or(0),
            si(written),
            si(read),
            percent(num(&row["repeated_prefix_share"])),
            percent(reuse),
            num(&row["read_write_ratio"]),
            percent(num(&row["same_worker_rate"])),
            num(&row["gpu_seconds_saved"]),
            num(&row["gpu_seconds_computed"]),
            num(&row["idle_kv_byte_seconds"]) / 1e9,
        );
    }
    if rows.is_empty() {
        let _ = writeln!(out, "(no calls in this window)");
    }
    let _ = writeln!(
        out,
        "\ntop prefix breakers (where a session's next call stopped matching its previous prompt)"
    );
    let breakers = report["breakers"].as_array().map(Vec::as_slice).unwrap_or_default();
    if breakers.is_empty() {
        let _ = writeln!(
            out,
            "(none: every continuing call kept its previous prompt as a prefix)"
        );
    }
    for b in breakers.iter().take(10) {
        let _ = writeln!(
            out,
            "  {:<12} {:<14} {:>6} breaks  {:>6} of checked calls  first differing block {}..{}",
            text(&b["harness"]),
            text(&b["section"]),
            b["count"].as_u64().unwrap_or(0),
            percent(num(&b["share_of_checked_calls"])),
            b["first_block_min"].as_u64().unwrap_or(0),
            b["first_block_max"].as_u64().unwrap_or(0),
        );
    }
    let retention = report["retention"].as_array().map(Vec::as_slice).unwrap_or_default();
    if !retention.is_empty() {
        let _ = writeln!(out, "\nidle sessions now (KV kept warm while agents wait on tools)");
        for r in retention {
            let _ = writeln!(
                out,
                "  {:<12} {:>6} sessions  {:>10} KV bytes  {:>8.1} s to recompute  longest idle {:.0} s",
                text(&r["harness"]),
                r["idle_sessions"].as_u64().unwrap_or(0),
                si(num(&r["kv_bytes"])),
                num(&r["recompute_seconds"]),
                num(&r["longest_idle_seconds"]),
            );
        }
    }
    out
}

fn clip(s: &str, width: usize) -> String {
    if s.chars().count() <= width {
        s.to_owned()
    } else {
        let mut cut: String = s.chars().take(width - 1).collect();
        cut.push('…');
        cut
    }
}
