//! Latency distributions: tail curves (1 − CDF) and log-bucketed histograms.
//!
//! The CDF is drawn as its tail, the fraction of accesses slower than x, on a log y axis:
//! p50, p99 and p99.9 then sit at 0.5, 0.01 and 0.001, a decade apart, so two systems' tails
//! are compared by eye. On a linear 0–1 CDF those three levels are squeezed into the top 1%
//! of the picture, and the tail, which is what a paging benchmark is about, is invisible.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::output::{
    check_finite, render, series_color, short_number, title_font, DrawResult, Picture, LABEL_SIZE,
    TICK_SIZE,
};
use crate::PlotError;

/// Latencies of one system, in microseconds.
#[derive(Debug, Clone, PartialEq)]
pub enum Latencies {
    /// Individual samples, µs, in any order. Values ≤ 0 are drawn at the smallest positive
    /// value shown (a log axis has no zero).
    Samples(Vec<f64>),
    /// A histogram: `(upper bound µs, count)` per bucket, bounds ascending; a bucket holds
    /// the values above the previous bound and up to its own.
    Buckets(Vec<(f64, u64)>),
    /// Precomputed percentiles: `(quantile in 0..1, µs)`, e.g. `(0.99, 80.0)`. Drawn as a
    /// tail curve through those points; a histogram cannot be made from them.
    Percentiles(Vec<(f64, f64)>),
}

/// One line of a latency picture: a name for the legend and its latencies.
#[derive(Debug, Clone, PartialEq)]
pub struct LatencySeries {
    /// The legend's name (e.g. `farmap` or `kernel-swap`).
    pub name: String,
    /// The latencies.
    pub latencies: Latencies,
}

impl LatencySeries {
    /// A series of raw samples in µs.
    pub fn samples(name: impl Into<String>, samples_us: Vec<f64>) -> Self {
        Self {
            name: name.into(),
            latencies: Latencies::Samples(samples_us),
        }
    }
}

/// The levels marked on a tail picture: (label, quantile).
const LEVELS: [(&str, f64); 3] = [("p50", 0.5), ("p99", 0.99), ("p99.9", 0.999)];

/// The smallest latency a log axis shows, µs, when a series has no positive value.
const FLOOR_US: f64 = 0.01;

/// Draws `series` as tail curves into `path` (`.svg` or `.png`): x the latency in µs on a
/// log axis, y the fraction of accesses slower (1 − CDF) on a log axis, with p50, p99 and
/// p99.9 marked and each series' values of them in the legend.
///
/// An empty series is listed in the legend as having no data; no data at all is
/// [`PlotError::Empty`].
pub fn latency_cdf(
    path: impl AsRef<Path>,
    title: &str,
    series: &[LatencySeries],
) -> Result<(), PlotError> {
    let path = path.as_ref();
    let tails = series
        .iter()
        .map(|s| tail(path, s))
        .collect::<Result<Vec<_>, _>>()?;
    if tails.iter().all(|t| t.points.is_empty()) {
        return Err(empty(path, series));
    }
    render(path, &TailPicture { title, tails })
}

/// Draws `series` as histograms into `path` (`.svg` or `.png`): counts in log-spaced
/// buckets (ten per decade of µs) on a log count axis, one outlined, lightly filled step
/// curve per series.
///
/// [`Latencies::Percentiles`] carry no counts and are refused ([`PlotError::Invalid`]); an
/// empty series is listed in the legend as having no data; no data at all is
/// [`PlotError::Empty`].
pub fn latency_histogram(
    path: impl AsRef<Path>,
    title: &str,
    series: &[LatencySeries],
) -> Result<(), PlotError> {
    let path = path.as_ref();
    let mut weighted = Vec::with_capacity(series.len());
    for s in series {
        let values: Vec<(f64, u64)> = match &s.latencies {
            Latencies::Samples(v) => {
                check_finite(path, &s.name, v)?;
                v.iter().map(|&x| (x, 1)).collect()
            }
            Latencies::Buckets(b) => {
                check_buckets(path, &s.name, b)?;
                // Each bucket's count goes to the geometric middle of its span.
                let mut lower = None;
                b.iter()
                    .map(|&(upper, count)| {
                        let at = match lower.replace(upper) {
                            Some(l) if l > 0.0 && upper > 0.0 => (l * upper).sqrt(),
                            _ => upper,
                        };
                        (at, count)
                    })
                    .filter(|&(_, c)| c > 0)
                    .collect()
            }
            Latencies::Percentiles(_) => {
                return Err(PlotError::Invalid {
                    path: path.to_path_buf(),
                    what: format!("{} has percentiles, not counts: no histogram", s.name),
                })
            }
        };
        weighted.push(values);
    }
    if weighted.iter().all(|w| w.is_empty()) {
        return Err(empty(path, series));
    }
    let floor = floor_of(weighted.iter().flatten().map(|&(x, _)| x));
    let max = weighted
        .iter()
        .flatten()
        .map(|&(x, _)| x)
        .fold(floor, f64::max);
    let lo_edge = (floor.log10() * PER_DECADE).floor() as i32;
    let hi_edge = (max.log10() * PER_DECADE).floor() as i32 + 1;
    let edges: Vec<f64> = (lo_edge..=hi_edge)
        .map(|k| 10f64.powf(f64::from(k) / PER_DECADE))
        .collect();
    let counts = weighted
        .iter()
        .map(|values| {
            let mut counts = vec![0u64; edges.len() - 1];
            for &(x, c) in values {
                let x = x.max(floor);
                let k = ((x.log10() * PER_DECADE).floor() as i32 - lo_edge)
                    .clamp(0, counts.len() as i32 - 1);
                counts[k as usize] += c;
            }
            counts
        })
        .collect();
    let names = series.iter().map(|s| s.name.clone()).collect();
    render(
        path,
        &HistogramPicture {
            title,
            names,
            edges,
            counts,
        },
    )
}

