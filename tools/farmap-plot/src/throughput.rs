//! Throughput against round-trip time: one line with markers per system.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::latency::legend;
use crate::output::{
    check_finite, render, series_color, short_number, title_font, DrawResult, Picture, LABEL_SIZE,
    TICK_SIZE,
};
use crate::PlotError;

/// One system's throughput at several round-trip times.
#[derive(Debug, Clone, PartialEq)]
pub struct ThroughputSeries {
    /// The legend's name (e.g. `redis`, `farmap pull, 4 streams`).
    pub name: String,
    /// `(rtt_ms, MB/s)` points, MB being 10^6 bytes; drawn in the order of `rtt_ms`.
    pub points: Vec<(f64, f64)>,
}

/// Draws `series` into `path` (`.svg` or `.png`): x the round-trip time in ms (linear, from
/// 0), y the throughput in MB/s (10^6 bytes a second, from 0), lines with markers.
///
/// An empty series is listed in the legend as having no data; no point at all is
/// [`PlotError::Empty`].
pub fn throughput_vs_rtt(
    path: impl AsRef<Path>,
    title: &str,
    series: &[ThroughputSeries],
) -> Result<(), PlotError> {
    let path = path.as_ref();
    for s in series {
        let values: Vec<f64> = s.points.iter().flat_map(|&(x, y)| [x, y]).collect();
        check_finite(path, &s.name, &values)?;
    }
    if series.iter().all(|s| s.points.is_empty()) {
        return Err(PlotError::Empty {
            path: path.to_path_buf(),
            what: "no throughput point".into(),
        });
    }
    render(path, &ThroughputPicture { title, series })
}

struct ThroughputPicture<'a> {
    title: &'a str,
    series: &'a [ThroughputSeries],
}

impl Picture for ThroughputPicture<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let all = || self.series.iter().flat_map(|s| s.points.iter());
        let x_max = all().map(|p| p.0).fold(0.0, f64::max);
        let y_max = all().map(|p| p.1).fold(0.0, f64::max);
        // A margin right of the last point; head room above the highest for the legend.
        let x_hi = if x_max > 0.0 { x_max * 1.05 } else { 1.0 };
        let y_hi = if y_max > 0.0 { y_max * 1.3 } else { 1.0 };
        let mut chart = ChartBuilder::on(root)
            .caption(self.title, title_font())
            .margin(20)
            .margin_right(45)
            .x_label_area_size(50)
            .y_label_area_size(90)
            .build_cartesian_2d(0.0..x_hi, 0.0..y_hi)?;
        chart
            .configure_mesh()
            .x_desc("round-trip time (ms)")
            .y_desc("throughput (MB/s, MB = 10^6 bytes)")
            .axis_desc_style(("sans-serif", LABEL_SIZE))
            .label_style(("sans-serif", TICK_SIZE))
            .x_label_formatter(&|v| short_number(*v))
            .y_label_formatter(&|v| short_number(*v))
            .light_line_style(BLACK.mix(0.05))
            .draw()?;
        for (i, s) in self.series.iter().enumerate() {
            let color = series_color(i);
            let mut points = s.points.clone();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            chart.draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?;
            let label = if points.is_empty() {
                format!("{} (no data)", s.name)
            } else {
                s.name.clone()
            };
            chart
                .draw_series(
                    points
                        .into_iter()
                        .map(|p| Circle::new(p, 5, color.filled())),
                )?
                .label(label)
                .legend(move |(x, y)| {
                    EmptyElement::at((x, y))
                        + PathElement::new([(0, 0), (20, 0)], color.stroke_width(2))
                        + Circle::new((10, 0), 5, color.filled())
                });
        }
        legend(&mut chart, SeriesLabelPosition::UpperRight)?;
        Ok(())
    }
}
