//! How the canonical form writes a JSON number.
//!
//! Version 1 of the fingerprint reads every number as an IEEE-754 double
//! and writes it as ECMAScript does (RFC 8785). Two numbers that round to
//! the same double then look the same: `9007199254740993` and
//! `9007199254740992`, two 64-bit ids one apart, or `0.1` and
//! `0.10000000000000000001`.
//!
//! Version 2 keeps a number's exact value whenever the double would lose
//! it:
//!
//! - when the number's exact decimal value is the value of what ECMAScript
//!   writes for its double (RFC 8785's form), that form is written, as in
//!   version 1: `1`, `1.0`, `1e0` and `100e-2` are all `1`; `0.1` is `0.1`;
//!   `1E21` is `1e+21`;
//! - otherwise the number is written in its exact normal form
//!   `[-]DIGITS E EXPONENT`: the sign (only `-`), the significant digits
//!   without leading or trailing zeros, an uppercase `E` and the decimal
//!   exponent, so that the value is `DIGITS × 10^EXPONENT`. So
//!   `9007199254740993` is `9007199254740993E0`, `-2^63` is
//!   `-9223372036854775808E0`, `1e400` (beyond the double range) is
//!   `1E400`, and `0.10000000000000000001` is `10000000000000000001E-20`.
//!
//! ECMAScript never writes an uppercase `E`, so the two forms never meet:
//! two numbers get the same spelling exactly when they have the same
//! decimal value. Zero in any spelling (`-0`, `0.0`, `0e5`) is `0`.

use alloc::string::String;
use alloc::vec::Vec;

/// The most digits an exponent may have, leading zeros aside. 18 digits
/// always fit an `i64`, and no real request carries a number beyond
/// 10^(10^18); the body limit is far smaller anyway.
const MAX_EXPONENT_DIGITS: usize = 18;

/// 2^53: every integer up to this magnitude is a double exactly, and
/// ECMAScript writes it as plain digits.
pub(crate) const MAX_EXACT_INTEGER: u64 = 9_007_199_254_740_992;

/// Why a number cannot be written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NumberError {
    /// The exponent has more than [`MAX_EXPONENT_DIGITS`] digits.
    ExponentOutOfRange,
    /// Not a JSON number (never for a token the parser accepted).
    NotANumber,
}

impl NumberError {
    /// The message for the parser's error.
    pub(crate) fn reason(self) -> &'static str {
        match self {
            NumberError::ExponentOutOfRange => {
                "number out of range: its exponent has more than 18 digits"
            }
            NumberError::NotANumber => "invalid number",
        }
    }
}

/// A decimal number in normal form: `±digits × 10^exponent`, where
/// `digits` is `high` followed by `low` (the significant digits of the
/// integer and of the fraction part), with no leading or trailing zero.
/// Zero has no digits.
#[derive(Debug, Clone, Copy)]
struct Decimal<'a> {
    negative: bool,
    high: &'a [u8],
    low: &'a [u8],
    exponent: i128,
}

impl Decimal<'_> {
    fn is_zero(&self) -> bool {
        self.high.is_empty() && self.low.is_empty()
    }

    fn digits(&self) -> impl Iterator<Item = u8> + '_ {
        self.high.iter().chain(self.low.iter()).copied()
    }

    /// Same decimal value.
    fn same_value(&self, other: &Decimal<'_>) -> bool {
        if self.is_zero() || other.is_zero() {
            return self.is_zero() && other.is_zero();
        }
        self.negative == other.negative
            && self.exponent == other.exponent
            && self.high.len() + self.low.len() == other.high.len() + other.low.len()
            && self.digits().eq(other.digits())
    }

    /// Writes the exact normal form `[-]DIGITS E EXPONENT` (`0` for zero).
    fn write_exact(&self, out: &mut Vec<u8>) {
        if self.is_zero() {
            out.push(b'0');
            return;
        }
        if self.negative {
            out.push(b'-');
        }
        out.extend_from_slice(self.high);
        out.extend_from_slice(self.low);
        out.push(b'E');
        let mut buffer = itoa::Buffer::new();
        out.extend_from_slice(buffer.format(self.exponent).as_bytes());
    }
}

