//! The agent report's retention section, per harness: how long sessions
//! stay away between calls, the cache hit rate kept at today's KV
//! capacity, an estimate of what more KV per worker would save, and (with
//! prices given to `kvmesh-sidecar report`) what the same traffic would cost
//! on a managed API with cache pricing. Counts, times and tokens only.
//!
//! Pure: the router's return-gap histograms are copied under its lock
//! ([`FleetSnapshot::take`], for `Shared::fleet_snapshot`), then the admin
//! edge builds the section from them, the ledger and its last tick's
//! evicted idle sessions ([`sections`]).
//!
//! ## The figures
//!
//! Return gaps are the router's (`RetentionValues`): cumulative since the
//! sidecar started (halved as they grow, so recent habits weigh), not over
//! the report's window. A quantile is the upper bound of the bucket that
//! holds it. The rest is over the report's window, from the ledger:
//!
//! ```text
//! hit_rate        = reported_cached / reported_prompt          engines' usage
//! missed_tokens   = max(0, repeated_prefix_share − hit_rate) · reported_prompt
//! missed_gpu_s    = missed_tokens · prefill_computed_s / written_tokens
//! kept_share(N)   = Σ_kept p_return(idle) · kv_bytes / Σ_all p_return(idle) · kv_bytes
//! saved_gpu_s(N)  ≈ missed_gpu_s · kept_share(N)
//! hit_rate(N)     ≈ (reported_cached + missed_tokens · kept_share(N)) / reported_prompt
//! ```
//!
//! `missed_tokens` are prompt tokens an earlier call had already sent (the
//! session's previous call, or a prefix a worker held) that the engines
//! computed again: KV that existed and was gone, or was on another worker.
//! `repeated_prefix_share` is estimated from bytes over every call and
//! applied to the calls that reported usage. `missed_gpu_s` prices them at
//! the ledger's learned prefill rate (the one behind `gpu_seconds_computed`).
//!
//! `kept_share(N)` sizes what N more GB (10⁹ bytes) of KV per worker would
//! have kept, from the sessions idle *now* whose worker no longer holds
//! their prefix: on each worker, most recently idle first (as an LRU cache
//! would keep them), until N GB are used; each weighted by its harness's
//! learned chance of coming back after that idle time (1 before anything
//! is learned). It stands in for the window's lost KV, which nobody
//! recorded session by session.
//!
//! Both are estimates, and say so in the report: `missed_tokens` is an
//! upper bound of what capacity can win (it includes calls that moved for
//! load or because a worker went away), and `kept_share` is one moment's
//! picture applied to the whole window. Output tokens are not in the
//! ledger, so prices cover input tokens only.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use kvmesh_core::retention::{GAP_BUCKETS, GapHistogram, bucket_upper_ms};
use kvmesh_core::{Harness, IdleSession, Report, Router, WorkerId};
use serde::{Deserialize, Serialize};

/// Bytes in the GB of `--extra-kv-gb`.
const GB: f64 = 1e9;
/// The extra KV per worker the report sizes when not asked.
pub(crate) const DEFAULT_EXTRA_KV_GB: f64 = 8.0;

/// What the section needs of the router, copied under its lock: about 20
/// buckets per harness (the evicted idle sessions come from the ledger's
/// tick, which asked the fleet about them in steps).
#[derive(Debug, Clone, Default)]
pub(crate) struct FleetSnapshot {
    gaps: Vec<(Harness, GapHistogram)>,
}

impl FleetSnapshot {
    pub(crate) fn take(router: &Router) -> Self {
        let mut gaps: Vec<(Harness, GapHistogram)> = router
            .retention()
            .harness_histograms()
            .map(|(h, g)| (h, g.clone()))
            .collect();
        gaps.sort_by_key(|(h, _)| *h);
        Self { gaps }
    }

    fn gaps_of(&self, harness: Harness) -> Option<&GapHistogram> {
        self.gaps.iter().find(|(h, _)| *h == harness).map(|(_, g)| g)
    }
}

/// One bucket of return gaps: `[from_ms, to_ms)`, `to_ms` absent for the
/// last (everything longer).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct GapBucket {
    pub(crate) from_ms: u64,
    pub(crate) to_ms: Option<u64>,
    /// Sessions that came back after a gap this long.
    pub(crate) returns: f64,
    /// Sessions counted gone after being idle this long.
    pub(crate) gone: f64,
}

/// The return-gap distribution of one harness.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct GapDistribution {
    pub(crate) returns: f64,
    pub(crate) gone: f64,
    /// Upper bounds of the buckets holding the quantiles (absent before
    /// any return; `u64::MAX` when in the last, open bucket).
    pub(crate) p50_ms: Option<u64>,
    pub(crate) p90_ms: Option<u64>,
    pub(crate) p99_ms: Option<u64>,
    pub(crate) buckets: Vec<GapBucket>,
}

