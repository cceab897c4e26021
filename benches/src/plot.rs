//! Line charts as SVG for every `--plot` (`kvfabric bench transfer|tier|router|serve`,
//! `kvfabric profile`), drawn with `plotters` (its SVG backend alone, no font or bitmap
//! backend): panels of series over linear or log2 axes with round tick values, a legend, no
//! scripts and no external resources (the file opens in any browser).

use plotters::coord::Shift;
use plotters::prelude::*;

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
    /// Drawn in the colour of the chart's series at this index (a limit beside what it
    /// bounds) instead of a colour of its own.
    pub color_of: Option<usize>,
}

impl Series {
    /// A solid line through `points`.
    pub fn line(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Series { name: name.into(), points, steps: false, dashed: false, color_of: None }
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

const PALETTE: [RGBColor; 8] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x17, 0xbe, 0xcf),
];
/// One panel's size, pixels.
const W: u32 = 540;
const H: u32 = 340;

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

/// `2^k` bytes as 512, 4K, 1M, 2G.
fn size_label(k: i32) -> String {
    match k {
        ..=9 => format!("{}", 1u64 << k.max(0)),
        10..=19 => format!("{}K", 1u64 << (k - 10)),
        20..=29 => format!("{}M", 1u64 << (k - 20)),
        _ => format!("{}G", 1u64 << (k - 30).min(40)),
    }
}

/// The points to draw of `s`: finite, at positive x on a log2 axis (as log2 x), and as steps
/// when it is drawn as steps.
fn drawn(s: &Series, x_log2: bool) -> Vec<(f64, f64)> {
    let pts: Vec<(f64, f64)> = s
        .points
        .iter()
        .filter(|(x, y)| x.is_finite() && y.is_finite() && (!x_log2 || *x > 0.0))
        .map(|&(x, y)| if x_log2 { (x.log2(), y) } else { (x, y) })
        .collect();
    if !s.steps {
        return pts;
    }
    let mut out = Vec::with_capacity(pts.len() * 2);
    for (i, &(x, y)) in pts.iter().enumerate() {
        if i > 0 {
            out.push((x, pts[i - 1].1));
        }
        out.push((x, y));
    }
    out
}

type PanelResult<DB> = Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

fn panel<DB: DrawingBackend>(c: &Chart, area: &DrawingArea<DB, Shift>) -> PanelResult<DB> {
    let lines: Vec<Vec<(f64, f64)>> = c.series.iter().map(|s| drawn(s, c.x_log2)).collect();
    let all = lines.iter().flatten();
    let (mut x0, mut x1) =
        all.clone().fold((f64::MAX, f64::MIN), |a, p| (a.0.min(p.0), a.1.max(p.0)));
    let mut y1 = all.clone().fold(f64::MIN, |a, p| a.max(p.1));
    let mut y0 = all.clone().fold(f64::MAX, |a, p| a.min(p.1)).min(0.0);
    // Nothing to draw, or extremes whose span overflows: a unit panel.
    if lines.iter().all(Vec::is_empty) || !(x1 - x0).is_finite() || !(y1 - y0).is_finite() {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if y1 <= y0 {
        y1 = y0 + 1.0;
    }
    y1 += (y1 - y0) * 0.05;
    // plotters picks round key points; on a log2 axis, at most one per power of two.
    let x_labels = if c.x_log2 { ((x1.floor() - x0.ceil()) as usize + 1).clamp(2, 9) } else { 7 };
    let mut chart = ChartBuilder::on(area)
        .caption(&c.title, ("sans-serif", 19))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(58)
        .build_cartesian_2d(x0..x1, y0..y1)?;
    let x_text = |x: &f64| match (c.x_log2, c.x_bytes) {
        (true, _) if (x - x.round()).abs() > 1e-6 => String::new(),
        (true, true) => size_label(x.round() as i32),
        (true, false) => label(2f64.powi(x.round() as i32)),
        _ => label(*x),
    };
    chart
        .configure_mesh()
        .x_labels(x_labels)
        .y_labels(6)
        .x_desc(c.x_label.as_str())
        .y_desc(c.y_label.as_str())
        .x_label_formatter(&x_text)
        .y_label_formatter(&|y| label(*y))
        .bold_line_style(RGBColor(0xe0, 0xe0, 0xe0))
        .light_line_style(RGBColor(0xf6, 0xf6, 0xf6))
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 15))
        .draw()?;
    // Each series takes the palette's next colour, unless it is drawn in the colour of an
    // earlier series that has one of its own.
    let mut colors: Vec<RGBColor> = Vec::with_capacity(c.series.len());
    let mut next = 0;
    for (i, s) in c.series.iter().enumerate() {
        match s.color_of.filter(|&k| k < i && c.series[k].color_of.is_none()) {
            Some(k) => colors.push(colors[k]),
            None => {
                colors.push(PALETTE[next % PALETTE.len()]);
                next += 1;
            }
        }
    }
    for (i, (s, pts)) in c.series.iter().zip(&lines).enumerate() {
        let color = colors[i];
        let style = color.stroke_width(2);
        let drawn = if s.dashed {
            chart.draw_series(DashedLineSeries::new(pts.iter().copied(), 6, 4, style))?
        } else {
            chart.draw_series(LineSeries::new(pts.iter().copied(), style))?
        };
        drawn.label(s.name.as_str()).legend(move |(x, y)| {
            PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
        });
        if !s.steps && !s.dashed && pts.len() <= 40 {
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
        }
    }
    if !c.series.is_empty() {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(0xbb, 0xbb, 0xbb))
            .label_font(("sans-serif", 14))
            .draw()?;
    }
    Ok(())
}

