//! Text cut to a length in bytes, on a character boundary, saying how much was cut: what
//! bounds root causes, stack lines and fingerprint values before they travel or are shown. A
//! leaf: it imports nothing of the crate.

/// The first `max` bytes of `s` (on a character boundary), marking what was cut.
pub fn cut_end(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let keep = floor_boundary(s, max);
    format!("{} [… {} bytes cut]", &s[..keep], s.len() - keep)
}

/// The last `max` bytes of `s` (on a character boundary), marking what was cut.
pub fn cut_start(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut start = s.len() - max;
    while !s.is_char_boundary(start) {
        start += 1;
    }
    format!("[… {start} bytes cut] {}", &s[start..])
}

fn floor_boundary(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_fall_on_character_boundaries() {
        let s = "é".repeat(10);
        assert!(cut_end(&s, 5).starts_with("éé [… "));
        assert!(cut_start(&s, 5).ends_with("] éé"));
    }
}
