//! Line charts as SVG, for `kvfabric profile --plot` and the planner's timeline: panels of
//! series over linear axes with round tick values, a legend, no scripts and no external
//! resources (the file opens in any browser).

use std::fmt::Write as _;

/// One line.
#[derive(Debug, Clone)]
pub struct Series {
    /// Its legend.
    pub name: String,
    /// Points, in drawing order.
    pub points: Vec<(f64, f64)>,
    /// Drawn as steps (a value holds until the next point) instead of straight segments.
    pub steps: bool,
    /// Drawn dashed (limits, targets).
    pub dashed: bool,
}

impl Series {
    /// A solid line through `points`.
    pub fn line(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Series { name: name.into(), points, steps: false, dashed: false }
    }
}

/// One panel.
#[derive(Debug, Clone, Default)]
pub struct Chart {
    /// Above the panel.
    pub title: String,
    /// Under the x axis.
    pub x_label: String,
    /// Beside the y axis.
    pub y_label: String,
    /// A log2 x axis (sizes, queue depths), ticks at powers of two.
    pub x_log2: bool,
    /// With `x_log2`: tick labels as sizes in bytes (4K, 1M) instead of numbers.
    pub x_bytes: bool,
    /// Its lines.
    pub series: Vec<Series>,
}

const PALETTE: &[&str] =
    &["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
const W: f64 = 520.0;
const H: f64 = 330.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = 16.0;
const TOP: f64 = 34.0;
const BOTTOM: f64 = 46.0;

/// The distinct values of `items`, in the order they first appear (the series of a chart).
pub fn distinct<T: PartialEq>(items: impl IntoIterator<Item = T>) -> Vec<T> {
    let mut out = Vec::new();
    for x in items {
        if !out.contains(&x) {
            out.push(x);
        }
    }
    out
}

/// About `n` round tick values covering `lo..=hi`.
fn ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    let span = (hi - lo).max(1e-12);
    let raw = span / n.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * mag).find(|s| *s >= raw).unwrap_or(mag);
    let mut t = (lo / step).ceil() * step;
    let mut out = Vec::new();
    while t <= hi + step * 1e-9 && out.len() < 50 {
        out.push(if t.abs() < step * 1e-9 { 0.0 } else { t });
        t += step;
    }
    out
}

