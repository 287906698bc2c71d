//! A timeline as a self-contained SVG (no fonts, no system libraries): requests per second and
//! failed requests per [`BUCKET`] for each kind of load, with every restart marked.

use std::fmt::Write;

use envoy_agent_tests::{BUCKET, Bucket};

/// One load's buckets.
#[derive(Debug, Clone)]
pub struct Panel {
    /// E.g. "keep-alive (4 workers)".
    pub name: String,
    /// Since the run's origin.
    pub buckets: Vec<Bucket>,
}

/// What a vertical mark says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MarkKind {
    /// The restart was asked for (SIGHUP).
    Trigger,
    /// The new epoch answered LIVE.
    Live,
    /// The previous epoch exited.
    ParentExit,
}

impl MarkKind {
    fn color(self) -> &'static str {
        match self {
            MarkKind::Trigger => "#7f7f7f",
            MarkKind::Live => "#2ca02c",
            MarkKind::ParentExit => "#ff7f0e",
        }
    }

    fn label(self) -> &'static str {
        match self {
            MarkKind::Trigger => "restart asked (SIGHUP)",
            MarkKind::Live => "new epoch LIVE",
            MarkKind::ParentExit => "previous epoch exited",
        }
    }
}

/// A vertical mark, seconds since the origin.
#[derive(Debug, Clone, Copy)]
pub struct Mark {
    /// When.
    pub at_s: f64,
    /// What.
    pub kind: MarkKind,
}

const WIDTH: f64 = 1000.0;
const PANEL_HEIGHT: f64 = 180.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 50.0;
const GAP: f64 = 60.0;

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A round step for an axis spanning `span`, about `ticks` ticks.
fn step(span: f64, ticks: f64) -> f64 {
    let raw = (span / ticks).max(f64::MIN_POSITIVE);
    let magnitude = 10f64.powf(raw.log10().floor());
    for m in [1.0, 2.0, 5.0, 10.0] {
        if raw <= m * magnitude {
            return m * magnitude;
        }
    }
    10.0 * magnitude
}

/// The SVG document.
pub fn timeline(title: &str, panels: &[Panel], marks: &[Mark]) -> String {
    let buckets = panels
        .iter()
        .map(|p| p.buckets.len())
        .max()
        .unwrap_or(1)
        .max(1);
    let seconds = buckets as f64 * BUCKET.as_secs_f64();
    let height = TOP + panels.len() as f64 * (PANEL_HEIGHT + GAP) + 30.0;
    let scale = Scale {
        seconds,
        plot_width: WIDTH - LEFT - RIGHT,
    };
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        svg,
        r#"<rect width="100%" height="100%" fill="white"/><text x="{LEFT}" y="20" font-size="15">{}</text>"#,
        escape(title)
    );
    legend(&mut svg);
    for (i, panel) in panels.iter().enumerate() {
        draw_panel(&mut svg, panel, i, &scale, marks);
    }
    svg.push_str("</svg>\n");
    svg
}

/// The horizontal scale: the run's seconds over the plot's width.
struct Scale {
    seconds: f64,
    plot_width: f64,
}

impl Scale {
    fn x(&self, s: f64) -> f64 {
        LEFT + s / self.seconds * self.plot_width
    }
}

/// The legend under the title: the lines and marks, each named.
fn legend(svg: &mut String) {
    let mut lx = LEFT;
    for (color, label, dash) in [
        ("#1f77b4", "requests per second", ""),
        ("#d62728", "failed requests (per 100 ms)", ""),
        (MarkKind::Trigger.color(), MarkKind::Trigger.label(), "4 3"),
        (MarkKind::Live.color(), MarkKind::Live.label(), ""),
        (
            MarkKind::ParentExit.color(),
            MarkKind::ParentExit.label(),
            "2 2",
        ),
    ] {
        let _ = writeln!(
            svg,
            r#"<line x1="{lx}" y1="36" x2="{}" y2="36" stroke="{color}" stroke-width="2" stroke-dasharray="{dash}"/><text x="{}" y="40">{}</text>"#,
            lx + 18.0,
            lx + 22.0,
            escape(label)
        );
        lx += 30.0 + label.len() as f64 * 6.3;
    }
}