/// Panels in a grid of `columns`, as one SVG document.
pub fn render(charts: &[Chart], columns: usize) -> String {
    let columns = columns.clamp(1, charts.len().max(1));
    let rows = charts.len().div_ceil(columns).max(1);
    let mut out = String::new();
    {
        let size = (W * columns as u32, H * rows as u32);
        let root = SVGBackend::with_string(&mut out, size).into_drawing_area();
        // Drawing into a string fails only on a bug of ours (a range plotters refuses): the
        // panel says so in its place rather than failing the benchmark that asked for it.
        let _ = root.fill(&WHITE);
        for (c, area) in charts.iter().zip(root.split_evenly((rows, columns))) {
            if let Err(e) = panel(c, &area) {
                let _ = area.draw_text(
                    &format!("{}: cannot be drawn ({e})", c.title),
                    &("sans-serif", 12).into_text_style(&area),
                    (10, 20),
                );
            }
        }
        let _ = root.present();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The text of every `<text>` element.
    fn texts(svg: &str) -> Vec<String> {
        svg.split("</text>")
            .filter_map(|t| t.rsplit_once('>').map(|(_, x)| x.trim().to_string()))
            .collect()
    }

    #[test]
    fn labels() {
        assert_eq!(label(2500.0), "2500");
        assert_eq!(label(0.25), "0.25");
        assert_eq!(label(3.0), "3");
        assert_eq!(
            (size_label(12), size_label(20), size_label(9)),
            ("4K".into(), "1M".into(), "512".into())
        );
    }

    #[test]
    fn steps_hold_their_value_until_the_next_point() {
        let s = Series { steps: true, ..Series::line("w", vec![(0.0, 1.0), (5.0, 2.0)]) };
        assert_eq!(drawn(&s, false), vec![(0.0, 1.0), (5.0, 1.0), (5.0, 2.0)]);
        let s = Series::line("sizes", vec![(4096.0, 1.0), (0.0, 3.0), (f64::NAN, 1.0)]);
        assert_eq!(drawn(&s, true), vec![(12.0, 1.0)]);
    }

    /// A limit drawn in its measurement's colour takes no colour of the palette: the next
    /// measurement gets the palette's second, and the third is never used.
    #[test]
    fn a_limit_in_its_measurements_colour_leaves_the_palette_to_the_others() {
        let hex = |c: RGBColor| format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2);
        let c = Chart {
            series: vec![
                Series::line("a", vec![(1.0, 1.0), (2.0, 2.0)]),
                Series {
                    dashed: true,
                    color_of: Some(0),
                    ..Series::line("a limit", vec![(1.0, 3.0), (2.0, 3.0)])
                },
                Series::line("b", vec![(1.0, 2.0), (2.0, 1.0)]),
            ],
            ..Chart::default()
        };
        let svg = render(&[c], 1).to_uppercase();
        assert!(svg.contains(&hex(PALETTE[0])) && svg.contains(&hex(PALETTE[1])), "{svg}");
        assert!(!svg.contains(&hex(PALETTE[2])), "the limit took a colour: {svg}");
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
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{svg}");
        let t = texts(&svg);
        let count = |s: &str| t.iter().filter(|x| *x == s).count();
        assert_eq!(count("ITL &lt;by batch&gt;"), 2, "{t:?}");
        assert_eq!((count("ctx 256"), count("limit")), (2, 2), "legends: {t:?}");
        assert_eq!((count("batch"), count("ms")), (2, 2), "axis descriptions: {t:?}");
        assert!(svg.contains("<circle"), "points: {svg}");
        assert!(!svg.contains("NaN") && !svg.contains("cannot be drawn"), "{svg}");
        let sizes = Chart {
            x_log2: true,
            x_bytes: true,
            series: vec![Series::line("shm", vec![(4096.0, 1.0), (67108864.0, 9.0), (0.0, 3.0)])],
            ..Chart::default()
        };
        let svg = render(&[sizes], 1);
        let t = texts(&svg);
        assert!(t.contains(&"4K".to_string()) && t.contains(&"64M".to_string()), "{t:?}");
        assert!(t.iter().all(|x| !x.contains('.')), "whole powers of two only: {t:?}");
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
        // Nothing to draw is an empty panel, not an error.
        let svg = render(&[Chart { title: "empty".into(), ..Chart::default() }], 1);
        assert!(texts(&svg).contains(&"empty".to_string()), "{svg}");
        assert!(!svg.contains("cannot be drawn"), "{svg}");
    }
}
