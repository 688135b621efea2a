//! Draws every kind of picture from made-up but realistic data, as PNG and SVG.
//!
//! `cargo run -p farmap-plot --example gallery -- /tmp/plots` writes `cdf.png`,
//! `histogram.png`, `throughput.png`, `timeline.png` and their `.svg` twins there.

use std::path::PathBuf;

use farmap_plot::{
    latency_cdf, latency_histogram, migration_timeline, throughput_vs_rtt, Latencies,
    LatencySeries, Phase, ThroughputSeries, Timeline, WriteGap,
};

/// A small deterministic generator (xorshift), so the pictures are the same every run.
struct Rng(u64);

impl Rng {
    fn unit(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Log-normal around `median` with spread `sigma`, plus a rare slow mode.
    fn latency(&mut self, median: f64, sigma: f64, slow_share: f64, slow: f64) -> f64 {
        let (u1, u2) = (self.unit().max(1e-12), self.unit());
        let normal = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        let base = median * (sigma * normal).exp();
        if self.unit() < slow_share {
            base + slow * (1.0 + 3.0 * self.unit())
        } else {
            base
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "/tmp/plots".into()),
    );
    std::fs::create_dir_all(&dir)?;
    let latencies = latencies();
    let throughput = throughput();
    let timeline = timeline();
    for ext in ["png", "svg"] {
        let at = |name: &str| dir.join(format!("{name}.{ext}"));
        latency_cdf(
            at("cdf"),
            "bench paging: faulting accesses, uniform, 50% local",
            &latencies,
        )?;
        latency_histogram(
            at("histogram"),
            "bench paging: faulting accesses",
            &latencies[..2],
        )?;
        throughput_vs_rtt(at("throughput"), "bench pull: 1 GiB region", &throughput)?;
        migration_timeline(
            at("timeline"),
            "bench migrate: 1 GiB, pre-copy then post-copy",
            &timeline,
        )?;
    }
    println!("wrote {}", dir.display());
    Ok(())
}

/// Two systems' samples (a fast mode and a rare slow one each) and one given as percentiles.
fn latencies() -> Vec<LatencySeries> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let farmap: Vec<f64> = (0..200_000)
        .map(|_| rng.latency(55.0, 0.3, 0.004, 800.0))
        .collect();
    let swap: Vec<f64> = (0..200_000)
        .map(|_| rng.latency(30.0, 0.5, 0.02, 3000.0))
        .collect();
    vec![
        LatencySeries::samples("farmap (memory store)", farmap),
        LatencySeries::samples("kernel-swap", swap),
        LatencySeries {
            name: "farmap, 2 ms RTT (percentiles)".into(),
            latencies: Latencies::Percentiles(vec![
                (0.0, 2100.0),
                (0.5, 2300.0),
                (0.9, 2600.0),
                (0.99, 4100.0),
                (0.999, 9000.0),
            ]),
        },
    ]
}

/// Throughput falling with the round-trip time, faster with more streams.
fn throughput() -> Vec<ThroughputSeries> {
    vec![
        ThroughputSeries {
            name: "pull, 1 stream".into(),
            points: vec![
                (0.0, 1900.0),
                (1.0, 420.0),
                (2.0, 230.0),
                (5.0, 95.0),
                (10.0, 48.0),
            ],
        },
        ThroughputSeries {
            name: "pull, 8 streams".into(),
            points: vec![
                (0.0, 2050.0),
                (1.0, 1600.0),
                (2.0, 1150.0),
                (5.0, 610.0),
                (10.0, 320.0),
            ],
        },
        ThroughputSeries {
            name: "redis".into(),
            points: vec![
                (0.0, 780.0),
                (1.0, 300.0),
                (2.0, 170.0),
                (5.0, 70.0),
                (10.0, 36.0),
            ],
        },
    ]
}

/// 900 MB pre-copied in 2.3 s, a 40 ms hand-over, 124 MB post-copied, five write gaps.
fn timeline() -> Timeline {
    let mut bytes_moved = Vec::new();
    for i in 0..=400 {
        let ms = f64::from(i) * 10.0;
        let mb = if ms < 2300.0 {
            ms / 2300.0 * 900.0
        } else if ms < 2340.0 {
            900.0
        } else {
            900.0 + (ms - 2340.0).min(1500.0) / 1500.0 * 124.0
        };
        bytes_moved.push((ms, (mb * 1e6) as u64));
    }
    Timeline {
        phases: vec![
            Phase {
                name: "pre-copy".into(),
                start_ms: 0.0,
                end_ms: 2300.0,
            },
            Phase {
                name: "hand-over/downtime".into(),
                start_ms: 2300.0,
                end_ms: 2340.0,
            },
            Phase {
                name: "post-copy".into(),
                start_ms: 2340.0,
                end_ms: 3840.0,
            },
        ],
        bytes_moved,
        write_gaps: vec![
            WriteGap {
                start_ms: 610.0,
                length_ms: 3.0,
            },
            WriteGap {
                start_ms: 1500.0,
                length_ms: 1.2,
            },
            WriteGap {
                start_ms: 2296.0,
                length_ms: 47.5,
            },
            WriteGap {
                start_ms: 2600.0,
                length_ms: 6.0,
            },
            WriteGap {
                start_ms: 3100.0,
                length_ms: 2.0,
            },
        ],
    }
}
