//! What `/proc/self/maps` has in a range: the arena names what is in its way.

use std::ops::Range;

/// The first line of `maps` (the text of `/proc/PID/maps`) whose mapping overlaps `range`.
pub fn first_overlap(maps: &str, range: Range<usize>) -> Option<&str> {
    maps.lines()
        .find(|line| parse_range(line).is_some_and(|r| r.start < range.end && range.start < r.end))
}

/// The address range at the start of a maps line (`start-end ...`, hexadecimal).
fn parse_range(line: &str) -> Option<Range<usize>> {
    let span = line.split_whitespace().next()?;
    let (start, end) = span.split_once('-')?;
    let start = usize::from_str_radix(start, 16).ok()?;
    let end = usize::from_str_radix(end, 16).ok()?;
    (start < end).then_some(start..end)
}

/// The first mapping of this process that overlaps `range`, as its maps line.
pub fn taken_in_self(range: Range<usize>) -> std::io::Result<Option<String>> {
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    Ok(first_overlap(&maps, range).map(str::to_owned))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
555555554000-555555556000 r--p 00000000 fe:01 123  /usr/bin/cat
100000000000-100040000000 rw-p 00000000 00:00 0 
7ffff7fc1000-7ffff7fc5000 r--p 00000000 00:00 0    [vvar]
garbage line
";

    #[test]
    fn the_overlapping_line_is_found_and_neighbours_are_not() {
        let a = 0x1000_0000_0000;
        assert!(first_overlap(MAPS, a..a + 0x1000)
            .unwrap()
            .starts_with("100000000000-"));
        assert!(first_overlap(MAPS, a - 0x1000..a + 1).is_some());
        // Touching ends do not overlap.
        assert!(first_overlap(MAPS, a + 0x4000_0000..a + 0x8000_0000).is_none());
        assert!(first_overlap(MAPS, a - 0x1000..a).is_none());
        assert!(first_overlap(MAPS, 0x7fff_f7fc_4000..0x7fff_f7fd_0000)
            .unwrap()
            .ends_with("[vvar]"));
    }

    #[test]
    fn this_process_has_its_own_stack_mapped() {
        let x = 0u8;
        let at = std::ptr::addr_of!(x).addr();
        let line = taken_in_self(at..at + 1).unwrap().unwrap();
        assert!(line.contains("[stack]") || line.contains("rw"), "{line}");
    }
}
