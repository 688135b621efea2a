//! Metrics read at scrape time from counters the code keeps anyway (a server's connection
//! counts, a managed store's push statistics): nothing on the data path is counted twice.

use std::sync::Mutex;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

/// The labels of one reading: `(name, value)` pairs.
pub type Labels = Vec<(&'static str, String)>;

/// How a reading's value is read: called at every scrape, on the scraping task (it must
/// not block).
type Read = Box<dyn Fn() -> u64 + Send + Sync>;

/// One metric: its name (without `_total`: the encoder adds it to counters), help, type,
/// and one value per label set.
struct Family {
    name: &'static str,
    help: &'static str,
    kind: MetricType,
    samples: Vec<(Labels, Read)>,
}

/// The readings of a process, grouped by metric name, in the order they were added.
#[derive(Default)]
pub(crate) struct Readings {
    families: Mutex<Vec<Family>>,
}

impl std::fmt::Debug for Readings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let families = self.families.lock().unwrap_or_else(|e| e.into_inner());
        f.debug_list()
            .entries(families.iter().map(|fam| fam.name))
            .finish()
    }
}

impl Readings {
    /// Adds a value to metric `name` (made on its first value, with `help` and `kind`).
    pub(crate) fn add(
        &self,
        name: &'static str,
        help: &'static str,
        kind: MetricType,
        labels: Labels,
        read: Read,
    ) {
        let mut families = self.families.lock().unwrap_or_else(|e| e.into_inner());
        match families.iter_mut().find(|f| f.name == name) {
            Some(f) => {
                debug_assert!(f.kind == kind, "{name}: one type per metric");
                f.samples.push((labels, read));
            }
            None => families.push(Family {
                name,
                help,
                kind,
                samples: vec![(labels, read)],
            }),
        }
    }
}

impl Collector for Readings {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let families = self.families.lock().unwrap_or_else(|e| e.into_inner());
        for f in families.iter() {
            let mut metric = encoder.encode_descriptor(f.name, f.help, None, f.kind)?;
            for (labels, read) in &f.samples {
                let value = read();
                let sample = metric.encode_family(labels)?;
                if f.kind == MetricType::Counter {
                    ConstCounter::new(value).encode(sample)?;
                } else {
                    ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX)).encode(sample)?;
                }
            }
        }
        Ok(())
    }
}