/// Reads a number in JSON syntax (also ECMAScript's output, whose exponent
/// may carry `+`) into normal form.
fn parse(text: &[u8]) -> Result<Decimal<'_>, NumberError> {
    let (negative, rest) = match text {
        [b'-', rest @ ..] => (true, rest),
        _ => (false, text),
    };
    let int_len = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    let (int, rest) = rest.split_at(int_len);
    if int.is_empty() {
        return Err(NumberError::NotANumber);
    }
    let (frac, rest) = match rest {
        [b'.', after @ ..] => {
            let len = after.iter().take_while(|b| b.is_ascii_digit()).count();
            if len == 0 {
                return Err(NumberError::NotANumber);
            }
            after.split_at(len)
        }
        _ => (&rest[..0], rest),
    };
    let literal_exponent: i128 = match rest {
        [] => 0,
        [b'e' | b'E', after @ ..] => {
            let (negative_exponent, digits) = match after {
                [b'-', d @ ..] => (true, d),
                [b'+', d @ ..] => (false, d),
                d => (false, d),
            };
            if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
                return Err(NumberError::NotANumber);
            }
            let first = digits
                .iter()
                .position(|&d| d != b'0')
                .unwrap_or(digits.len());
            let significant = &digits[first..];
            if significant.len() > MAX_EXPONENT_DIGITS {
                return Err(NumberError::ExponentOutOfRange);
            }
            let magnitude = significant
                .iter()
                .fold(0i128, |acc, &d| acc * 10 + i128::from(d - b'0'));
            if negative_exponent {
                -magnitude
            } else {
                magnitude
            }
        }
        _ => return Err(NumberError::NotANumber),
    };

    // Leading zeros, across the integer part into the fraction.
    let int_start = int.iter().position(|&d| d != b'0').unwrap_or(int.len());
    let mut high = &int[int_start..];
    let mut low = frac;
    if high.is_empty() {
        let frac_start = frac.iter().position(|&d| d != b'0').unwrap_or(frac.len());
        low = &frac[frac_start..];
    }
    // Trailing zeros, across the fraction into the integer part. The
    // exponent counts from the last digit kept.
    let frac_len = i128::try_from(frac.len()).map_err(|_| NumberError::NotANumber)?;
    let mut exponent = literal_exponent - frac_len;
    let low_kept = low.iter().rposition(|&d| d != b'0').map_or(0, |i| i + 1);
    exponent += i128::try_from(low.len() - low_kept).map_err(|_| NumberError::NotANumber)?;
    low = &low[..low_kept];
    if low.is_empty() {
        let high_kept = high.iter().rposition(|&d| d != b'0').map_or(0, |i| i + 1);
        exponent += i128::try_from(high.len() - high_kept).map_err(|_| NumberError::NotANumber)?;
        high = &high[..high_kept];
    }
    Ok(Decimal {
        negative,
        high,
        low,
        exponent,
    })
}

/// Writes a finite double as ECMAScript's Number-to-String does: the
/// version-1 form of every number.
pub(crate) fn write_double(out: &mut Vec<u8>, v: f64) {
    if v == 0.0 {
        // Both +0 and -0.
        out.push(b'0');
        return;
    }
    #[allow(clippy::cast_precision_loss)]
    let max = MAX_EXACT_INTEGER as f64;
    if (-max..=max).contains(&v) {
        // Integers are most of the numbers in requests; ECMAScript writes
        // them as plain digits. In this range `as` is exact both ways, so
        // the round trip tells an integer from a fraction.
        #[allow(clippy::cast_possible_truncation)]
        let int = v as i64;
        #[allow(clippy::cast_precision_loss)]
        if int as f64 == v {
            let mut buffer = itoa::Buffer::new();
            out.extend_from_slice(buffer.format(int).as_bytes());
            return;
        }
    }
    let mut buffer = ryu_js::Buffer::new();
    out.extend_from_slice(buffer.format(v).as_bytes());
}

