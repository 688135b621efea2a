//! The shape every number with a unit shares (a size, a duration, a link rate): the number's
//! digits and decimal points first, then the unit.

/// Splits `input` (trimmed) into its number (the leading digits and `.`s, perhaps none) and
/// its unit (the rest, trimmed). Each grammar then reads the number and the unit its own way:
/// [`parse_size`](crate::parse_size), [`parse_duration`](crate::parse_duration).
pub fn split_quantity(input: &str) -> (&str, &str) {
    let s = input.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    (num, unit.trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_number_comes_first_and_the_unit_after() {
        assert_eq!(split_quantity(" 1.5 GiB "), ("1.5", "GiB"));
        assert_eq!(split_quantity("10ms"), ("10", "ms"));
        assert_eq!(split_quantity("64"), ("64", ""));
        assert_eq!(split_quantity("MiB"), ("", "MiB"));
        assert_eq!(split_quantity("1e3s"), ("1", "e3s"));
    }
}
