//! A migration's timeline: phases as shaded spans, bytes moved, the writer's gaps.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::latency::legend;
use crate::output::{
    check_finite, render, short_number, title_font, DrawResult, Picture, LABEL_SIZE, TICK_SIZE,
};
use crate::PlotError;

/// One phase of a migration (e.g. `pre-copy`, `hand-over/downtime`, `post-copy`).
#[derive(Debug, Clone, PartialEq)]
pub struct Phase {
    /// Its name, in the legend and, when the span is wide enough, inside it.
    pub name: String,
    /// Start, ms from the beginning of the run.
    pub start_ms: f64,
    /// End, ms from the beginning of the run; at least `start_ms`.
    pub end_ms: f64,
}

/// A span in which the application's writer made no progress.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WriteGap {
    /// Start, ms from the beginning of the run.
    pub start_ms: f64,
    /// Length, ms.
    pub length_ms: f64,
}

/// What one migration did over time.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timeline {
    /// Phases, in any order; they may touch but are drawn as given.
    pub phases: Vec<Phase>,
    /// `(t_ms, bytes moved so far)`, drawn in the order of `t_ms` as MB (10^6 bytes).
    pub bytes_moved: Vec<(f64, u64)>,
    /// The writer's pauses (the caller decides which pauses count as gaps).
    pub write_gaps: Vec<WriteGap>,
}

/// Draws `timeline` into `path` (`.svg` or `.png`): time in ms on x, the phases as shaded
/// spans, the bytes moved as a line (MB); under it, the writer's lane with each write gap as
/// a red bar (at least about 2 px wide) and the longest labelled with its length.
///
/// A timeline with no phase, no byte count and no gap is [`PlotError::Empty`]; a phase that
/// ends before it starts, or a negative gap, is [`PlotError::Invalid`].
pub fn migration_timeline(
    path: impl AsRef<Path>,
    title: &str,
    timeline: &Timeline,
) -> Result<(), PlotError> {
    let path = path.as_ref();
    let t = timeline;
    let mut values: Vec<f64> = t
        .phases
        .iter()
        .flat_map(|p| [p.start_ms, p.end_ms])
        .collect();
    values.extend(t.bytes_moved.iter().map(|b| b.0));
    values.extend(t.write_gaps.iter().flat_map(|g| [g.start_ms, g.length_ms]));
    check_finite(path, "the timeline", &values)?;
    let invalid = |what: String| PlotError::Invalid {
        path: path.to_path_buf(),
        what,
    };
    if let Some(p) = t.phases.iter().find(|p| p.end_ms < p.start_ms) {
        return Err(invalid(format!(
            "phase {} ends ({} ms) before it starts ({} ms)",
            p.name, p.end_ms, p.start_ms
        )));
    }
    if let Some(g) = t.write_gaps.iter().find(|g| g.length_ms < 0.0) {
        return Err(invalid(format!(
            "the write gap at {} ms has a negative length",
            g.start_ms
        )));
    }
    if values.is_empty() {
        return Err(PlotError::Empty {
            path: path.to_path_buf(),
            what: "the timeline has no phase, no bytes moved and no write gap".into(),
        });
    }
    render(path, &TimelinePicture { title, t })
}

/// Pastel fills for the phases, in order.
fn phase_color(i: usize) -> RGBColor {
    const COLORS: [RGBColor; 5] = [
        RGBColor(198, 219, 239),
        RGBColor(253, 208, 162),
        RGBColor(199, 233, 192),
        RGBColor(218, 218, 235),
        RGBColor(246, 232, 195),
    ];
    COLORS[i % COLORS.len()]
}

const GAP_COLOR: RGBColor = RGBColor(215, 25, 28);
const LINE_COLOR: RGBColor = RGBColor(0, 0, 0);

struct TimelinePicture<'a> {
    title: &'a str,
    t: &'a Timeline,
}

/// Height of the writer's lane under the main chart, pixels (its tick labels included).
const LANE_PX: u32 = 120;

impl Picture for TimelinePicture<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let t = self.t;
        let mut times: Vec<f64> = t
            .phases
            .iter()
            .flat_map(|p| [p.start_ms, p.end_ms])
            .collect();
        times.extend(t.bytes_moved.iter().map(|b| b.0));
        times.extend(
            t.write_gaps
                .iter()
                .flat_map(|g| [g.start_ms, g.start_ms + g.length_ms]),
        );
        let x_lo = times.iter().copied().fold(f64::INFINITY, f64::min).min(0.0);
        let mut x_hi = times.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if x_hi <= x_lo {
            x_hi = x_lo + 1.0;
        }
        let area = root.titled(self.title, title_font())?;
        let height = area.dim_in_pixel().1;
        let (top, lane) = area.split_vertically(height.saturating_sub(LANE_PX));
        self.draw_progress(&top, x_lo..x_hi)?;
        self.draw_lane(&lane, x_lo..x_hi)?;
        Ok(())
    }
}

