//! The nft spelling every object shares: the family keyword, and the
//! cleaning of free text (comments, interface names) both backends send.

use std::borrow::Cow;

use kp_model::IpFamily;

/// `ip` or `ip6`: the table family, and the payload keyword of its addresses.
pub fn family_kw(f: IpFamily) -> &'static str {
    match f {
        IpFamily::V4 => "ip",
        IpFamily::V6 => "ip6",
    }
}

/// A comment or interface name with anything that could break an nft script
/// removed, at most 120 characters. Both backends send this same text, so
/// that the two list identically. Names reaching here are validated DNS
/// labels; this is defence in depth.
pub fn clean(s: &str) -> Cow<'_, str> {
    let ok = |c: char| {
        (c.is_ascii_graphic() || c == ' ') && !matches!(c, '"' | '\\' | ';' | '#' | '{' | '}')
    };
    if s.len() <= 120 && s.chars().all(ok) {
        return Cow::Borrowed(s);
    }
    Cow::Owned(s.chars().filter(|c| ok(*c)).take(120).collect())
}

/// Quoted nft string of [`clean`]ed `s`.
pub fn quote(s: &str) -> String {
    format!("\"{}\"", clean(s))
}