impl GapDistribution {
    fn of(h: &GapHistogram) -> Self {
        let buckets = (0..GAP_BUCKETS)
            .map(|i| GapBucket {
                from_ms: if i == 0 { 0 } else { bucket_upper_ms(i - 1) },
                to_ms: Some(bucket_upper_ms(i)).filter(|&u| u != u64::MAX),
                returns: h.returns[i],
                gone: h.gone[i],
            })
            .collect();
        Self {
            returns: h.returns_total(),
            gone: h.gone.iter().sum(),
            p50_ms: h.return_quantile_ms(0.5),
            p90_ms: h.return_quantile_ms(0.9),
            p99_ms: h.return_quantile_ms(0.99),
            buckets,
        }
    }
}

/// What N more GB of KV per worker would have saved: estimates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct ExtraKv {
    pub(crate) gb_per_worker: f64,
    /// Share of the lost KV it would have kept (absent when no idle
    /// session's KV is lost now, so nothing sizes it).
    pub(crate) kept_share: Option<f64>,
    pub(crate) saved_gpu_seconds: Option<f64>,
    pub(crate) hit_rate: Option<f64>,
}

/// The retention section of one harness.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct HarnessRetention {
    pub(crate) harness: String,
    /// Learned since the sidecar started.
    pub(crate) return_gaps: GapDistribution,
    /// Over the window, for calls whose engine reported usage.
    pub(crate) reported_prompt_tokens: f64,
    pub(crate) reported_cached_tokens: f64,
    pub(crate) hit_rate: f64,
    /// Repeated prompt tokens the engines computed again (an upper bound).
    pub(crate) missed_tokens: f64,
    pub(crate) missed_gpu_seconds: f64,
    /// Idle sessions now whose worker no longer holds their prefix.
    pub(crate) evicted_idle_sessions: u64,
    pub(crate) evicted_idle_kv_bytes: f64,
    pub(crate) extra_kv: ExtraKv,
}

/// Per (harness): sums over its tenants' rows.
#[derive(Debug, Clone, Copy, Default)]
struct Window {
    prompt_tokens: f64,
    repeated_tokens: f64,
    reported_prompt: f64,
    reported_cached: f64,
    written: f64,
    computed_ms: f64,
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { 0.0 }
}

/// (kept, all) of each harness's evicted idle KV, weighted by its chance
/// of return, when each worker had `extra_bytes` more: most recently idle
/// first, as an LRU cache keeps them.
fn kept_by_harness(
    evicted: &[IdleSession],
    extra_bytes: f64,
    p_return: impl Fn(&str, u64) -> f64,
) -> BTreeMap<&'static str, (f64, f64)> {
    let mut by_worker: BTreeMap<WorkerId, Vec<&IdleSession>> = BTreeMap::new();
    for s in evicted {
        by_worker.entry(s.worker).or_default().push(s);
    }
    let mut kept: BTreeMap<&'static str, (f64, f64)> = BTreeMap::new();
    for sessions in by_worker.values_mut() {
        sessions.sort_by(|a, b| a.idle_ms.cmp(&b.idle_ms).then_with(|| a.session.cmp(&b.session)));
        let mut room = extra_bytes.max(0.0);
        for s in sessions.iter() {
            let p = p_return(s.harness, s.idle_ms);
            let fits = s.kv_bytes.min(room);
            room -= fits;
            let entry = kept.entry(s.harness).or_default();
            entry.0 += p * fits;
            entry.1 += p * s.kv_bytes;
        }
    }
    kept
}

