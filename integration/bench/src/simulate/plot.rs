//! An SVG beside the JSON results: each policy's TTFT distribution (CDF,
//! log time axis) and its hit rate, with the infinite-cache bound.

use std::fmt::Write;

const COLORS: [&str; 8] = [
    "#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// `series`: (policy, sorted TTFTs in ms, hit rate).
pub(crate) fn svg(title: &str, series: &[(String, Vec<f64>, f64)], bound: f64) -> String {
    let (w, h, left, top, plot_w, plot_h) = (960.0, 420.0, 60.0, 40.0, 520.0, 320.0);
    let max_ms = series.iter().filter_map(|s| s.1.last().copied()).fold(1.0, f64::max);
    let min_ms = series
        .iter()
        .filter_map(|s| s.1.first().copied())
        .fold(max_ms, f64::min)
        .max(0.1);
    let (lo, hi) = (
        min_ms.log10().floor(),
        max_ms.log10().ceil().max(min_ms.log10().floor() + 1.0),
    );
    let x = |ms: f64| left + (ms.max(min_ms).log10() - lo) / (hi - lo) * plot_w;
    let y = |p: f64| top + (1.0 - p) * plot_h;
    let mut out = String::new();
    let _ = write!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = write!(
        out,
        r#"<text x="{left}" y="20" font-size="14">{}</text>"#,
        escape(title)
    );
    let _ = write!(
        out,
        r#"<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="gray"/>"#
    );
    let mut decade = lo;
    while decade <= hi {
        let xd = left + (decade - lo) / (hi - lo) * plot_w;
        let _ = write!(
            out,
            r#"<line x1="{xd}" y1="{top}" x2="{xd}" y2="{}" stroke="lightgray"/>"#,
            top + plot_h
        );
        let _ = write!(
            out,
            r#"<text x="{xd}" y="{}" text-anchor="middle">{} ms</text>"#,
            top + plot_h + 16.0,
            10f64.powf(decade)
        );
        decade += 1.0;
    }
    let _ = write!(
        out,
        r#"<text x="{}" y="{}" text-anchor="middle">TTFT (CDF)</text>"#,
        left + plot_w / 2.0,
        h - 20.0
    );
    for (i, (name, ttft, _)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let n = ttft.len().max(1) as f64;
        let step = (ttft.len() / 400).max(1);
        let points: Vec<String> = ttft
            .iter()
            .enumerate()
            .step_by(step)
            .map(|(k, t)| format!("{:.1},{:.1}", x(*t), y((k + 1) as f64 / n)))
            .collect();
        let _ = write!(
            out,
            r#"<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{}"/>"#,
            points.join(" ")
        );
        let _ = write!(
            out,
            r#"<text x="{}" y="{}" fill="{color}">{}</text>"#,
            left + 10.0,
            top + 16.0 + 15.0 * i as f64,
            escape(name)
        );
    }
    // Hit rate bars.
    let (bx, bw) = (left + plot_w + 60.0, 300.0);
    let bar_h = plot_h / series.len().max(1) as f64;
    for (i, (name, _, hit)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let yb = top + i as f64 * bar_h;
        let _ = write!(
            out,
            r#"<rect x="{bx}" y="{}" width="{:.1}" height="{:.1}" fill="{color}"/>"#,
            yb + 2.0,
            hit * bw,
            bar_h - 4.0
        );
        let _ = write!(
            out,
            r#"<text x="{}" y="{}">{} {:.3}</text>"#,
            bx + 4.0,
            yb + bar_h / 2.0 + 4.0,
            escape(name),
            hit
        );
    }
    let xb = bx + bound * bw;
    let _ = write!(
        out,
        r#"<line x1="{xb}" y1="{top}" x2="{xb}" y2="{}" stroke="black" stroke-dasharray="4"/>"#,
        top + plot_h
    );
    let _ = write!(
        out,
        r#"<text x="{bx}" y="{}">hit rate (dashed: infinite-cache bound {bound:.3})</text>"#,
        h - 20.0
    );
    out.push_str("</svg>\n");
    out
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}