/// Writes the number spelled `text` (a JSON number token) in the
/// version-2 form.
pub(crate) fn write_exact(out: &mut Vec<u8>, text: &[u8]) -> Result<(), NumberError> {
    write_exact_near(out, text, None)
}

/// As [`write_exact`], given the double nearest the number when the
/// parser has already read it (correctly rounded, as `serde_json` with
/// `float_roundtrip` does), which saves reading it again.
pub(crate) fn write_exact_near(
    out: &mut Vec<u8>,
    text: &[u8],
    nearest: Option<f64>,
) -> Result<(), NumberError> {
    let exact = parse(text)?;
    if exact.is_zero() {
        out.push(b'0');
        return Ok(());
    }
    // The double nearest the number (core's parsing rounds correctly);
    // infinite beyond the double range, zero below it.
    let double = match nearest {
        Some(v) => v,
        None => core::str::from_utf8(text)
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .ok_or(NumberError::NotANumber)?,
    };
    if double.is_finite() && double != 0.0 {
        let start = out.len();
        write_double(out, double);
        let same = out
            .get(start..)
            .and_then(|written| parse(written).ok())
            .is_some_and(|written| written.same_value(&exact));
        if same {
            return Ok(());
        }
        out.truncate(start);
    }
    exact.write_exact(out);
    Ok(())
}

/// Writes an integer the parser read exactly in the version-2 form.
pub(crate) fn write_exact_u64(out: &mut Vec<u8>, negative: bool, magnitude: u64) {
    if magnitude <= MAX_EXACT_INTEGER {
        if negative && magnitude != 0 {
            out.push(b'-');
        }
        let mut buffer = itoa::Buffer::new();
        out.extend_from_slice(buffer.format(magnitude).as_bytes());
        return;
    }
    let mut text = String::with_capacity(21);
    if negative {
        text.push('-');
    }
    let mut buffer = itoa::Buffer::new();
    text.push_str(buffer.format(magnitude));
    // Digits only: always a number.
    let _ = write_exact(out, text.as_bytes());
}

/// The number tokens of a JSON text, in document order, found on demand:
/// the parser reports numbers as values, and version 2 needs their text.
///
/// Only meaningful for a text the parser accepts (it skips strings and
/// takes every run that starts with `-` or a digit outside them).
#[derive(Debug)]
pub(crate) struct Tokens<'a> {
    json: &'a [u8],
    pos: usize,
    found: usize,
}

impl<'a> Tokens<'a> {
    /// The tokens of `json`.
    pub(crate) fn new(json: &'a [u8]) -> Self {
        Tokens {
            json,
            pos: 0,
            found: 0,
        }
    }

    /// The next number token.
    pub(crate) fn next_token(&mut self) -> Option<(usize, &'a [u8])> {
        let json = self.json;
        while let Some(&b) = json.get(self.pos) {
            match b {
                b'"' => {
                    self.pos += 1;
                    // To the closing quote, stepping over escapes.
                    while let Some(at) = json
                        .get(self.pos..)
                        .and_then(|rest| rest.iter().position(|&c| c == b'"' || c == b'\\'))
                    {
                        let quote = json.get(self.pos + at) == Some(&b'"');
                        self.pos += at + if quote { 1 } else { 2 };
                        if quote {
                            break;
                        }
                    }
                }
                b'-' | b'0'..=b'9' => {
                    let start = self.pos;
                    while json.get(self.pos).is_some_and(|c| {
                        matches!(c, b'0'..=b'9' | b'.' | b'e' | b'E' | b'+' | b'-')
                    }) {
                        self.pos += 1;
                    }
                    self.found += 1;
                    return json.get(start..self.pos).map(|t| (start, t));
                }
                _ => self.pos += 1,
            }
        }
        None
    }

    /// The token with this index (0-based, in document order). Indexes
    /// must be asked in increasing order.
    pub(crate) fn nth(&mut self, index: usize) -> Option<&'a [u8]> {
        while self.found <= index {
            let (_, token) = self.next_token()?;
            if self.found == index + 1 {
                return Some(token);
            }
        }
        None
    }
}