/// One panel (the `i`th): its title, axes, the marks, requests per second and failures.
fn draw_panel(svg: &mut String, panel: &Panel, i: usize, scale: &Scale, marks: &[Mark]) {
    let per_second = 1.0 / BUCKET.as_secs_f64();
    let (seconds, plot_width) = (scale.seconds, scale.plot_width);
    let x = |s: f64| scale.x(s);
    let top = TOP + GAP / 2.0 + i as f64 * (PANEL_HEIGHT + GAP);
    let bottom = top + PANEL_HEIGHT;
    let rates: Vec<f64> = panel
        .buckets
        .iter()
        .map(|b| (b.ok + b.failed) as f64 * per_second)
        .collect();
    let failed_total: u64 = panel.buckets.iter().map(|b| b.failed).sum();
    let ok_total: u64 = panel.buckets.iter().map(|b| b.ok).sum();
    let max_rate = rates.iter().copied().fold(1.0, f64::max) * 1.1;
    let y = |r: f64| bottom - r / max_rate * PANEL_HEIGHT;
    let _ = writeln!(
        svg,
        r#"<text x="{LEFT}" y="{}" font-size="13">{} — {ok_total} answered, {failed_total} failed</text>"#,
        top - 8.0,
        escape(&panel.name)
    );
    let _ = writeln!(
        svg,
        r##"<rect x="{LEFT}" y="{top}" width="{plot_width}" height="{PANEL_HEIGHT}" fill="none" stroke="#999"/>"##
    );
    // Axes.
    let ystep = step(max_rate, 4.0);
    let mut r = 0.0;
    while r <= max_rate {
        let _ = writeln!(
            svg,
            r##"<line x1="{LEFT}" y1="{0:.1}" x2="{1}" y2="{0:.1}" stroke="#eee"/><text x="{2}" y="{3:.1}" text-anchor="end">{r:.0}</text>"##,
            y(r),
            LEFT + plot_width,
            LEFT - 5.0,
            y(r) + 4.0
        );
        r += ystep;
    }
    let xstep = step(seconds, 10.0);
    let mut s = 0.0;
    while s <= seconds + 1e-9 {
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{s:.0}s</text>"#,
            x(s),
            bottom + 15.0
        );
        s += xstep;
    }
    // Marks under the data.
    for mark in marks {
        let dash = match mark.kind {
            MarkKind::Trigger => "4 3",
            MarkKind::Live => "",
            MarkKind::ParentExit => "2 2",
        };
        let _ = writeln!(
            svg,
            r#"<line x1="{0:.1}" y1="{top}" x2="{0:.1}" y2="{bottom}" stroke="{1}" stroke-width="1" stroke-dasharray="{dash}"/>"#,
            x(mark.at_s),
            mark.kind.color()
        );
    }
    // Requests per second.
    let mut points = String::new();
    for (j, rate) in rates.iter().enumerate() {
        let s = (j as f64 + 0.5) * BUCKET.as_secs_f64();
        let _ = write!(points, "{:.1},{:.1} ", x(s), y(*rate));
    }
    let _ = writeln!(
        svg,
        r##"<polyline points="{points}" fill="none" stroke="#1f77b4" stroke-width="1.2"/>"##
    );
    // Failures: a red bar per bucket that had any, on their own scale (a count).
    for (j, b) in panel
        .buckets
        .iter()
        .enumerate()
        .filter(|(_, b)| b.failed > 0)
    {
        let s = j as f64 * BUCKET.as_secs_f64();
        let h = (b.failed as f64 * 4.0).min(PANEL_HEIGHT);
        let _ = writeln!(
            svg,
            r##"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="{h:.1}" fill="#d62728"><title>{} failed</title></rect>"##,
            x(s),
            bottom - h,
            (x(s + BUCKET.as_secs_f64()) - x(s)).max(1.5),
            b.failed
        );
    }
    let _ = writeln!(
        svg,
        r#"<text x="15" y="{:.1}" transform="rotate(-90 15 {:.1})" text-anchor="middle">req/s</text>"#,
        top + PANEL_HEIGHT / 2.0,
        top + PANEL_HEIGHT / 2.0
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_failures_and_rates_are_drawn() {
        let buckets = vec![
            Bucket { ok: 10, failed: 0 },
            Bucket { ok: 8, failed: 2 },
            Bucket { ok: 12, failed: 0 },
        ];
        let svg = timeline(
            "t <1>",
            &[Panel {
                name: "keep-alive".to_owned(),
                buckets,
            }],
            &[
                Mark {
                    at_s: 0.1,
                    kind: MarkKind::Trigger,
                },
                Mark {
                    at_s: 0.2,
                    kind: MarkKind::Live,
                },
            ],
        );
        assert!(svg.starts_with("<svg"));
        assert!(svg.contains("t &lt;1&gt;"));
        assert!(svg.contains("30 answered, 2 failed"));
        assert!(svg.contains("<title>2 failed</title>"));
        assert_eq!(svg.matches("<polyline").count(), 1);
        assert!(svg.trim_end().ends_with("</svg>"));
    }

    #[test]
    fn steps_are_round() {
        assert_eq!(step(100.0, 4.0), 50.0);
        assert_eq!(step(7.0, 10.0), 1.0);
        assert_eq!(step(45.0, 10.0), 5.0);
    }
}