/// Histogram buckets per decade of µs.
const PER_DECADE: f64 = 10.0;

fn empty(path: &Path, series: &[LatencySeries]) -> PlotError {
    PlotError::Empty {
        path: path.to_path_buf(),
        what: if series.is_empty() {
            "no series".into()
        } else {
            "every series has no latencies".into()
        },
    }
}

fn check_buckets(path: &Path, name: &str, buckets: &[(f64, u64)]) -> Result<(), PlotError> {
    let bounds: Vec<f64> = buckets.iter().map(|b| b.0).collect();
    check_finite(path, name, &bounds)?;
    if bounds.windows(2).any(|w| w[0] >= w[1]) {
        return Err(PlotError::Invalid {
            path: path.to_path_buf(),
            what: format!("{name}'s bucket bounds are not ascending"),
        });
    }
    Ok(())
}

/// The smallest positive value (the log axes' floor), or `FLOOR_US` if none.
fn floor_of(values: impl Iterator<Item = f64>) -> f64 {
    let min = values.filter(|&x| x > 0.0).fold(f64::INFINITY, f64::min);
    if min.is_finite() {
        min
    } else {
        FLOOR_US
    }
}

/// A series as points `(µs, fraction of values ≥ µs)`, fractions descending and > 0.
#[derive(Debug)]
struct Tail {
    name: String,
    points: Vec<(f64, f64)>,
    /// Samples and buckets are steps; percentiles are joined by straight lines.
    stepped: bool,
    /// The series' p50, p99, p99.9 (µs), where known.
    levels: [Option<f64>; 3],
}

/// Samples kept in full at the end of a tail; the rest are thinned to about this many.
const TAIL_POINTS: usize = 2000;

fn tail(path: &Path, series: &LatencySeries) -> Result<Tail, PlotError> {
    let name = series.name.clone();
    let points = match &series.latencies {
        Latencies::Samples(v) => {
            check_finite(path, &name, v)?;
            let mut sorted = v.clone();
            sorted.sort_by(f64::total_cmp);
            let n = sorted.len();
            let step = (n / TAIL_POINTS).max(1);
            (0..n)
                .filter(|&i| i % step == 0 || i + TAIL_POINTS >= n)
                .map(|i| (sorted[i], (n - i) as f64 / n as f64))
                .collect()
        }
        Latencies::Buckets(b) => {
            check_buckets(path, &name, b)?;
            let total: u64 = b.iter().map(|&(_, c)| c).sum();
            let mut at_least = total;
            let mut points = Vec::new();
            for &(upper, count) in b {
                if count > 0 {
                    points.push((upper, at_least as f64 / total as f64));
                }
                at_least -= count;
            }
            points
        }
        Latencies::Percentiles(p) => {
            let qs: Vec<f64> = p.iter().map(|&(q, _)| q).collect();
            let us: Vec<f64> = p.iter().map(|&(_, u)| u).collect();
            check_finite(path, &name, &qs)?;
            check_finite(path, &name, &us)?;
            let mut points: Vec<(f64, f64)> = p
                .iter()
                .filter(|&&(q, _)| (0.0..1.0).contains(&q))
                .map(|&(q, u)| (u, 1.0 - q))
                .collect();
            points.sort_by(|a, b| b.1.total_cmp(&a.1));
            points
        }
    };
    let levels = LEVELS.map(|(_, q)| level(&points, q));
    Ok(Tail {
        name,
        stepped: !matches!(series.latencies, Latencies::Percentiles(_)),
        points,
        levels,
    })
}

