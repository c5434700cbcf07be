//! Text from elsewhere (other nodes, the rendezvous) made safe to print on a terminal.
//!
//! Root causes, host names, roles, stderr tails and tracebacks come from other machines; printed
//! as they are, an escape sequence in them would act on the reader's terminal (an OSC 52
//! clipboard write, `ESC [2J`). Every control character a terminal acts on is shown instead as
//! its code: C0 but newline and tab, DEL, and C1 (0x80–0x9f, among them the one-character CSI
//! 0x9b, which some terminals take in its UTF-8 form too). ESC is a C0 character. So are the
//! bidirectional-text controls (U+202A–U+202E, U+2066–U+2069, U+200E, U+200F, U+061C), with
//! which a line shows other text than it holds.

use std::borrow::Cow;

/// Whether a terminal would act on `c` rather than show it (newline and tab are kept).
pub fn is_unsafe(c: char) -> bool {
    matches!(
        c,
        '\0'..='\x08'
            | '\x0b'..='\x1f'
            | '\x7f'..='\u{9f}'
            | '\u{200e}'..='\u{200f}'
            | '\u{202a}'..='\u{202e}'
            | '\u{2066}'..='\u{2069}'
            | '\u{061c}'
    )
}

/// How [`sanitize`] writes out `c`: `\xNN`, or `\u{NNNN}` past 0xff.
fn written_out(c: char) -> String {
    match u32::from(c) {
        n @ 0..=0xff => format!("\\x{n:02x}"),
        n => format!("\\u{{{n:04x}}}"),
    }
}

/// `text` with every character a terminal acts on written out as `\xNN` (`\x1b` for ESC), so
/// the reader sees that it was there and nothing happens. Unchanged text is not copied.
pub fn sanitize(text: &str) -> Cow<'_, str> {
    escape_unsafe(text, written_out)
}

/// JSON text (as `serde_json` writes it) with DEL, C1 and the bidirectional controls escaped as
/// `\uNNNN` too: the same document, safe on a terminal. JSON already escapes the C0
/// characters, and these can only be inside strings, where the escape means the same character.
pub fn sanitize_json(json: &str) -> Cow<'_, str> {
    escape_unsafe(json, |c| format!("\\u{:04x}", u32::from(c)))
}

/// `text` with each [`is_unsafe`] character replaced by `escape(c)`; borrowed when there is none.
fn escape_unsafe(text: &str, escape: impl Fn(char) -> String) -> Cow<'_, str> {
    if !text.chars().any(is_unsafe) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if is_unsafe(c) {
            out.push_str(&escape(c));
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shows_escapes_osc52_csi_and_c1_as_codes_and_keeps_newlines_tabs_and_text() {
        let hostile = "boom\x1b]52;c;ZXZpbA==\x07\x1b[2J\u{9b}31m\r\x7f\tok\nnext é ✓";
        let clean = sanitize(hostile);
        assert!(!clean.chars().any(is_unsafe), "{clean:?}");
        assert_eq!(clean, "boom\\x1b]52;c;ZXZpbA==\\x07\\x1b[2J\\x9b31m\\x0d\\x7f\tok\nnext é ✓");
        // A right-to-left override would show `exe.txt` for `txt.exe`.
        assert_eq!(sanitize("file\u{202e}txt.exe \u{2066}x\u{2069}"), "file\\u{202e}txt.exe \\u{2066}x\\u{2069}");
        assert!(matches!(sanitize("plain\ttext\n"), Cow::Borrowed(_)));
    }

    #[test]
    fn json_keeps_its_meaning_with_c1_and_del_escaped() {
        let value = serde_json::json!({ "host": "a\u{9b}2Jb\x7f\x1b[2J" });
        let text = serde_json::to_string(&value).unwrap();
        let clean = sanitize_json(&text);
        assert!(!clean.chars().any(is_unsafe), "{clean}");
        assert_eq!(serde_json::from_str::<serde_json::Value>(&clean).unwrap(), value);
    }
}
