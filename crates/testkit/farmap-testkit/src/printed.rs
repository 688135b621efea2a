//! Checks on figures a command printed rounded.
//!
//! A benchmark prints its rates rounded (to 0.1 MB/s, say) and computes its ratios from the
//! unrounded values. A test that recomputes a ratio from the printed rates must allow for both
//! roundings, relative to the size of the values: with a slow baseline a fixed tolerance fails
//! on a machine that is merely slow at the moment.

/// Whether `ratio`, printed rounded to a multiple of `ratio_step`, can be `num / den` where
/// `num` and `den` were printed rounded to multiples of `step`.
pub fn ratio_agrees(ratio: f64, ratio_step: f64, num: f64, den: f64, step: f64) -> bool {
    let half = step / 2.0;
    let lo = (num - half).max(0.0) / (den + half);
    let hi = if den > half {
        (num + half) / (den - half)
    } else {
        f64::INFINITY
    };
    // A little slack for the floating-point arithmetic of the roundings themselves.
    let slack = ratio_step / 2.0 + 1e-9 * ratio.abs().max(1.0);
    ratio >= lo - slack && ratio <= hi + slack
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_to(v: f64, step: f64) -> f64 {
        (v / step).round() * step
    }

    #[test]
    fn a_slow_baselines_rounding_is_allowed_for() {
        // The CI failure: 195.8 / 26.4 printed, 7.428 computed from the unrounded rates.
        assert!(ratio_agrees(7.428, 0.001, 195.8, 26.4, 0.1));
        assert!(!ratio_agrees(7.6, 0.001, 195.8, 26.4, 0.1));
        assert!(!ratio_agrees(7.2, 0.001, 195.8, 26.4, 0.1));
    }

    #[test]
    fn every_rounding_of_true_values_agrees() {
        for x in crate::XorShift(0x9e37_79b9_7f4a_7c15).take(10_000) {
            let num = (x % 1_000_000) as f64 / 97.0 + 0.06;
            let den = ((x >> 20) % 1_000_000) as f64 / 89.0 + 0.06;
            let ratio = round_to(num / den, 0.001);
            assert!(
                ratio_agrees(ratio, 0.001, round_to(num, 0.1), round_to(den, 0.1), 0.1),
                "{num} / {den}"
            );
        }
    }
}