/// The section, per harness in [`Harness::ALL`] order: those with learned
/// gaps, reported usage or lost KV. `evicted` is the ledger's
/// [`kvmesh_core::Insights::evicted_idle_sessions`].
pub(crate) fn sections(
    report: &Report,
    fleet: &FleetSnapshot,
    evicted: &[IdleSession],
    extra_kv_gb: f64,
) -> Vec<HarnessRetention> {
    let mut window: BTreeMap<&str, Window> = BTreeMap::new();
    for (harness, _, t) in &report.rows {
        let w = window.entry(harness.as_str()).or_default();
        w.prompt_tokens += t.prompt_tokens;
        w.repeated_tokens += t.repeated_prefix_tokens;
        w.reported_prompt += t.reported_prompt_tokens;
        w.reported_cached += t.reported_cached_tokens;
        w.written += t.written_tokens;
        w.computed_ms += t.prefill_computed_ms;
    }
    let p_return = |harness: &str, idle_ms: u64| {
        fleet
            .gaps_of(Harness::from_name(harness))
            .map_or(1.0, |g| g.p_return(idle_ms))
    };
    let kept = kept_by_harness(evicted, extra_kv_gb * GB, p_return);
    let empty = GapHistogram::default();
    Harness::ALL
        .iter()
        .filter_map(|&harness| {
            let name = harness.name();
            let gaps = fleet.gaps_of(harness).unwrap_or(&empty);
            let w = window.get(name);
            let lost: Vec<&IdleSession> = evicted.iter().filter(|s| s.harness == name).collect();
            if gaps.observations() <= 0.0 && w.is_none_or(|w| w.reported_prompt <= 0.0) && lost.is_empty() {
                return None;
            }
            let w = w.copied().unwrap_or_default();
            let hit_rate = ratio(w.reported_cached, w.reported_prompt);
            let repeated_share = ratio(w.repeated_tokens, w.prompt_tokens);
            let missed_tokens = (repeated_share - hit_rate).max(0.0) * w.reported_prompt;
            let ms_per_token = ratio(w.computed_ms, w.written);
            let missed_gpu_seconds = missed_tokens * ms_per_token / 1000.0;
            let kept_share = kept
                .get(name)
                .filter(|(_, all)| *all > 0.0)
                .map(|(kept, all)| kept / all);
            // Nothing missed: more KV saves nothing, however it is sized.
            let kept_for_saving = if missed_tokens > 0.0 { kept_share } else { Some(0.0) };
            Some(HarnessRetention {
                harness: name.to_owned(),
                return_gaps: GapDistribution::of(gaps),
                reported_prompt_tokens: w.reported_prompt,
                reported_cached_tokens: w.reported_cached,
                hit_rate,
                missed_tokens,
                missed_gpu_seconds,
                evicted_idle_sessions: lost.len() as u64,
                evicted_idle_kv_bytes: lost.iter().map(|s| s.kv_bytes).sum(),
                extra_kv: ExtraKv {
                    gb_per_worker: extra_kv_gb,
                    kept_share,
                    saved_gpu_seconds: kept_for_saving.map(|k| missed_gpu_seconds * k),
                    hit_rate: kept_for_saving.map(|k| ratio(w.reported_cached + missed_tokens * k, w.reported_prompt)),
                },
            })
        })
        .collect()
}

/// USD per million tokens, as `kvmesh-sidecar report` is given them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Prices {
    pub(crate) input: Option<f64>,
    pub(crate) cached_input: Option<f64>,
    pub(crate) output: Option<f64>,
}

/// The same traffic on a managed API with cache pricing, per harness.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct PriceRow {
    pub(crate) harness: String,
    /// Every reported prompt token at the input price.
    pub(crate) without_cache_usd: f64,
    /// At the hit rate kvmesh's cache got (absent without a cached price).
    pub(crate) with_cache_usd: Option<f64>,
    /// What kvmesh's cache saved: cached tokens × (input − cached input).
    pub(crate) cache_saved_usd: Option<f64>,
}

/// The pricing the report command adds to the JSON it prints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Pricing {
    pub(crate) prices: Prices,
    /// Input only: the ledger does not count output tokens.
    pub(crate) output_tokens_tracked: bool,
    pub(crate) rows: Vec<PriceRow>,
}

impl Pricing {
    /// Absent without an input price.
    pub(crate) fn of(section: &[HarnessRetention], prices: Prices) -> Option<Self> {
        let input = prices.input?;
        let rows = section
            .iter()
            .filter(|r| r.reported_prompt_tokens > 0.0)
            .map(|r| {
                let (prompt, cached) = (r.reported_prompt_tokens, r.reported_cached_tokens);
                PriceRow {
                    harness: r.harness.clone(),
                    without_cache_usd: prompt * input / 1e6,
                    with_cache_usd: prices
                        .cached_input
                        .map(|c| ((prompt - cached) * input + cached * c) / 1e6),
                    cache_saved_usd: prices.cached_input.map(|c| cached * (input - c) / 1e6),
                }
            })
            .collect();
        Some(Self {
            prices,
            output_tokens_tracked: false,
            rows,
        })
    }
}

/// A gap for a terminal: "250 ms", "4 s", "17 min", "longer".
fn gap(ms: u64) -> String {
    match ms {
        u64::MAX => "longer".to_owned(),
        m if m < 1_000 => format!("{m} ms"),
        m if m < 120_000 => format!("{} s", m / 1_000),
        m if m < 7_200_000 => format!("{} min", m / 60_000),
        m => format!("{} h", m / 3_600_000),
    }
}

/// A quantile: below its bucket's upper bound.
fn maybe_gap(ms: Option<u64>) -> String {
    match ms {
        None => "-".to_owned(),
        Some(u64::MAX) => "longer".to_owned(),
        Some(ms) => format!("<{}", gap(ms)),
    }
}

