//! The agent report: what agents gained over a window, per tenant and
//! harness, as JSON (what the admin server's `/debug/report` serves) and as
//! text tables (what `kvmesh-sidecar report` prints). Ids, counts and
//! section positions only: never prompt text.
//!
//! Pure rendering: the admin edge reads the ledger and fetches the JSON.

use std::fmt::Write as _;

use std::collections::BTreeMap;

use kvmesh_core::{BreakPoint, Figures, Report, SectionKind, Totals};
use serde::{Deserialize, Serialize};

use crate::retention_report::{HarnessRetention, Pricing};

/// The report as the admin server serves it and `kvmesh-sidecar report`
/// reads it back: typed both ways, so a renamed figure fails to compile
/// rather than print 0.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct AgentReport {
    window_seconds: u64,
    rows: Vec<Row>,
    breakers: Vec<Breaker>,
    retention: Vec<RetentionRow>,
    /// Return gaps, hit rate and what more KV would save, per harness.
    pub(crate) retention_by_harness: Vec<HarnessRetention>,
    /// Added by `kvmesh-sidecar report` when given prices; the admin server
    /// never sends it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) pricing: Option<Pricing>,
}

/// One (harness, tenant): the ledger's figures, as it names them.
#[derive(Debug, Serialize, Deserialize)]
struct Row {
    harness: String,
    tenant: String,
    #[serde(flatten)]
    figures: Figures,
    moves: BTreeMap<String, u64>,
    prefix_breaks: BTreeMap<String, u64>,
}

