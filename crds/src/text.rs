//! Text that came from elsewhere (an agent, a store, the API server), cut down to what a
//! status field, an Event note or a log line can hold. One rule for the operator and the
//! agent.

/// `message` cut to at most `max` bytes at a character boundary, with `…` appended
/// (three bytes more) when anything was cut.
pub fn truncated(message: &str, max: usize) -> String {
    if message.len() <= max {
        return message.to_string();
    }
    let mut cut = max;
    while !message.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}…", &message[..cut])
}

#[cfg(test)]
mod tests {
    use super::truncated;

    #[test]
    fn cuts_at_a_character_boundary_and_says_so() {
        assert_eq!(truncated("short", 10), "short");
        assert_eq!(truncated("exactly", 7), "exactly");
        assert_eq!(truncated("abcdef", 3), "abc…");
        // 'é' is two bytes: a cut inside it moves back to before it.
        assert_eq!(truncated("aé", 2), "a…");
        assert_eq!(truncated("ééé", 3), "é…");
        let long = "ü".repeat(1000);
        let cut = truncated(&long, 1001);
        assert!(cut.len() <= 1001 + '…'.len_utf8());
        assert!(cut.ends_with('…'));
    }
}