/// A copy of `json` in which every number beyond the double range is
/// replaced by `0` and spaces (the same length, so positions in error
/// messages stay the same), or `None` when there is none. The parser
/// refuses such numbers; version 2 reads their text from the original.
pub(crate) fn without_overflow(json: &[u8]) -> Option<Vec<u8>> {
    let mut tokens = Tokens::new(json);
    let mut copy: Option<Vec<u8>> = None;
    while let Some((start, token)) = tokens.next_token() {
        let overflows = core::str::from_utf8(token)
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .is_some_and(f64::is_infinite);
        if overflows {
            let copy = copy.get_or_insert_with(|| json.to_vec());
            if let Some(span) = copy.get_mut(start..start + token.len()) {
                span.fill(b' ');
                span[0] = b'0';
            }
        }
    }
    copy
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::String;

    fn exact(text: &str) -> String {
        let mut out = Vec::new();
        write_exact(&mut out, text.as_bytes()).expect("a number");
        String::from_utf8(out).expect("ascii")
    }

    #[test]
    fn numbers_a_double_holds_keep_the_rfc8785_form() {
        for (text, want) in [
            ("1", "1"),
            ("1.0", "1"),
            ("1e0", "1"),
            ("100e-2", "1"),
            ("0.1", "0.1"),
            ("1E21", "1e+21"),
            ("1000000000000000000000", "1e+21"),
            ("0.0000001", "1e-7"),
            ("-1.5", "-1.5"),
            ("9007199254740992", "9007199254740992"),
            ("333333333.3333333", "333333333.3333333"),
            ("5e-324", "5e-324"),
        ] {
            assert_eq!(exact(text), want, "{text}");
        }
    }

    #[test]
    fn numbers_a_double_loses_keep_their_exact_value() {
        for (text, want) in [
            ("9007199254740993", "9007199254740993E0"),
            ("-9223372036854775808", "-9223372036854775808E0"),
            ("18446744073709551616", "18446744073709551616E0"),
            ("1e400", "1E400"),
            ("-1e400", "-1E400"),
            ("1e-400", "1E-400"),
            ("0.10000000000000000001", "10000000000000000001E-20"),
            (
                "123456789012345678901234567890",
                "12345678901234567890123456789E1",
            ),
            ("0.30000000000000005", "30000000000000005E-17"),
        ] {
            assert_eq!(exact(text), want, "{text}");
        }
    }

    #[test]
    fn spellings_of_one_value_agree() {
        for group in [
            &[
                "9007199254740993",
                "9007199254740993.0",
                "9.007199254740993e15",
                "90071992547409930e-1",
            ][..],
            &["1e400", "10e399", "0.1e401", "1.000e400"][..],
            &["0", "-0", "0.0", "0e5", "-0.000e-3"][..],
            &["0.10000000000000000001", "1.0000000000000000001e-1"][..],
        ] {
            let forms: Vec<String> = group.iter().map(|t| exact(t)).collect();
            assert!(
                forms.windows(2).all(|w| w[0] == w[1]),
                "{group:?}: {forms:?}"
            );
        }
    }

    #[test]
    fn neighbours_differ() {
        for (a, b) in [
            ("9007199254740992", "9007199254740993"),
            ("0.1", "0.10000000000000000001"),
            ("1e400", "1e401"),
            ("1e400", "-1e400"),
            ("1e-400", "0"),
            ("-9223372036854775808", "-9223372036854775807"),
            ("18446744073709551616", "18446744073709551615"),
        ] {
            assert_ne!(exact(a), exact(b), "{a} vs {b}");
        }
    }

    #[test]
    fn integers_read_exactly_match_their_text() {
        for (negative, magnitude) in [
            (false, 0),
            (true, 0),
            (false, 42),
            (true, 42),
            (false, MAX_EXACT_INTEGER),
            (false, MAX_EXACT_INTEGER + 1),
            (true, 1u64 << 63),
            (false, u64::MAX),
        ] {
            let mut out = Vec::new();
            write_exact_u64(&mut out, negative, magnitude);
            let text = if negative {
                alloc::format!("-{magnitude}")
            } else {
                alloc::format!("{magnitude}")
            };
            assert_eq!(
                String::from_utf8(out).expect("ascii"),
                exact(&text),
                "{text}"
            );
        }
    }

    #[test]
    fn huge_exponents_are_refused() {
        let mut out = Vec::new();
        assert_eq!(
            write_exact(&mut out, b"1e1234567890123456789"),
            Err(NumberError::ExponentOutOfRange)
        );
        // Leading zeros do not count.
        assert_eq!(exact("1e0000000000000000000000001"), "10");
        assert_eq!(exact("1e999999999999999999"), "1E999999999999999999");
    }

    #[test]
    fn tokens_skip_strings() {
        let json = br#"{"a-1":[1,-2.5e3,"x\"9"],"b":true,"c":null,"9":0}"#;
        let mut tokens = Tokens::new(json);
        let mut all = Vec::new();
        while let Some((_, t)) = tokens.next_token() {
            all.push(core::str::from_utf8(t).expect("ascii"));
        }
        assert_eq!(all, ["1", "-2.5e3", "0"]);
        let mut tokens = Tokens::new(json);
        assert_eq!(tokens.nth(1), Some(&b"-2.5e3"[..]));
        assert_eq!(tokens.nth(2), Some(&b"0"[..]));
        assert_eq!(tokens.nth(3), None);
    }

    #[test]
    fn overflowing_numbers_are_blanked_in_place() {
        assert_eq!(without_overflow(b"[1,2.5]"), None);
        let copy = without_overflow(b"[1e400,2,-1E999]").expect("copy");
        assert_eq!(copy, b"[0    ,2,0     ]");
    }

    mod props {
        use super::exact;
        use alloc::format;
        use proptest::prelude::*;

        proptest! {
            #[test]
            fn distinct_integers_never_collide(a in any::<i64>(), b in any::<i64>()) {
                prop_assume!(a != b);
                prop_assert_ne!(exact(&format!("{a}")), exact(&format!("{b}")));
            }

            #[test]
            fn distinct_wide_integers_never_collide(a in any::<u128>(), b in any::<u128>()) {
                prop_assume!(a != b);
                prop_assert_ne!(exact(&format!("{a}")), exact(&format!("{b}")));
            }

            #[test]
            fn respellings_agree(digits in "[1-9][0-9]{0,30}", exp in -400i32..400, shift in 0u32..5) {
                // DIGITS e EXP == DIGITS 000 e (EXP - 3) == D.IGITS e (EXP + len - 1).
                let base = exact(&format!("{digits}e{exp}"));
                let zeros = "0".repeat(shift as usize);
                let shifted = exp - i32::try_from(shift).unwrap_or(0);
                prop_assert_eq!(&base, &exact(&format!("{digits}{zeros}e{shifted}")));
                let (head, tail) = digits.split_at(1);
                let moved = exp + i32::try_from(tail.len()).unwrap_or(0);
                let point = if tail.is_empty() { format!("{head}e{moved}") } else { format!("{head}.{tail}e{moved}") };
                prop_assert_eq!(&base, &exact(&point));
                prop_assert_eq!(exact(&format!("-{digits}e{exp}")), format!("-{base}"));
            }

            #[test]
            fn changing_a_digit_changes_the_form(digits in "[1-9][0-9]{0,30}", exp in -400i32..400, at in any::<prop::sample::Index>()) {
                let i = at.index(digits.len());
                let mut other = digits.clone().into_bytes();
                other[i] = if other[i] == b'9' { b'8' } else { other[i] + 1 };
                let other = alloc::string::String::from_utf8(other).unwrap_or_default();
                prop_assert_ne!(exact(&format!("{digits}e{exp}")), exact(&format!("{other}e{exp}")));
            }
        }
    }
}