fn percent(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

/// The section as tables; `prices` from the command line.
pub(crate) fn render(out: &mut String, section: &[HarnessRetention], pricing: Option<&Pricing>) {
    let _ = writeln!(
        out,
        "\nretention by harness (return gaps learned since start; the rest over the window; ~ marks estimates)"
    );
    if section.is_empty() {
        let _ = writeln!(out, "(no session has come back or reported usage yet)");
        return;
    }
    let extra = section.first().map_or(0.0, |r| r.extra_kv.gb_per_worker);
    let _ = writeln!(
        out,
        "  {:<12} {:>8} {:>6} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9} {:>9} {:>10} {:>9}",
        "harness",
        "returns",
        "gone",
        "p50 gap",
        "p90 gap",
        "p99 gap",
        "hit rate",
        "~missed",
        "~missed",
        format!("+{extra} GB"),
        "~gpu s",
        "~hit rate"
    );
    let _ = writeln!(
        out,
        "  {:<12} {:>8} {:>6} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9} {:>9} {:>10} {:>9}",
        "", "", "", "", "", "", "", "tokens", "gpu s", "~keeps", "saved", "then"
    );
    for r in section {
        let g = &r.return_gaps;
        let e = &r.extra_kv;
        let _ = writeln!(
            out,
            "  {:<12} {:>8.0} {:>6.0} {:>8} {:>8} {:>8} {:>8} {:>9.0} {:>9.2} {:>9} {:>10} {:>9}",
            r.harness,
            g.returns,
            g.gone,
            maybe_gap(g.p50_ms),
            maybe_gap(g.p90_ms),
            maybe_gap(g.p99_ms),
            percent(r.hit_rate),
            r.missed_tokens,
            r.missed_gpu_seconds,
            e.kept_share.map_or_else(|| "n/a".to_owned(), percent),
            e.saved_gpu_seconds
                .map_or_else(|| "n/a".to_owned(), |s| format!("{s:.2}")),
            e.hit_rate.map_or_else(|| "n/a".to_owned(), percent),
        );
    }
    let _ = writeln!(
        out,
        "  (~missed: repeated prompt tokens the engines computed again, an upper bound of what more KV wins;\n   \
         ~keeps: the share of the idle sessions' lost KV that {extra} GB more per worker would hold, most recently idle first;\n   \
         n/a: no idle session has lost its KV now, so nothing sizes it)"
    );
    let _ = writeln!(
        out,
        "\nreturn gaps (sessions back after a gap in the bucket; gone: given up after idling that long)"
    );
    for r in section {
        let cells: Vec<String> = r
            .return_gaps
            .buckets
            .iter()
            .filter(|b| b.returns > 0.0 || b.gone > 0.0)
            .map(|b| {
                let span = b
                    .to_ms
                    .map_or_else(|| format!(">={}", gap(b.from_ms)), |to| format!("<{}", gap(to)));
                match (b.returns > 0.0, b.gone > 0.0) {
                    (true, true) => format!("{span}: {:.0} back, {:.0} gone", b.returns, b.gone),
                    (true, false) => format!("{span}: {:.0} back", b.returns),
                    _ => format!("{span}: {:.0} gone", b.gone),
                }
            })
            .collect();
        let cells = if cells.is_empty() {
            "(none yet)".to_owned()
        } else {
            cells.join(" | ")
        };
        let _ = writeln!(out, "  {:<12} {cells}", r.harness);
    }
    render_prices(out, pricing);
}

fn usd(x: f64) -> String {
    format!("${x:.4}")
}

fn render_prices(out: &mut String, pricing: Option<&Pricing>) {
    let Some(pricing) = pricing else {
        let _ = writeln!(
            out,
            "\nmanaged API price: pass --price-input and --price-cached-input (USD per million tokens, from your \
             provider's price list) to price this traffic"
        );
        return;
    };
    let _ = writeln!(
        out,
        "\nthe same traffic on a managed API (input tokens of calls that reported usage; output tokens are not counted{})",
        if pricing.prices.output.is_some() {
            ", so --price-output is not applied"
        } else {
            ""
        }
    );
    let _ = writeln!(
        out,
        "  {:<12} {:>14} {:>16} {:>18}",
        "harness", "without cache", "at kvmesh's hits", "kvmesh cache saved"
    );
    for row in &pricing.rows {
        let _ = writeln!(
            out,
            "  {:<12} {:>14} {:>16} {:>18}",
            row.harness,
            usd(row.without_cache_usd),
            row.with_cache_usd.map_or_else(|| "-".to_owned(), usd),
            row.cache_saved_usd.map_or_else(|| "-".to_owned(), usd),
        );
    }
    if pricing.prices.cached_input.is_none() {
        let _ = writeln!(
            out,
            "  (pass --price-cached-input to price the cached tokens and what kvmesh's cache saved)"
        );
    }
}

#[cfg(test)]
mod tests;
