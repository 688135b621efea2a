//! Pictures of farmap's benchmark results, drawn from plain data (issue 36).
//!
//! Four kinds, one function each; the file's extension picks the format (`.svg` or `.png`,
//! 1000 × 600 px):
//! - [`latency_cdf`]: latency distributions as tail curves (1 − CDF, log axes), with the
//!   p50, p99 and p99.9 levels marked;
//! - [`latency_histogram`]: the same data as counts in log-spaced buckets;
//! - [`throughput_vs_rtt`]: MB/s against the emulated round-trip time;
//! - [`migration_timeline`]: a migration's phases, bytes moved and the application's write
//!   gaps.
//!
//! This crate depends on no other farmap crate: a benchmark converts its results into the
//! types here ([`LatencySeries`], [`ThroughputSeries`], [`Timeline`]).
//!
//! Text is drawn with a TrueType font read from the system at run time (DejaVu Sans from
//! Debian's `fonts-dejavu-core`, or `FARMAP_PLOT_FONT`), even for SVG, whose layout measures
//! its labels; without one every function returns [`PlotError::NoFont`].

#![forbid(unsafe_code)]

mod error;
mod latency;
mod output;
mod throughput;
mod timeline;

pub use error::PlotError;
pub use latency::{latency_cdf, latency_histogram, Latencies, LatencySeries};
pub use output::{Format, HEIGHT, WIDTH};
pub use throughput::{throughput_vs_rtt, ThroughputSeries};
pub use timeline::{migration_timeline, Phase, Timeline, WriteGap};

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn two_systems() -> Vec<LatencySeries> {
        vec![
            LatencySeries::samples(
                "farmap-memory",
                (1..=5000).map(|i| 40.0 + f64::from(i % 97)).collect(),
            ),
            LatencySeries {
                name: "kernel-swap".into(),
                latencies: Latencies::Buckets(vec![
                    (10.0, 100),
                    (100.0, 4000),
                    (1000.0, 30),
                    (10_000.0, 2),
                ]),
            },
        ]
    }

    fn timeline() -> Timeline {
        Timeline {
            phases: vec![
                Phase {
                    name: "pre-copy".into(),
                    start_ms: 0.0,
                    end_ms: 900.0,
                },
                Phase {
                    name: "hand-over/downtime".into(),
                    start_ms: 900.0,
                    end_ms: 930.0,
                },
                Phase {
                    name: "post-copy".into(),
                    start_ms: 930.0,
                    end_ms: 1500.0,
                },
            ],
            bytes_moved: (0..=15u32)
                .map(|i| (f64::from(i) * 100.0, u64::from(i) * 70_000_000))
                .collect(),
            write_gaps: vec![
                WriteGap {
                    start_ms: 300.0,
                    length_ms: 2.0,
                },
                WriteGap {
                    start_ms: 899.0,
                    length_ms: 33.5,
                },
            ],
        }
    }

    fn throughput() -> Vec<ThroughputSeries> {
        vec![
            ThroughputSeries {
                name: "pull-one-stream".into(),
                points: vec![(0.0, 1900.0), (2.0, 230.0), (10.0, 48.0)],
            },
            ThroughputSeries {
                name: "redis-store".into(),
                points: vec![(10.0, 36.0), (0.0, 780.0)],
            },
        ]
    }

    type Draw = fn(&Path) -> Result<(), PlotError>;

    /// Each kind of picture, with the words its SVG must contain.
    fn kinds() -> Vec<(&'static str, Draw, &'static [&'static str])> {
        vec![
            (
                "cdf",
                |p| latency_cdf(p, "tail-title", &two_systems()),
                &[
                    "tail-title",
                    "farmap-memory",
                    "kernel-swap",
                    "latency (µs",
                    "1 − CDF",
                    "p99.9",
                ],
            ),
            (
                "histogram",
                |p| latency_histogram(p, "hist-title", &two_systems()),
                &[
                    "hist-title",
                    "farmap-memory",
                    "kernel-swap",
                    "latency (µs",
                    "accesses per bucket",
                ],
            ),
            (
                "throughput",
                |p| throughput_vs_rtt(p, "rtt-title", &throughput()),
                &[
                    "rtt-title",
                    "pull-one-stream",
                    "redis-store",
                    "round-trip time (ms)",
                    "MB/s",
                ],
            ),
            (
                "timeline",
                |p| migration_timeline(p, "mig-title", &timeline()),
                &[
                    "mig-title",
                    "pre-copy",
                    "hand-over/downtime",
                    "post-copy",
                    "bytes moved",
                    "time (ms)",
                    "MB",
                    "longest write gap 33.5 ms",
                ],
            ),
        ]
    }

    /// Parses `text` as XML to the end; panics on the first error.
    fn assert_xml(text: &str) {
        let mut reader = quick_xml::Reader::from_str(text);
        let mut elements = 0;
        loop {
            match reader.read_event() {
                Ok(quick_xml::events::Event::Eof) => break,
                Ok(quick_xml::events::Event::Start(_) | quick_xml::events::Event::Empty(_)) => {
                    elements += 1
                }
                Ok(_) => {}
                Err(e) => panic!("not XML at {}: {e}", reader.buffer_position()),
            }
        }
        assert!(elements > 20, "only {elements} elements");
    }

    /// Decodes a PNG; returns its size and how many distinct colours it has.
    fn decode_png(path: &Path) -> (u32, u32, usize) {
        let decoder = png::Decoder::new(std::fs::File::open(path).unwrap());
        let mut reader = decoder.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size()];
        let frame = reader.next_frame(&mut buf).unwrap();
        let bytes = &buf[..frame.buffer_size()];
        let channels = frame.color_type.samples();
        let colors: std::collections::HashSet<&[u8]> = bytes.chunks(channels).collect();
        (frame.width, frame.height, colors.len())
    }

    #[test]
    fn every_kind_draws_valid_svg_with_its_words() {
        let dir = tempfile::tempdir().unwrap();
        for (name, draw, words) in kinds() {
            let path = dir.path().join(format!("{name}.svg"));
            draw(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
            let text = std::fs::read_to_string(&path).unwrap();
            assert_xml(&text);
            assert!(
                text.contains(r#"width="1000""#) && text.contains(r#"height="600""#),
                "{name}"
            );
            for w in words {
                assert!(text.contains(w), "{name}: no {w:?} in the SVG");
            }
        }
    }

    #[test]
    fn every_kind_draws_a_png_of_the_right_size_with_text() {
        let dir = tempfile::tempdir().unwrap();
        for (name, draw, _) in kinds() {
            let path = dir.path().join(format!("{name}.png"));
            draw(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
            let (w, h, colors) = decode_png(&path);
            assert_eq!((w, h), (WIDTH, HEIGHT), "{name}");
            // Anti-aliased text and several series make many shades; a blank picture has one.
            assert!(colors > 50, "{name}: only {colors} colours");
        }
    }

    #[test]
    fn another_extension_is_refused_naming_both_and_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        for (name, draw, _) in kinds() {
            let path = dir.path().join(format!("{name}.jpg"));
            let err = draw(&path).unwrap_err();
            assert!(matches!(err, PlotError::Format { .. }), "{name}: {err}");
            let msg = err.to_string();
            assert!(msg.contains(".svg") && msg.contains(".png"), "{msg}");
            assert!(!path.exists());
        }
    }

    #[test]
    fn no_data_at_all_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.svg");
        let empty = [LatencySeries::samples("a", vec![])];
        assert!(matches!(
            latency_cdf(&p, "t", &[]),
            Err(PlotError::Empty { .. })
        ));
        assert!(matches!(
            latency_cdf(&p, "t", &empty),
            Err(PlotError::Empty { .. })
        ));
        assert!(matches!(
            latency_histogram(&p, "t", &empty),
            Err(PlotError::Empty { .. })
        ));
        let no_points = [ThroughputSeries {
            name: "a".into(),
            points: vec![],
        }];
        assert!(matches!(
            throughput_vs_rtt(&p, "t", &no_points),
            Err(PlotError::Empty { .. })
        ));
        assert!(matches!(
            migration_timeline(&p, "t", &Timeline::default()),
            Err(PlotError::Empty { .. })
        ));
        assert!(!p.exists());
    }

    #[test]
    fn an_empty_series_beside_others_is_listed_as_having_no_data() {
        let dir = tempfile::tempdir().unwrap();
        let mut series = two_systems();
        series.push(LatencySeries::samples("silent-system", vec![]));
        type Draw = fn(&Path, &str, &[LatencySeries]) -> Result<(), PlotError>;
        let draws: [(&str, Draw); 2] = [
            ("cdf", |p, t, s| latency_cdf(p, t, s)),
            ("hist", |p, t, s| latency_histogram(p, t, s)),
        ];
        for (name, draw) in draws {
            let p = dir.path().join(format!("{name}.svg"));
            draw(&p, "t", &series).unwrap();
            let text = std::fs::read_to_string(&p).unwrap();
            assert!(text.contains("silent-system (no data)"), "{name}");
        }
    }

    #[test]
    fn zero_and_negative_latencies_on_log_axes_do_not_panic() {
        let dir = tempfile::tempdir().unwrap();
        for samples in [
            vec![0.0, 0.0, 5.0, 50.0],
            vec![0.0; 10],
            vec![-3.0, 0.0],
            vec![7.0],
        ] {
            let s = [LatencySeries::samples("z", samples.clone())];
            for ext in ["svg", "png"] {
                latency_cdf(dir.path().join(format!("c.{ext}")), "t", &s).unwrap();
                latency_histogram(dir.path().join(format!("h.{ext}")), "t", &s).unwrap();
            }
        }
        let zeros = [LatencySeries {
            name: "b".into(),
            latencies: Latencies::Buckets(vec![(0.0, 5), (1.0, 0)]),
        }];
        latency_cdf(dir.path().join("b.png"), "t", &zeros).unwrap();
        latency_histogram(dir.path().join("b.png"), "t", &zeros).unwrap();
    }

    #[test]
    fn values_that_cannot_be_drawn_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.png");
        let nan = [LatencySeries::samples("a", vec![1.0, f64::NAN])];
        assert!(matches!(
            latency_cdf(&p, "t", &nan),
            Err(PlotError::Invalid { .. })
        ));
        let pct = [LatencySeries {
            name: "p".into(),
            latencies: Latencies::Percentiles(vec![(0.5, 3.0)]),
        }];
        let err = latency_histogram(&p, "t", &pct).unwrap_err();
        assert!(err.to_string().contains("percentiles"), "{err}");
        let inf = [ThroughputSeries {
            name: "a".into(),
            points: vec![(1.0, f64::INFINITY)],
        }];
        assert!(matches!(
            throughput_vs_rtt(&p, "t", &inf),
            Err(PlotError::Invalid { .. })
        ));
        let mut backwards = timeline();
        backwards.phases[0].end_ms = -1.0;
        let err = migration_timeline(&p, "t", &backwards).unwrap_err();
        assert!(err.to_string().contains("pre-copy"), "{err}");
        assert!(!p.exists());
    }

    #[test]
    fn sparse_inputs_still_draw() {
        let dir = tempfile::tempdir().unwrap();
        let one = [ThroughputSeries {
            name: "a".into(),
            points: vec![(0.0, 0.0)],
        }];
        throughput_vs_rtt(dir.path().join("t.png"), "t", &one).unwrap();
        let gaps_only = Timeline {
            write_gaps: vec![WriteGap {
                start_ms: 5.0,
                length_ms: 0.0,
            }],
            ..Timeline::default()
        };
        migration_timeline(dir.path().join("g.png"), "t", &gaps_only).unwrap();
        let no_gaps = Timeline {
            write_gaps: vec![],
            ..timeline()
        };
        migration_timeline(dir.path().join("n.svg"), "t", &no_gaps).unwrap();
        let text = std::fs::read_to_string(dir.path().join("n.svg")).unwrap();
        assert!(text.contains("no write gap"));
        let pct = [LatencySeries {
            name: "p".into(),
            latencies: Latencies::Percentiles(vec![(0.5, 3.0), (0.99, 30.0)]),
        }];
        latency_cdf(dir.path().join("p.png"), "t", &pct).unwrap();
    }
}