fn label(v: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    let a = v.abs();
    if a >= 1000.0 {
        format!("{:.0}", v)
    } else if a >= 1.0 {
        format!("{:.2}", v).trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        format!("{:.4}", v).trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// `2^k` bytes as 512, 4K, 1M, 2G.
fn size_label(k: i32) -> String {
    match k {
        ..=9 => format!("{}", 1u64 << k.max(0)),
        10..=19 => format!("{}K", 1u64 << (k - 10)),
        20..=29 => format!("{}M", 1u64 << (k - 20)),
        _ => format!("{}G", 1u64 << (k - 30).min(40)),
    }
}

fn panel(out: &mut String, c: &Chart, ox: f64, oy: f64) {
    let logged;
    let c = if c.x_log2 {
        // Positions in log2; points at x <= 0 cannot be drawn.
        logged = Chart {
            series: c
                .series
                .iter()
                .map(|s| Series {
                    points: s
                        .points
                        .iter()
                        .filter(|p| p.0 > 0.0)
                        .map(|p| (p.0.log2(), p.1))
                        .collect(),
                    ..s.clone()
                })
                .collect(),
            ..c.clone()
        };
        &logged
    } else {
        c
    };
    let pts: Vec<(f64, f64)> = c
        .series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .collect();
    let (mut x0, mut x1) =
        pts.iter().fold((f64::MAX, f64::MIN), |a, p| (a.0.min(p.0), a.1.max(p.0)));
    let mut y1 = pts.iter().fold(f64::MIN, |a, p| a.max(p.1));
    let mut y0 = pts.iter().fold(f64::MAX, |a, p| a.min(p.1)).min(0.0);
    if pts.is_empty() {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if y1 <= y0 {
        y1 = y0 + 1.0;
    }
    y1 += (y1 - y0) * 0.05;
    let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
    let sx = |x: f64| ox + LEFT + (x - x0) / (x1 - x0) * pw;
    let sy = |y: f64| oy + TOP + ph - (y - y0) / (y1 - y0) * ph;
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" font-size="14" font-weight="bold">{}</text>"#,
        ox + LEFT,
        oy + 20.0,
        esc(&c.title)
    );
    for t in ticks(y0, y1, 5) {
        let y = sy(t);
        let _ = writeln!(
            out,
            r##"<line x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e5e5e5"/><text x="{:.1}" y="{:.1}" font-size="11" text-anchor="end">{}</text>"##,
            ox + LEFT,
            ox + LEFT + pw,
            ox + LEFT - 6.0,
            y + 4.0,
            label(t)
        );
    }
    let xticks: Vec<(f64, String)> = if c.x_log2 {
        let (a, b) = (x0.ceil() as i32, x1.floor() as i32);
        let every = ((b - a) / 8 + 1).max(1) as usize;
        (a..=b)
            .step_by(every)
            .map(|k| {
                let text = if c.x_bytes { size_label(k) } else { label(2f64.powi(k)) };
                (f64::from(k), text)
            })
            .collect()
    } else {
        ticks(x0, x1, 6).into_iter().map(|t| (t, label(t))).collect()
    };
    for (t, text) in xticks {
        let x = sx(t);
        let _ = writeln!(
            out,
            r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="#e5e5e5"/><text x="{x:.1}" y="{:.1}" font-size="11" text-anchor="middle">{}</text>"##,
            oy + TOP,
            oy + TOP + ph,
            oy + TOP + ph + 16.0,
            esc(&text)
        );
    }
    let _ = writeln!(
        out,
        r##"<rect x="{:.1}" y="{:.1}" width="{pw:.1}" height="{ph:.1}" fill="none" stroke="#888"/>"##,
        ox + LEFT,
        oy + TOP
    );
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle">{}</text>"#,
        ox + LEFT + pw / 2.0,
        oy + H - 10.0,
        esc(&c.x_label)
    );
    let _ = writeln!(
        out,
        r#"<text transform="translate({:.1},{:.1}) rotate(-90)" font-size="12" text-anchor="middle">{}</text>"#,
        ox + 14.0,
        oy + TOP + ph / 2.0,
        esc(&c.y_label)
    );
    for (i, s) in c.series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let mut d = String::new();
        let mut prev: Option<(f64, f64)> = None;
        for &(x, y) in s.points.iter().filter(|(x, y)| x.is_finite() && y.is_finite()) {
            match prev {
                None => {
                    let _ = write!(d, "M{:.1},{:.1}", sx(x), sy(y));
                }
                Some((_, py)) if s.steps => {
                    let _ = write!(d, " L{:.1},{:.1} L{:.1},{:.1}", sx(x), sy(py), sx(x), sy(y));
                }
                Some(_) => {
                    let _ = write!(d, " L{:.1},{:.1}", sx(x), sy(y));
                }
            }
            prev = Some((x, y));
        }
        let dash = if s.dashed { r#" stroke-dasharray="6,4""# } else { "" };
        let _ =
            writeln!(out, r#"<path d="{d}" fill="none" stroke="{color}" stroke-width="2"{dash}/>"#);
        if !s.steps && s.points.len() <= 40 {
            for &(x, y) in s.points.iter().filter(|(x, y)| x.is_finite() && y.is_finite()) {
                let _ = writeln!(
                    out,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"/>"#,
                    sx(x),
                    sy(y)
                );
            }
        }
        let ly = oy + TOP + 14.0 + i as f64 * 16.0;
        let lx = ox + LEFT + 10.0;
        let _ = writeln!(
            out,
            r#"<line x1="{lx:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{color}" stroke-width="2"{dash}/><text x="{:.1}" y="{:.1}" font-size="11">{}</text>"#,
            ly - 4.0,
            lx + 18.0,
            ly - 4.0,
            lx + 24.0,
            ly,
            esc(&s.name)
        );
    }
}

/// Panels in a grid of `columns`, as one SVG document.
pub fn render(charts: &[Chart], columns: usize) -> String {
    let columns = columns.clamp(1, charts.len().max(1));
    let rows = charts.len().div_ceil(columns).max(1);
    let (w, h) = (W * columns as f64, H * rows as f64);
    let mut out = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif">
<rect width="100%" height="100%" fill="white"/>
"#
    );
    for (i, c) in charts.iter().enumerate() {
        panel(&mut out, c, (i % columns) as f64 * W, (i / columns) as f64 * H);
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_ticks_and_labels() {
        assert_eq!(ticks(0.0, 10.0, 5), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        assert_eq!(ticks(0.013, 0.061, 4), vec![0.02, 0.04, 0.06]);
        assert_eq!(label(2500.0), "2500");
        assert_eq!(label(0.25), "0.25");
        assert_eq!(label(3.0), "3");
        assert_eq!(
            (size_label(12), size_label(20), size_label(9)),
            ("4K".into(), "1M".into(), "512".into())
        );
    }

    #[test]
    fn a_document_with_every_series_and_escaped_text() {
        let c = Chart {
            title: "ITL <by batch>".into(),
            x_label: "batch".into(),
            y_label: "ms".into(),
            x_log2: false,
            x_bytes: false,
            series: vec![
                Series::line("ctx 256", vec![(1.0, 8.0), (8.0, 9.0)]),
                Series {
                    steps: true,
                    dashed: true,
                    ..Series::line("limit", vec![(1.0, 10.0), (8.0, 12.0)])
                },
            ],
        };
        let svg = render(&[c.clone(), c], 2);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<path").count(), 4);
        assert!(svg.contains("ITL &lt;by batch&gt;"));
        assert!(svg.contains("stroke-dasharray"));
        assert!(!svg.contains("NaN"));
        let sizes = Chart {
            x_log2: true,
            x_bytes: true,
            series: vec![Series::line("shm", vec![(4096.0, 1.0), (67108864.0, 9.0), (0.0, 3.0)])],
            ..Chart::default()
        };
        let svg = render(&[sizes], 1);
        assert!(svg.contains(">4K<") && svg.contains(">64M<"), "{svg}");
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
    }
}