impl TimelinePicture<'_> {
    /// The phases and the bytes moved; the x axis's numbers are the lane's.
    fn draw_progress<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
        x: std::ops::Range<f64>,
    ) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let t = self.t;
        let span = x.end - x.start;
        let mb_max = t.bytes_moved.iter().map(|b| b.1).max().unwrap_or(0) as f64 / 1e6;
        // Head room above the line for the phase names.
        let y_hi = if mb_max > 0.0 { mb_max * 1.2 } else { 1.0 };
        let mut chart = ChartBuilder::on(area)
            .margin(20)
            .margin_bottom(0)
            .margin_right(45)
            .x_label_area_size(0)
            .y_label_area_size(90)
            .build_cartesian_2d(x.clone(), 0.0..y_hi)?;
        chart
            .configure_mesh()
            .y_desc("moved (MB, 10^6 bytes)")
            .axis_desc_style(("sans-serif", LABEL_SIZE))
            .label_style(("sans-serif", TICK_SIZE))
            .y_label_formatter(&|v| short_number(*v))
            .light_line_style(BLACK.mix(0.05))
            .draw()?;
        let plot_px = f64::from(chart.plotting_area().dim_in_pixel().0);
        for (i, p) in t.phases.iter().enumerate() {
            let color = phase_color(i);
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(p.start_ms, 0.0), (p.end_ms, y_hi)],
                    color.filled(),
                )))?
                .label(format!(
                    "{} ({} ms)",
                    p.name,
                    short_number(p.end_ms - p.start_ms)
                ))
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 7), (x + 20, y + 7)], color.filled())
                });
            // The name inside the span, when it fits (about 10 px a character at this size).
            let width_px = (p.end_ms - p.start_ms) / span * plot_px;
            if width_px > p.name.chars().count() as f64 * 10.0 + 10.0 {
                chart.draw_series(std::iter::once(Text::new(
                    p.name.clone(),
                    (p.start_ms + span * 0.005, y_hi * 0.985),
                    ("sans-serif", LABEL_SIZE)
                        .into_font()
                        .color(&BLACK.mix(0.7))
                        .pos(Pos::new(HPos::Left, VPos::Top)),
                )))?;
            }
        }
        if !t.bytes_moved.is_empty() {
            let mut points: Vec<(f64, f64)> = t
                .bytes_moved
                .iter()
                .map(|&(ms, bytes)| (ms, bytes as f64 / 1e6))
                .collect();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            chart
                .draw_series(LineSeries::new(points, LINE_COLOR.stroke_width(2)))?
                .label("bytes moved")
                .legend(|(x, y)| {
                    PathElement::new([(x, y), (x + 20, y)], LINE_COLOR.stroke_width(3))
                });
        }
        // Bytes moved only grow: the lower right is under the line's end, empty.
        if !t.phases.is_empty() || !t.bytes_moved.is_empty() {
            legend(&mut chart, SeriesLabelPosition::LowerRight)?;
        }
        Ok(())
    }

    /// The writer's lane: one red bar per write gap, the longest labelled.
    fn draw_lane<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
        x: std::ops::Range<f64>,
    ) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        let t = self.t;
        let span = x.end - x.start;
        let mut chart = ChartBuilder::on(area)
            .margin(20)
            .margin_top(4)
            .margin_right(45)
            .x_label_area_size(50)
            .y_label_area_size(90)
            .build_cartesian_2d(x.clone(), 0.0..1.0)?;
        chart
            .configure_mesh()
            .x_desc("time (ms)")
            .y_desc("writer")
            .y_labels(0)
            .axis_desc_style(("sans-serif", LABEL_SIZE))
            .label_style(("sans-serif", TICK_SIZE))
            .x_label_formatter(&|v| short_number(*v))
            .light_line_style(BLACK.mix(0.05))
            .draw()?;
        for (i, p) in t.phases.iter().enumerate() {
            chart.draw_series(std::iter::once(Rectangle::new(
                [(p.start_ms, 0.0), (p.end_ms, 1.0)],
                phase_color(i).mix(0.5).filled(),
            )))?;
        }
        let Some(longest) = t
            .write_gaps
            .iter()
            .copied()
            .max_by(|a, b| a.length_ms.total_cmp(&b.length_ms))
        else {
            chart.draw_series(std::iter::once(Text::new(
                "no write gap",
                (x.start + span * 0.01, 0.5),
                ("sans-serif", LABEL_SIZE)
                    .into_font()
                    .color(&BLACK)
                    .pos(Pos::new(HPos::Left, VPos::Center)),
            )))?;
            return Ok(());
        };
        // At least about 2 px wide, or a 1 ms gap in a 10 s run would not show.
        let min_width = span / 400.0;
        chart.draw_series(t.write_gaps.iter().map(|g| {
            Rectangle::new(
                [
                    (g.start_ms, 0.0),
                    (g.start_ms + g.length_ms.max(min_width), 1.0),
                ],
                GAP_COLOR.filled(),
            )
        }))?;
        // The longest's label beside its bar, towards the middle of the picture.
        let right_half = longest.start_ms > x.start + span / 2.0;
        let (anchor, at) = if right_half {
            (HPos::Right, longest.start_ms - span * 0.005)
        } else {
            (
                HPos::Left,
                longest.start_ms + longest.length_ms.max(min_width) + span * 0.005,
            )
        };
        let label = format!(
            "longest write gap {} ms ({} {})",
            short_number(longest.length_ms),
            t.write_gaps.len(),
            if t.write_gaps.len() == 1 {
                "gap"
            } else {
                "gaps"
            }
        );
        chart.draw_series(std::iter::once(Text::new(
            label,
            (at, 0.5),
            ("sans-serif", LABEL_SIZE)
                .into_font()
                .color(&GAP_COLOR)
                .pos(Pos::new(anchor, VPos::Center)),
        )))?;
        Ok(())
    }
}