/// The latency at quantile `q`: the first point whose fraction slower is at most 1 − q
/// (with a little slack for rounding); `None` if the data does not reach that far.
fn level(points: &[(f64, f64)], q: f64) -> Option<f64> {
    let target = (1.0 - q) * (1.0 + 1e-9);
    points.iter().find(|p| p.1 <= target).map(|p| p.0)
}

fn legend_name(t: &Tail) -> String {
    if t.points.is_empty() {
        return format!("{} (no data)", t.name);
    }
    let parts: Vec<String> = LEVELS
        .iter()
        .zip(t.levels)
        .filter_map(|((label, _), v)| v.map(|v| format!("{label} {}", short_number(round3(v)))))
        .collect();
    if parts.is_empty() {
        t.name.clone()
    } else {
        format!("{}: {} µs", t.name, parts.join(", "))
    }
}

/// Three significant digits.
fn round3(v: f64) -> f64 {
    if v == 0.0 {
        return 0.0;
    }
    let scale = 10f64.powi(2 - v.abs().log10().floor() as i32);
    (v * scale).round() / scale
}

struct TailPicture<'a> {
    title: &'a str,
    tails: Vec<Tail>,
}

impl Picture for TailPicture<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let all = || self.tails.iter().flat_map(|t| t.points.iter());
        let x_lo = floor_of(all().map(|p| p.0));
        let x_hi = all().map(|p| p.0).fold(x_lo, f64::max);
        let (x_lo, x_hi) = decades(x_lo, x_hi);
        // One empty decade under the deepest point (and at least down to 0.0001): room for
        // the legend, and p99.9 is never on the edge.
        let y_lo = all().map(|p| p.1).fold(1.0, f64::min);
        let y_lo = 10f64.powf(y_lo.log10().floor() - 1.0).min(1e-4);
        let mut chart = ChartBuilder::on(root)
            .caption(self.title, title_font())
            .margin(20)
            .margin_right(45)
            .x_label_area_size(50)
            .y_label_area_size(80)
            .build_cartesian_2d((x_lo..x_hi).log_scale(), (y_lo..1.0).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("latency (µs, log scale)")
            .y_desc("fraction slower (1 − CDF, log scale)")
            .axis_desc_style(("sans-serif", LABEL_SIZE))
            .label_style(("sans-serif", TICK_SIZE))
            .x_label_formatter(&|v| short_number(*v))
            .y_label_formatter(&|v| short_number(*v))
            .light_line_style(BLACK.mix(0.05))
            .draw()?;
        for (label, q) in LEVELS {
            let y = 1.0 - q;
            if y < y_lo {
                continue;
            }
            chart.draw_series(LineSeries::new(
                [(x_lo, y), (x_hi, y)],
                BLACK.mix(0.35).stroke_width(1),
            ))?;
            chart.draw_series(std::iter::once(Text::new(
                label,
                (x_lo * 1.05, y * 1.02),
                ("sans-serif", TICK_SIZE)
                    .into_font()
                    .color(&BLACK.mix(0.6))
                    .pos(Pos::new(HPos::Left, VPos::Bottom)),
            )))?;
        }
        for (i, t) in self.tails.iter().enumerate() {
            let color = series_color(i);
            // Steps: the fraction slower drops just after each sample.
            let mut steps = Vec::with_capacity(t.points.len() * 2);
            for w in t.points.windows(2) {
                steps.push(w[0]);
                if t.stepped {
                    steps.push((w[1].0, w[0].1));
                }
            }
            steps.extend(t.points.last());
            let points = steps.into_iter().map(|(x, y)| (x.max(x_lo), y));
            chart
                .draw_series(LineSeries::new(points, color.stroke_width(2)))?
                .label(legend_name(t))
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 20, y)], color.stroke_width(3))
                });
        }
        // A tail curve falls from 1 at small latencies: the lower left is always empty.
        legend(&mut chart, SeriesLabelPosition::LowerLeft)?;
        Ok(())
    }
}

/// Whole decades around `lo..hi` (a log axis reads best from 10^k to 10^m).
fn decades(lo: f64, hi: f64) -> (f64, f64) {
    let lo = 10f64.powf(lo.log10().floor());
    let mut hi = 10f64.powf(hi.log10().ceil());
    if hi <= lo {
        hi = lo * 10.0;
    }
    (lo, hi)
}

/// The legend at `position`, on a translucent white box with a frame.
pub(crate) fn legend<'a, DB: DrawingBackend + 'a, X: Ranged, Y: Ranged>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<X, Y>>,
    position: SeriesLabelPosition,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    chart
        .configure_series_labels()
        .position(position)
        .margin(12)
        .label_font(("sans-serif", LABEL_SIZE))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .draw()?;
    Ok(())
}

