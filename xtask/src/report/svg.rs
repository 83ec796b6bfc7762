//! A tiny SVG line-plot writer for the report: several named series on shared axes, optional
//! logarithmic x axis, tick labels formatted by the caller, a legend, dashed baselines. No
//! dependencies; the output is a standalone `<svg>` document any browser or Markdown viewer shows.

use std::fmt::Write;

/// One line of a plot.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend text.
    pub name: String,
    /// Points in data coordinates; drawn in x order.
    pub points: Vec<(f64, f64)>,
    /// Drawn dashed (for baselines).
    pub dashed: bool,
}

impl Series {
    /// A solid series.
    pub fn new(name: impl Into<String>, points: Vec<(f64, f64)>) -> Series {
        Series {
            name: name.into(),
            points,
            dashed: false,
        }
    }

    /// A dashed series (a baseline).
    pub fn baseline(name: impl Into<String>, points: Vec<(f64, f64)>) -> Series {
        Series {
            dashed: true,
            ..Series::new(name, points)
        }
    }
}

/// How an axis value is written on a tick.
pub type Format = fn(f64) -> String;

/// A line plot.
#[derive(Debug, Clone)]
pub struct LinePlot {
    /// Title above the plot.
    pub title: String,
    /// X axis label.
    pub x_label: String,
    /// Y axis label.
    pub y_label: String,
    /// Logarithmic (base 2) x axis; non-positive x values are left out.
    pub log_x: bool,
    /// Tick label format for x.
    pub x_fmt: Format,
    /// Tick label format for y.
    pub y_fmt: Format,
    /// The lines.
    pub series: Vec<Series>,
}

const W: f64 = 720.0;
const H: f64 = 420.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 190.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 55.0;
const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// Escapes text for SVG content and attributes.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            c => out.push(c),
        }
    }
    out
}

/// Formats a plain number with up to 3 significant decimals.
pub fn fmt_num(v: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    let a = v.abs();
    if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

/// Formats a byte count as B, KiB, MiB or GiB.
pub fn fmt_bytes(v: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = v;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < units.len() {
        x /= 1024.0;
        u += 1;
    }
    if x.fract() == 0.0 {
        format!("{x:.0} {}", units[u])
    } else {
        format!("{x:.1} {}", units[u])
    }
}

/// Round tick values covering `[lo, hi]`, about `n` of them.
fn nice_ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    let span = (hi - lo).max(f64::MIN_POSITIVE);
    let raw = span / n.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let mut t = (lo / step).ceil() * step;
    let mut out = Vec::new();
    while t <= hi + step * 1e-9 && out.len() < 50 {
        out.push(if t.abs() < step * 1e-9 { 0.0 } else { t });
        t += step;
    }
    out
}

impl LinePlot {
    /// A plot with linear axes and plain number ticks.
    pub fn new(title: &str, x_label: &str, y_label: &str) -> LinePlot {
        LinePlot {
            title: title.into(),
            x_label: x_label.into(),
            y_label: y_label.into(),
            log_x: false,
            x_fmt: fmt_num,
            y_fmt: fmt_num,
            series: Vec::new(),
        }
    }

    fn points(&self, s: &Series) -> Vec<(f64, f64)> {
        let mut p: Vec<(f64, f64)> = s
            .points
            .iter()
            .copied()
            .filter(|(x, y)| x.is_finite() && y.is_finite() && (!self.log_x || *x > 0.0))
            .map(|(x, y)| (if self.log_x { x.log2() } else { x }, y))
            .collect();
        p.sort_by(|a, b| a.0.total_cmp(&b.0));
        p
    }