#[derive(Debug, Serialize, Deserialize)]
struct Breaker {
    harness: String,
    /// In words: "tools", "system" or "message 3".
    section: String,
    kind: String,
    index: u32,
    count: u64,
    /// The break point's share of its harness's checked calls.
    share_of_checked_calls: f64,
    first_block_min: u64,
    first_block_max: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct RetentionRow {
    harness: String,
    idle_sessions: u64,
    kv_bytes: f64,
    recompute_seconds: f64,
    longest_idle_seconds: f64,
}

/// Where a break point is, in words: "tools", "system" or "message 3".
fn section_name(point: &BreakPoint) -> String {
    match point.kind {
        SectionKind::Message => format!("message {}", point.index),
        kind => kind.name().to_owned(),
    }
}

fn row(harness: &str, tenant: &str, t: &Totals) -> Row {
    Row {
        harness: harness.to_owned(),
        tenant: tenant.to_owned(),
        figures: t.figures(),
        moves: t.moves_by_reason().map(|(r, n)| (r.to_owned(), n)).collect(),
        prefix_breaks: t.breaks_by_section().map(|(s, n)| (s.to_owned(), n)).collect(),
    }
}

/// The report as the admin server serves it, with its retention section
/// (`crate::retention_report::sections`).
pub(crate) fn to_json(report: &Report, retention_by_harness: Vec<HarnessRetention>) -> AgentReport {
    let rows: Vec<Row> = report
        .rows
        .iter()
        .map(|(harness, tenant, t)| row(harness, tenant, t))
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
    let breakers: Vec<Breaker> = report
        .breakers
        .iter()
        .take(20)
        .map(|(harness, point, stats)| {
            let checked = checks(harness);
            Breaker {
                harness: harness.clone(),
                section: section_name(point),
                kind: point.kind.name().to_owned(),
                index: point.index,
                count: stats.count,
                share_of_checked_calls: if checked > 0 {
                    stats.count as f64 / checked as f64
                } else {
                    0.0
                },
                first_block_min: stats.first_block_min,
                first_block_max: stats.first_block_max,
            }
        })
        .collect();
    let retention: Vec<RetentionRow> = report
        .retention
        .iter()
        .filter(|(_, r)| r.idle_sessions > 0)
        .map(|(harness, r)| RetentionRow {
            harness: harness.clone(),
            idle_sessions: r.idle_sessions,
            kv_bytes: r.kv_bytes,
            recompute_seconds: r.recompute_ms / 1000.0,
            longest_idle_seconds: r.max_idle_ms as f64 / 1000.0,
        })
        .collect();
    AgentReport {
        window_seconds: report.window_ms / 1000,
        rows,
        breakers,
        retention,
        retention_by_harness,
        pricing: None,
    }
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
pub(crate) fn render_text(report: &AgentReport) -> String {
    let mut out = String::new();
    let window = report.window_seconds;
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
    for row in &report.rows {
        let f = &row.figures;
        let (read, written) = (f.cache_read_tokens, f.cache_written_tokens);
        let reuse = if read + written > 0.0 {
            read / (read + written)
        } else {
            0.0
        };
        let _ = writeln!(
            out,
            "{:<16} {:<12} {:>7} {:>10} {:>10} {:>10} {:>7} {:>7.2} {:>7} {:>9.1} {:>9.1} {:>11.1}",
            clip(&row.tenant, 16),
            row.harness,
            f.calls,
            si(written),
            si(read),
            percent(f.repeated_prefix_share),
            percent(reuse),
            f.read_write_ratio,
            percent(f.same_worker_rate),
            f.gpu_seconds_saved,
            f.gpu_seconds_computed,
            f.idle_kv_byte_seconds / 1e9,
        );
    }
    if report.rows.is_empty() {
        let _ = writeln!(out, "(no calls in this window)");
    }
    let _ = writeln!(
        out,
        "\ntop prefix breakers (where a session's next call stopped matching its previous prompt)"
    );
    if report.breakers.is_empty() {
        let _ = writeln!(
            out,
            "(none: every continuing call kept its previous prompt as a prefix)"
        );
    }
    for b in report.breakers.iter().take(10) {
        let _ = writeln!(
            out,
            "  {:<12} {:<14} {:>6} breaks  {:>6} of checked calls  first differing block {}..{}",
            b.harness,
            b.section,
            b.count,
            percent(b.share_of_checked_calls),
            b.first_block_min,
            b.first_block_max,
        );
    }
    render_lanes(&mut out, &report.rows);
    if !report.retention.is_empty() {
        let _ = writeln!(out, "\nidle sessions now (KV kept warm while agents wait on tools)");
        for r in &report.retention {
            let _ = writeln!(
                out,
                "  {:<12} {:>6} sessions  {:>10} KV bytes  {:>8.1} s to recompute  longest idle {:.0} s",
                r.harness,
                r.idle_sessions,
                si(r.kv_bytes),
                r.recompute_seconds,
                r.longest_idle_seconds,
            );
        }
    }
    crate::retention_report::render(&mut out, &report.retention_by_harness, report.pricing.as_ref());
    out
}

/// Side calls, compactions and trace-named parents, for the rows that
/// have any: what is placed and counted apart from the conversation.
fn render_lanes(out: &mut String, rows: &[Row]) {
    let beside = |f: &Figures| f.side_calls + f.compaction_calls + f.trace_parents + f.unknown_trace_parents > 0;
    if !rows.iter().any(|row| beside(&row.figures)) {
        return;
    }
    let _ = writeln!(
        out,
        "\nlanes (side calls are placed on their own merits; a compaction starts a new prefix, not a break)"
    );
    let _ = writeln!(
        out,
        "  {:<16} {:<12} {:>7} {:>11} {:>7} {:>14} {:>14}",
        "tenant", "harness", "side", "compactions", "epochs", "trace parents", "unknown traces"
    );
    for row in rows.iter().filter(|row| beside(&row.figures)) {
        let f = &row.figures;
        let _ = writeln!(
            out,
            "  {:<16} {:<12} {:>7} {:>11} {:>7} {:>14} {:>14}",
            clip(&row.tenant, 16),
            row.harness,
            f.side_calls,
            f.compaction_calls,
            f.prefix_epochs,
            f.trace_parents,
            f.unknown_trace_parents,
        );
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn report_of(totals: Totals) -> AgentReport {
        let report = Report {
            window_ms: 60_000,
            rows: vec![("opencode".to_owned(), "none".to_owned(), totals)],
            ..Report::default()
        };
        to_json(&report, Vec::new())
    }

    #[test]
    fn side_calls_and_compactions_get_their_own_lines() {
        let text = render_text(&report_of(Totals {
            calls: 5,
            side_calls: 2,
            compaction_calls: 1,
            prefix_epochs: 1,
            ..Totals::default()
        }));
        let line = text
            .lines()
            .skip_while(|l| !l.starts_with("lanes"))
            .find(|l| l.contains("opencode"))
            .unwrap_or_default();
        assert_eq!(
            line.split_whitespace().collect::<Vec<_>>(),
            ["none", "opencode", "2", "1", "1", "0", "0"],
            "{text}"
        );
        let plain = render_text(&report_of(Totals {
            calls: 5,
            ..Totals::default()
        }));
        assert!(!plain.contains("\nlanes"), "{plain}");
    }
}