struct HistogramPicture<'a> {
    title: &'a str,
    names: Vec<String>,
    edges: Vec<f64>,
    counts: Vec<Vec<u64>>,
}

impl Picture for HistogramPicture<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let x_lo = self.edges[0];
        let x_hi = self.edges[self.edges.len() - 1];
        let y_max = self
            .counts
            .iter()
            .flatten()
            .copied()
            .max()
            .unwrap_or(0)
            .max(1);
        // Counts on a log axis: a slow mode of 0.1% of the accesses is as visible as the
        // fast one. Empty buckets sit on the floor; a decade of head room for the legend.
        let y_lo = 0.5;
        let y_hi = y_max as f64 * 10.0;
        let mut chart = ChartBuilder::on(root)
            .caption(self.title, title_font())
            .margin(20)
            .margin_right(45)
            .x_label_area_size(50)
            .y_label_area_size(90)
            .build_cartesian_2d((x_lo..x_hi).log_scale(), (y_lo..y_hi).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("latency (µs, log scale; 10 buckets per decade)")
            .y_desc("accesses per bucket (log scale)")
            .axis_desc_style(("sans-serif", LABEL_SIZE))
            .label_style(("sans-serif", TICK_SIZE))
            .x_label_formatter(&|v| short_number(*v))
            .y_label_formatter(&|v| short_number(*v))
            .light_line_style(BLACK.mix(0.05))
            .draw()?;
        for (i, (name, counts)) in self.names.iter().zip(&self.counts).enumerate() {
            let color = series_color(i);
            let mut stairs = Vec::with_capacity(counts.len() * 2 + 2);
            let at = |c: u64| (c as f64).max(y_lo);
            stairs.push((x_lo, y_lo));
            for (k, &c) in counts.iter().enumerate() {
                stairs.push((self.edges[k], at(c)));
                stairs.push((self.edges[k + 1], at(c)));
            }
            stairs.push((x_hi, y_lo));
            let total: u64 = counts.iter().sum();
            let label = if total == 0 {
                format!("{name} (no data)")
            } else {
                format!("{name} ({total} accesses)")
            };
            chart
                .draw_series(
                    AreaSeries::new(stairs, y_lo, color.mix(0.15))
                        .border_style(color.stroke_width(2)),
                )?
                .label(label)
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 6), (x + 20, y + 6)], color.mix(0.5).filled())
                });
        }
        legend(&mut chart, SeriesLabelPosition::UpperRight)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_of_samples_starts_at_one_and_ends_at_one_over_n() {
        let s = LatencySeries::samples("a", vec![3.0, 1.0, 2.0, 4.0]);
        let t = tail(Path::new("x.svg"), &s).unwrap();
        assert_eq!(
            t.points,
            vec![(1.0, 1.0), (2.0, 0.75), (3.0, 0.5), (4.0, 0.25)]
        );
        assert_eq!(t.levels[0], Some(3.0));
    }

    #[test]
    fn levels_of_a_long_tail_are_exact() {
        // 1..=1000 µs: p50 = 501 (half are ≥ 501), p99 = 991, p99.9 = 1000.
        let s = LatencySeries::samples("a", (1..=1000).map(f64::from).rev().collect());
        let t = tail(Path::new("x.svg"), &s).unwrap();
        assert_eq!(t.levels, [Some(501.0), Some(991.0), Some(1000.0)]);
    }

    #[test]
    fn too_few_samples_leave_the_far_tail_unknown() {
        let s = LatencySeries::samples("a", (1..=10).map(f64::from).collect());
        let t = tail(Path::new("x.svg"), &s).unwrap();
        assert_eq!(t.levels[0], Some(6.0));
        assert_eq!(t.levels[2], None);
    }

    #[test]
    fn tail_of_buckets_counts_from_the_top() {
        let s = LatencySeries {
            name: "b".into(),
            latencies: Latencies::Buckets(vec![(10.0, 90), (100.0, 0), (1000.0, 10)]),
        };
        let t = tail(Path::new("x.svg"), &s).unwrap();
        assert_eq!(t.points, vec![(10.0, 1.0), (1000.0, 0.1)]);
    }

    #[test]
    fn descending_bucket_bounds_are_refused() {
        let s = LatencySeries {
            name: "b".into(),
            latencies: Latencies::Buckets(vec![(10.0, 1), (5.0, 1)]),
        };
        let err = tail(Path::new("x.svg"), &s).unwrap_err();
        assert!(err.to_string().contains("not ascending"), "{err}");
    }

    #[test]
    fn round3_keeps_three_digits() {
        assert_eq!(round3(12345.0), 12300.0);
        assert_eq!(round3(0.012345), 0.0123);
        assert_eq!(round3(55.55), 55.6);
    }
}