    /// Renders the plot as an SVG document.
    pub fn render(&self) -> String {
        let all: Vec<Vec<(f64, f64)>> = self.series.iter().map(|s| self.points(s)).collect();
        let pts = all.iter().flatten();
        let (mut x0, mut x1, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, 0.0f64);
        let mut y0 = 0.0f64;
        for (x, y) in pts {
            x0 = x0.min(*x);
            x1 = x1.max(*x);
            y0 = y0.min(*y);
            y1 = y1.max(*y);
        }
        if !x0.is_finite() {
            (x0, x1) = (0.0, 1.0);
        }
        if x1 <= x0 {
            x1 = x0 + 1.0;
        }
        if y1 <= y0 {
            y1 = y0 + 1.0;
        }
        y1 *= 1.05;
        let pw = W - LEFT - RIGHT;
        let ph = H - TOP - BOTTOM;
        let sx = |x: f64| LEFT + (x - x0) / (x1 - x0) * pw;
        let sy = |y: f64| TOP + ph - (y - y0) / (y1 - y0) * ph;

        let mut o = String::new();
        let _ = writeln!(
            o,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(o, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
        let _ = writeln!(
            o,
            r#"<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
            LEFT + pw / 2.0,
            escape(&self.title)
        );
        // Grid and ticks.
        for t in nice_ticks(y0, y1, 6) {
            let y = sy(t);
            let _ = writeln!(
                o,
                r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
                LEFT + pw,
                LEFT - 6.0,
                y + 4.0,
                escape(&(self.y_fmt)(t))
            );
        }
        let xticks: Vec<f64> = if self.log_x {
            let (a, b) = (x0.floor() as i64, x1.ceil() as i64);
            let stride = ((b - a) / 8).max(1);
            (a..=b)
                .step_by(stride as usize)
                .map(|e| e as f64)
                .filter(|e| *e >= x0 - 1e-9 && *e <= x1 + 1e-9)
                .collect()
        } else {
            nice_ticks(x0, x1, 7)
        };
        for t in xticks {
            let x = sx(t);
            let label = (self.x_fmt)(if self.log_x { t.exp2() } else { t });
            let _ = writeln!(
                o,
                r##"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}" stroke="#eee"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
                TOP + ph,
                TOP + ph + 18.0,
                escape(&label)
            );
        }
        let _ = writeln!(
            o,
            r#"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#
        );
        let _ = writeln!(
            o,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            LEFT + pw / 2.0,
            H - 12.0,
            escape(&self.x_label)
        );
        let _ = writeln!(
            o,
            r#"<text transform="translate(16,{:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
            TOP + ph / 2.0,
            escape(&self.y_label)
        );
        // Lines and legend.
        for (i, (s, p)) in self.series.iter().zip(&all).enumerate() {
            let color = COLORS[i % COLORS.len()];
            let dash = if s.dashed {
                r#" stroke-dasharray="6,4""#
            } else {
                ""
            };
            if !p.is_empty() {
                let coords: Vec<String> = p
                    .iter()
                    .map(|(x, y)| format!("{:.1},{:.1}", sx(*x), sy(*y)))
                    .collect();
                let _ = writeln!(
                    o,
                    r#"<polyline fill="none" stroke="{color}" stroke-width="2"{dash} points="{}"/>"#,
                    coords.join(" ")
                );
                for (x, y) in p.iter().filter(|_| p.len() <= 40) {
                    let _ = writeln!(
                        o,
                        r#"<circle cx="{:.1}" cy="{:.1}" r="2.5" fill="{color}"/>"#,
                        sx(*x),
                        sy(*y)
                    );
                }
            }
            let ly = TOP + 10.0 + 20.0 * i as f64;
            let lx = LEFT + pw + 12.0;
            let _ = writeln!(
                o,
                r#"<line x1="{lx}" y1="{ly}" x2="{:.1}" y2="{ly}" stroke="{color}" stroke-width="2"{dash}/><text x="{:.1}" y="{:.1}">{}</text>"#,
                lx + 24.0,
                lx + 30.0,
                ly + 4.0,
                escape(&s.name)
            );
        }
        o.push_str("</svg>\n");
        o
    }
}

/// The empirical CDF of `values` as plot points: (value, fraction of values ≤ it).
pub fn cdf(values: &[f64]) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    v.iter()
        .enumerate()
        .map(|(i, x)| (*x, (i + 1) as f64 / n))
        .collect()
}

/// The `q` quantile (0..=1) of `values` by nearest rank; `None` when empty.
pub fn quantile(values: &[f64], q: f64) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((q.clamp(0.0, 1.0) * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn polyline_points(svg: &str) -> Vec<Vec<(f64, f64)>> {
        svg.lines()
            .filter(|l| l.starts_with("<polyline"))
            .map(|l| {
                let p = l
                    .split("points=\"")
                    .nth(1)
                    .unwrap()
                    .split('"')
                    .next()
                    .unwrap();
                p.split(' ')
                    .map(|xy| {
                        let (x, y) = xy.split_once(',').unwrap();
                        (x.parse().unwrap(), y.parse().unwrap())
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn renders_each_series_inside_the_frame_in_x_order() {
        let mut p = LinePlot::new("bw <tcp> & co", "request size", "GB/s");
        p.log_x = true;
        p.x_fmt = fmt_bytes;
        p.series.push(Series::new(
            "tcp",
            vec![(1048576.0, 3.0), (4096.0, 0.5), (65536.0, 2.0)],
        ));
        p.series.push(Series::baseline(
            "socket loop",
            vec![(4096.0, 0.6), (1048576.0, 3.2)],
        ));
        let svg = p.render();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("bw &lt;tcp&gt; &amp; co"));
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
        assert!(svg.contains("stroke-dasharray"));
        assert!(svg.contains("1 MiB") && svg.contains("4 KiB"));
        let lines = polyline_points(&svg);
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0].len(), 3);
        for line in &lines {
            for w in line.windows(2) {
                assert!(w[0].0 < w[1].0);
            }
            for (x, y) in line {
                assert!(*x >= LEFT && *x <= W - RIGHT, "x {x}");
                assert!(*y >= TOP && *y <= H - BOTTOM, "y {y}");
            }
        }
        // Higher values are drawn higher (smaller SVG y).
        assert!(lines[0][2].1 < lines[0][0].1);
    }

    #[test]
    fn empty_and_degenerate_plots_still_render() {
        let p = LinePlot::new("empty", "x", "y");
        let svg = p.render();
        assert!(svg.contains("</svg>") && !svg.contains("NaN"));
        let mut p = LinePlot::new("one point", "x", "y");
        p.log_x = true;
        p.series.push(Series::new(
            "s",
            vec![(0.0, 1.0), (8.0, f64::NAN), (8.0, 2.0)],
        ));
        let svg = p.render();
        assert!(!svg.contains("NaN"));
        assert_eq!(polyline_points(&svg)[0].len(), 1);
    }

    #[test]
    fn cdf_and_quantiles() {
        let v = [3.0, 1.0, 2.0, 4.0];
        assert_eq!(
            cdf(&v),
            vec![(1.0, 0.25), (2.0, 0.5), (3.0, 0.75), (4.0, 1.0)]
        );
        assert_eq!(quantile(&v, 0.5), Some(2.0));
        assert_eq!(quantile(&v, 0.99), Some(4.0));
        assert_eq!(quantile(&v, 0.0), Some(1.0));
        assert_eq!(quantile(&[], 0.5), None);
    }

    #[test]
    fn byte_and_number_formats() {
        assert_eq!(fmt_bytes(4096.0), "4 KiB");
        assert_eq!(fmt_bytes(1536.0), "1.5 KiB");
        assert_eq!(fmt_bytes(512.0), "512 B");
        assert_eq!(fmt_num(0.0), "0");
        assert_eq!(fmt_num(2.5), "2.50");
        assert_eq!(
            nice_ticks(0.0, 10.0, 5),
            vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
        );
    }
}
