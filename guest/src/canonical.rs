//! RFC 8785 JSON Canonicalization Scheme (JCS), and RFC 6901 field selection.
//!
//! [`canonicalize`] turns a JSON text (RFC 8259, UTF-8) into its one
//! canonical spelling, so that two texts that mean the same value give the
//! same bytes whatever their key order, whitespace or number spelling:
//!
//! - no whitespace between tokens;
//! - object members sorted by the UTF-16 code units of their names (as
//!   JavaScript's `Array.prototype.sort` does), which differs from UTF-8 byte
//!   order for names with characters above U+FFFF;
//! - with [`Numbers::Double`] (RFC 8785, fingerprint version 1), every
//!   number is read as an IEEE-754 double (large integers round as in
//!   JavaScript) and written as ECMAScript's `Number.prototype.toString`
//!   does; `-0` is written as `0`. With [`Numbers::Exact`] (fingerprint
//!   version 2), a number keeps that form only when it is the number's
//!   exact value, and is otherwise written exactly (see [`crate::number`]):
//!   numbers that differ never meet;
//! - strings are written as `JSON.stringify` does: `\"`, `\\`, `\b`, `\f`,
//!   `\n`, `\r`, `\t`, other control characters below U+0020 as `\u00xx`
//!   (lowercase hex), everything else as literal UTF-8.
//!
//! Stricter than RFC 8259 demands, and on purpose: duplicate object names,
//! invalid UTF-8, lone surrogates in `\u` escapes, trailing characters and
//! nesting deeper than 128 levels are errors, and so are numbers beyond the
//! double range with [`Numbers::Double`] (with [`Numbers::Exact`] they keep
//! their exact value; only an exponent of more than 18 digits is refused).
//!
//! [`select`] canonicalizes only the parts of a document that a list of JSON
//! Pointers selects, for fingerprints that must ignore volatile fields.

use alloc::borrow::Cow;
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use core::cell::{Cell, RefCell};
use core::cmp::Ordering;
use core::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

use crate::number::{self, Tokens};

/// The longest object name, in characters, that an error message quotes.
const MAX_QUOTED_KEY_CHARS: usize = 64;

/// How numbers are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Numbers {
    /// RFC 8785: every number as the IEEE-754 double nearest to it, written
    /// as ECMAScript writes it. Fingerprint version 1.
    Double,
    /// RFC 8785's form when it is the number's exact value, the exact
    /// normal form `[-]DIGITS E EXPONENT` otherwise ([`crate::number`]).
    /// Fingerprint version 2.
    Exact,
}

/// Why a document could not be canonicalized.
///
/// Messages never quote the document, except for the name of a duplicate
/// object member (at most 64 characters of it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CanonError {
    /// Not a JSON text: a syntax error, invalid UTF-8, a lone surrogate, a
    /// number outside the double range, trailing characters, or nesting
    /// deeper than 128 levels.
    Syntax {
        /// The 1-based line where the parser stopped (0 when unknown).
        line: usize,
        /// The 1-based column where the parser stopped (0 when unknown).
        column: usize,
        /// What the parser found wrong, without the document's content.
        reason: String,
    },
    /// An object has two members with the same name.
    DuplicateKey {
        /// The duplicated name, cut to 64 characters.
        key: String,
        /// True when `key` was cut.
        truncated: bool,
        /// The 1-based line where the object ends.
        line: usize,
        /// The 1-based column where the object ends.
        column: usize,
    },
    /// A pointer given to [`select`] is not an RFC 6901 JSON Pointer.
    InvalidPointer {
        /// The position of the pointer in the list given to [`select`].
        index: usize,
    },
}

impl fmt::Display for CanonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CanonError::Syntax {
                line,
                column,
                reason,
            } => {
                if *line == 0 {
                    write!(f, "invalid JSON: {reason}")
                } else {
                    write!(f, "invalid JSON at line {line} column {column}: {reason}")
                }
            }
            CanonError::DuplicateKey {
                key,
                truncated,
                line,
                column,
            } => {
                let more = if *truncated { "..." } else { "" };
                write!(
                    f,
                    "duplicate object key {key:?}{more} in the object that ends at line {line} column {column}"
                )
            }
            CanonError::InvalidPointer { index } => write!(
                f,
                "fingerprint field {index} is not a valid JSON Pointer (RFC 6901)"
            ),
        }
    }
}

impl core::error::Error for CanonError {}

/// Returns the RFC 8785 canonical form of the JSON text `json`.
///
/// # Errors
///
/// [`CanonError::Syntax`] when `json` is not one JSON text in UTF-8 (or
/// nests deeper than 128 levels), [`CanonError::DuplicateKey`] when an object
/// has two members with the same name.
pub fn canonicalize(json: &[u8]) -> Result<Vec<u8>, CanonError> {
    canonicalize_as(json, Numbers::Double)
}

/// Returns the canonical form of the JSON text `json`, with numbers
/// written as `numbers` says.
///
/// # Errors
///
/// As [`canonicalize`]; with [`Numbers::Exact`], a number beyond the double
/// range is no error, but an exponent of more than 18 digits is.
pub fn canonicalize_as(json: &[u8], numbers: Numbers) -> Result<Vec<u8>, CanonError> {
    beyond_doubles(json, numbers, |text, reader| {
        // Written while parsing, without a tree: names and strings are
        // escaped straight from the input, and an object's members are
        // moved into order only when they did not arrive in order.
        let writer = Writer {
            out: RefCell::new(Vec::with_capacity(json.len())),
            members: RefCell::new(Vec::new()),
            scratch: RefCell::new(Vec::new()),
            duplicate: RefCell::new(None),
            numbers: reader,
        };
        let mut de = serde_json::Deserializer::from_slice(text);
        WriteSeed { w: &writer }
            .deserialize(&mut de)
            .and_then(|()| de.end())
            .map_err(|err| parse_error(&err, writer.duplicate.take()))?;
        Ok(writer.out.into_inner())
    })
}

/// Runs `parse` on `json` with a [`NumberReader`]; with [`Numbers::Exact`],
/// when the parser refused a number beyond the double range, runs it again
/// on a copy where such numbers are blanked out, reading every number's
/// text from `json` itself.
fn beyond_doubles<T>(
    json: &[u8],
    numbers: Numbers,
    parse: impl Fn(&[u8], NumberReader<'_>) -> Result<T, CanonError>,
) -> Result<T, CanonError> {
    let first = parse(json, NumberReader::new(json, numbers, false));
    match first {
        Err(CanonError::Syntax { ref reason, .. })
            if numbers == Numbers::Exact && reason.as_str() == OUT_OF_RANGE =>
        {
            match number::without_overflow(json) {
                Some(copy) => parse(&copy, NumberReader::new(json, numbers, true)),
                None => first,
            }
        }
        other => other,
    }
}

/// serde_json's reason for a number beyond the double range.
const OUT_OF_RANGE: &str = "number out of range";

/// Returns the canonical form of the JSON object whose member names are
/// `pointers` and whose values are what each pointer selects in the JSON
/// text `json`.
///
/// A pointer that selects nothing is left out, so a missing field and a
/// field that is `null` give different results. The empty pointer selects
/// the whole document. A pointer listed twice appears once.
///
/// # Errors
///
/// As [`canonicalize`] for the document (the whole document is checked, not
/// only the selected parts), and [`CanonError::InvalidPointer`] for a pointer
/// that [`is_valid_pointer`] refuses.
pub fn select(json: &[u8], pointers: &[String]) -> Result<Vec<u8>, CanonError> {
    select_as(json, pointers, Numbers::Double)
}

/// As [`select`], with numbers written as `numbers` says.
///
/// # Errors
///
/// As [`select`], and for numbers as [`canonicalize_as`].
pub fn select_as(
    json: &[u8],
    pointers: &[String],
    numbers: Numbers,
) -> Result<Vec<u8>, CanonError> {
    if let Some(index) = pointers.iter().position(|p| !is_valid_pointer(p)) {
        return Err(CanonError::InvalidPointer { index });
    }
    let root = beyond_doubles(json, numbers, |text, reader| parse(text, &reader))?;
    let mut members: Vec<(&str, &Node)> = pointers
        .iter()
        .filter_map(|p| resolve(&root, p).map(|node| (p.as_str(), node)))
        .collect();
    members.sort_by(|a, b| utf16_cmp(a.0, b.0));
    members.dedup_by(|a, b| a.0 == b.0);

    let mut out = Vec::new();
    out.push(b'{');
    for (i, (name, node)) in members.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_string(&mut out, name);
        out.push(b':');
        write_node(&mut out, node);
    }
    out.push(b'}');
    Ok(out)
}

/// True when `p` is an RFC 6901 JSON Pointer: empty, or `/` followed by
/// reference tokens in which every `~` is followed by `0` or `1`.
pub fn is_valid_pointer(p: &str) -> bool {
    if p.is_empty() {
        return true;
    }
    if !p.starts_with('/') {
        return false;
    }
    let mut bytes = p.bytes();
    while let Some(b) = bytes.next() {
        if b == b'~' && !matches!(bytes.next(), Some(b'0' | b'1')) {
            return false;
        }
    }
    true
}

/// A parsed JSON value. Object members are kept sorted by name in UTF-16
/// order, with no two members of the same name.
#[derive(Debug)]
enum Node {
    Null,
    Bool(bool),
    /// The number's canonical text.
    Number(Vec<u8>),
    String(String),
    Array(Vec<Node>),
    Object(Vec<(String, Node)>),
}

/// Compares two strings by their UTF-16 code units, as RFC 8785 sorts names.
fn utf16_cmp(a: &str, b: &str) -> Ordering {
    a.encode_utf16().cmp(b.encode_utf16())
}

/// Parses `json` into a [`Node`] tree, refusing duplicate object names.
fn parse(json: &[u8], numbers: &NumberReader<'_>) -> Result<Node, CanonError> {
    let duplicate: RefCell<Option<String>> = RefCell::new(None);
    let mut de = serde_json::Deserializer::from_slice(json);
    NodeSeed {
        duplicate: &duplicate,
        numbers,
    }
    .deserialize(&mut de)
    .and_then(|node| de.end().map(|()| node))
    .map_err(|err| parse_error(&err, duplicate.take()))
}

/// Turns the parser's error into a [`CanonError`]; `duplicate` is the
/// duplicate name that stopped it, if that is what did.
fn parse_error(err: &serde_json::Error, duplicate: Option<String>) -> CanonError {
    let (line, column) = (err.line(), err.column());
    match duplicate {
        Some(name) => {
            let truncated = name.chars().count() > MAX_QUOTED_KEY_CHARS;
            let key = name.chars().take(MAX_QUOTED_KEY_CHARS).collect();
            CanonError::DuplicateKey {
                key,
                truncated,
                line,
                column,
            }
        }
        None => {
            let full = format!("{err}");
            let suffix = format!(" at line {line} column {column}");
            let reason = match full.strip_suffix(suffix.as_str()) {
                Some(reason) if line != 0 => String::from(reason),
                _ => full,
            };
            CanonError::Syntax {
                line,
                column,
                reason,
            }
        }
    }
}

/// The state of [`canonicalize`]: the output so far; a stack of the
/// members of the objects being read (each member's name and where its
/// `"name":value` text lies in the output), shared so that objects need no
/// allocation of their own; a buffer reused to reorder members; and the
/// first duplicate name met (serde's error type cannot carry it).
struct Writer<'de, 't> {
    out: RefCell<Vec<u8>>,
    members: RefCell<Vec<Member<'de>>>,
    scratch: RefCell<Vec<u8>>,
    duplicate: RefCell<Option<String>>,
    numbers: NumberReader<'t>,
}

/// Writes the numbers of one document as [`Numbers`] says. The parser
/// hands over numbers as values; the exact form needs their text, which
/// is found in the document by counting numbers (the parser visits them
/// in document order).
struct NumberReader<'t> {
    numbers: Numbers,
    tokens: RefCell<Tokens<'t>>,
    seen: Cell<usize>,
    /// Read every number from its text, also integers the parser read
    /// exactly (whose text was blanked out in the parser's copy).
    all_from_text: bool,
}

impl<'t> NumberReader<'t> {
    fn new(text: &'t [u8], numbers: Numbers, all_from_text: bool) -> Self {
        NumberReader {
            numbers,
            tokens: RefCell::new(Tokens::new(text)),
            seen: Cell::new(0),
            all_from_text,
        }
    }

    /// This number's index in the document.
    fn next_index(&self) -> usize {
        let index = self.seen.get();
        self.seen.set(index + 1);
        index
    }

    /// Writes an integer the parser read exactly.
    fn integer(
        &self,
        out: &mut Vec<u8>,
        negative: bool,
        magnitude: u64,
    ) -> Result<(), &'static str> {
        let index = self.next_index();
        match self.numbers {
            Numbers::Double => {
                // Rounds to the nearest double, ties to even, as JavaScript
                // reads the same decimal integer.
                #[allow(clippy::cast_precision_loss)]
                let v = magnitude as f64;
                number::write_double(out, if negative { -v } else { v });
                Ok(())
            }
            Numbers::Exact if self.all_from_text => self.write_from_text(out, index, None),
            Numbers::Exact => {
                number::write_exact_u64(out, negative, magnitude);
                Ok(())
            }
        }
    }

    /// Writes a number the parser read as a double.
    fn double(&self, out: &mut Vec<u8>, v: f64) -> Result<(), &'static str> {
        let index = self.next_index();
        match self.numbers {
            Numbers::Double if v.is_finite() => {
                number::write_double(out, v);
                Ok(())
            }
            Numbers::Double => Err(OUT_OF_RANGE),
            // The parser's double is the number's only when it read the
            // text itself (not the blanked copy's `0`).
            Numbers::Exact => {
                let nearest = (!self.all_from_text).then_some(v);
                self.write_from_text(out, index, nearest)
            }
        }
    }

    fn write_from_text(
        &self,
        out: &mut Vec<u8>,
        index: usize,
        nearest: Option<f64>,
    ) -> Result<(), &'static str> {
        let token = self
            .tokens
            .borrow_mut()
            .nth(index)
            .ok_or("a number the parser read is not in the text")?;
        number::write_exact_near(out, token, nearest).map_err(number::NumberError::reason)
    }
}

/// An object member's name and the range of its `"name":value` text.
type Member<'de> = (Cow<'de, str>, usize, usize);

/// Deserializes one JSON value by writing its canonical form to the end of
/// the writer's output.
struct WriteSeed<'w, 'de, 't> {
    w: &'w Writer<'de, 't>,
}

// Derived `Clone`/`Copy` would demand `Writer: Copy`.
impl Clone for WriteSeed<'_, '_, '_> {
    fn clone(&self) -> Self {
        *self
    }
}
impl Copy for WriteSeed<'_, '_, '_> {}

impl<'de> DeserializeSeed<'de> for WriteSeed<'_, 'de, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for WriteSeed<'_, 'de, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.w.out.borrow_mut().extend_from_slice(b"null");
        Ok(())
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<(), E> {
        let text: &[u8] = if v { b"true" } else { b"false" };
        self.w.out.borrow_mut().extend_from_slice(text);
        Ok(())
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        let out = &mut self.w.out.borrow_mut();
        self.w
            .numbers
            .integer(out, v < 0, v.unsigned_abs())
            .map_err(E::custom)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        let out = &mut self.w.out.borrow_mut();
        self.w.numbers.integer(out, false, v).map_err(E::custom)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        let out = &mut self.w.out.borrow_mut();
        self.w.numbers.double(out, v).map_err(E::custom)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        write_string(&mut self.w.out.borrow_mut(), v);
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.w.out.borrow_mut().push(b'[');
        let mut first = true;
        loop {
            // The comma goes in before the element is known to exist, and
            // comes out again when the array turns out to have ended.
            let comma_at = self.w.out.borrow().len();
            if !first {
                self.w.out.borrow_mut().push(b',');
            }
            if seq.next_element_seed(self)?.is_none() {
                let mut out = self.w.out.borrow_mut();
                out.truncate(comma_at);
                out.push(b']');
                return Ok(());
            }
            first = false;
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let open = {
            let mut out = self.w.out.borrow_mut();
            out.push(b'{');
            out.len()
        };
        // This object's members are the top of the shared stack, from
        // `base` on; nested objects push and pop theirs above them.
        let base = self.w.members.borrow().len();
        while let Some(name) = map.next_key_seed(NameSeed)? {
            let start = {
                let mut out = self.w.out.borrow_mut();
                if self.w.members.borrow().len() > base {
                    out.push(b',');
                }
                let start = out.len();
                write_string(&mut out, &name);
                out.push(b':');
                start
            };
            map.next_value_seed(self)?;
            let end = self.w.out.borrow().len();
            self.w.members.borrow_mut().push((name, start, end));
        }
        let mut stack = self.w.members.borrow_mut();
        let members = stack.get_mut(base..).unwrap_or_default();
        let in_order = members
            .windows(2)
            .all(|pair| matches!(pair, [a, b] if utf16_cmp(&a.0, &b.0) == Ordering::Less));
        if !in_order {
            // Stable sort: equal names end up adjacent, so one pass finds
            // them.
            members.sort_by(|a, b| utf16_cmp(&a.0, &b.0));
            let duplicate = members.windows(2).find_map(|pair| match pair {
                [a, b] if a.0 == b.0 => Some(String::from(a.0.as_ref())),
                _ => None,
            });
            if let Some(name) = duplicate {
                *self.w.duplicate.borrow_mut() = Some(name);
                return Err(de::Error::custom("duplicate object key"));
            }
            let mut out = self.w.out.borrow_mut();
            let mut scratch = self.w.scratch.borrow_mut();
            scratch.clear();
            scratch.extend_from_slice(out.get(open..).unwrap_or_default());
            out.truncate(open);
            for (i, (_, start, end)) in members.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(scratch.get(start - open..end - open).unwrap_or_default());
            }
        }
        stack.truncate(base);
        self.w.out.borrow_mut().push(b'}');
        Ok(())
    }
}

/// Deserializes an object member's name, borrowed from the input unless it
/// has escapes.
struct NameSeed;

impl<'de> DeserializeSeed<'de> for NameSeed {
    type Value = Cow<'de, str>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for NameSeed {
    type Value = Cow<'de, str>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object member name")
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Cow::Owned(String::from(v)))
    }
}

/// Deserializes one [`Node`]; records the first duplicate name it meets in
/// `duplicate` (serde's error type cannot carry it).
#[derive(Clone, Copy)]
struct NodeSeed<'a, 't> {
    duplicate: &'a RefCell<Option<String>>,
    numbers: &'a NumberReader<'t>,
}

impl<'de> DeserializeSeed<'de> for NodeSeed<'_, '_> {
    type Value = Node;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Node, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for NodeSeed<'_, '_> {
    type Value = Node;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Node, E> {
        Ok(Node::Null)
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Node, E> {
        Ok(Node::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Node, E> {
        let mut text = Vec::new();
        self.numbers
            .integer(&mut text, v < 0, v.unsigned_abs())
            .map_err(E::custom)?;
        Ok(Node::Number(text))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Node, E> {
        let mut text = Vec::new();
        self.numbers
            .integer(&mut text, false, v)
            .map_err(E::custom)?;
        Ok(Node::Number(text))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Node, E> {
        let mut text = Vec::new();
        self.numbers.double(&mut text, v).map_err(E::custom)?;
        Ok(Node::Number(text))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Node, E> {
        Ok(Node::String(String::from(v)))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Node, E> {
        Ok(Node::String(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Node, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(self)? {
            items.push(item);
        }
        Ok(Node::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Node, A::Error> {
        let mut members: Vec<(String, Node)> = Vec::new();
        while let Some(name) = map.next_key::<String>()? {
            let value = map.next_value_seed(self)?;
            members.push((name, value));
        }
        // Stable sort: equal names stay adjacent, so one pass finds them.
        members.sort_by(|a, b| utf16_cmp(&a.0, &b.0));
        let duplicate = members.windows(2).find_map(|pair| match pair {
            [a, b] if a.0 == b.0 => Some(a.0.clone()),
            _ => None,
        });
        if let Some(name) = duplicate {
            *self.duplicate.borrow_mut() = Some(name);
            return Err(de::Error::custom("duplicate object key"));
        }
        Ok(Node::Object(members))
    }
}

/// Follows the (valid) JSON Pointer `pointer` from `root`.
fn resolve<'a>(root: &'a Node, pointer: &str) -> Option<&'a Node> {
    let mut node = root;
    // The empty pointer has no tokens; every other one starts with '/'.
    for raw in pointer.split('/').skip(1) {
        let token = unescape_token(raw);
        node = match node {
            Node::Object(members) => members
                .iter()
                .find(|(name, _)| name.as_str() == token.as_ref())
                .map(|(_, value)| value)?,
            Node::Array(items) => items.get(array_index(&token)?)?,
            _ => return None,
        };
    }
    Some(node)
}

/// Decodes `~1` to `/` and then `~0` to `~`, in that order (RFC 6901 §4).
fn unescape_token(raw: &str) -> Cow<'_, str> {
    if raw.contains('~') {
        Cow::Owned(raw.replace("~1", "/").replace("~0", "~"))
    } else {
        Cow::Borrowed(raw)
    }
}

/// Reads an RFC 6901 array index: `0`, or decimal digits without a leading
/// zero. `-` and anything else select nothing.
fn array_index(token: &str) -> Option<usize> {
    let bytes = token.as_bytes();
    match bytes {
        [b'0'] => Some(0),
        [b'1'..=b'9', rest @ ..] if rest.iter().all(u8::is_ascii_digit) => {
            bytes.iter().try_fold(0usize, |acc, &d| {
                acc.checked_mul(10)?.checked_add(usize::from(d - b'0'))
            })
        }
        _ => None,
    }
}

/// Writes `node` in canonical form. Recursion is bounded by the parser's
/// depth limit.
fn write_node(out: &mut Vec<u8>, node: &Node) {
    match node {
        Node::Null => out.extend_from_slice(b"null"),
        Node::Bool(true) => out.extend_from_slice(b"true"),
        Node::Bool(false) => out.extend_from_slice(b"false"),
        Node::Number(text) => out.extend_from_slice(text),
        Node::String(s) => write_string(out, s),
        Node::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_node(out, item);
            }
            out.push(b']');
        }
        Node::Object(members) => {
            out.push(b'{');
            for (i, (name, value)) in members.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_string(out, name);
                out.push(b':');
                write_node(out, value);
            }
            out.push(b'}');
        }
    }
}

/// Writes `s` as a JSON string, escaped as RFC 8785 §3.2.2.2 requires.
fn write_string(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let short: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0x08 => b"\\b",
            0x0c => b"\\f",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x00..=0x1f => b"",
            _ => continue,
        };
        out.extend_from_slice(bytes.get(start..i).unwrap_or_default());
        if short.is_empty() {
            out.extend_from_slice(b"\\u00");
            out.push(HEX[usize::from(b >> 4)]);
            out.push(HEX[usize::from(b & 0x0f)]);
        } else {
            out.extend_from_slice(short);
        }
        start = i + 1;
    }
    out.extend_from_slice(bytes.get(start..).unwrap_or_default());
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::ToString;
    use alloc::vec;
    use proptest::prelude::*;

    fn canon(s: &str) -> String {
        match canonicalize(s.as_bytes()) {
            Ok(bytes) => String::from_utf8(bytes).expect("canonical output is UTF-8"),
            Err(e) => panic!("canonicalize({s:?}) failed: {e}"),
        }
    }

    fn canon_err(s: &[u8]) -> CanonError {
        match canonicalize(s) {
            Ok(out) => panic!("expected an error, got {:?}", String::from_utf8_lossy(&out)),
            Err(e) => e,
        }
    }

    fn sel(s: &str, pointers: &[&str]) -> String {
        let pointers: Vec<String> = pointers.iter().map(|p| p.to_string()).collect();
        match select(s.as_bytes(), &pointers) {
            Ok(bytes) => String::from_utf8(bytes).expect("canonical output is UTF-8"),
            Err(e) => panic!("select failed: {e}"),
        }
    }

    #[test]
    fn rfc8785_section_3_2_2_example() {
        let input = r#"{
  "numbers": [333333333.33333329, 1E30, 4.50,
              2e-3, 0.000000000000000000000000001],
  "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
  "literals": [null, true, false]
}"#;
        let expected = r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#;
        assert_eq!(canon(input), expected);
    }

    #[test]
    fn rfc8785_section_3_2_3_sorting_example() {
        let input = r#"{
  "\u20ac": "Euro Sign",
  "\r": "Carriage Return",
  "\ufb33": "Hebrew Letter Dalet With Dagesh",
  "1": "One",
  "\ud83d\ude00": "Emoji: Grinning Face",
  "\u0080": "Control",
  "\u00f6": "Latin Small Letter O With Diaeresis"
}"#;
        let expected = "{\"\\r\":\"Carriage Return\",\"1\":\"One\",\"\u{80}\":\"Control\",\
                        \"\u{f6}\":\"Latin Small Letter O With Diaeresis\",\"\u{20ac}\":\"Euro Sign\",\
                        \"\u{1f600}\":\"Emoji: Grinning Face\",\
                        \"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"}";
        assert_eq!(canon(input), expected);
    }

    #[test]
    fn nested_members_are_reordered_at_every_level() {
        assert_eq!(
            canon(
                r#"{"z":{"y":[{"b":1,"a":{"d":4,"c":3}}],"x":2},"a":[1,{"n":null,"m":true}],"m":{}}"#
            ),
            r#"{"a":[1,{"m":true,"n":null}],"m":{},"z":{"x":2,"y":[{"a":{"c":3,"d":4},"b":1}]}}"#
        );
        assert_eq!(canon(r#"[[],{},[[]],[{}]]"#), r#"[[],{},[[]],[{}]]"#);
        assert_eq!(
            canon(r#"{"a\u0062":1,"aa":2,"ab\n":3}"#),
            r#"{"aa":2,"ab":1,"ab\n":3}"#
        );
    }

    #[test]
    fn integers_and_fractions_share_ecmascript_spelling() {
        for (input, expected) in [
            ("9007199254740992", "9007199254740992"),
            ("-9007199254740992", "-9007199254740992"),
            ("9007199254740994", "9007199254740994"),
            ("12.0", "12"),
            ("-12.5e1", "-125"),
            ("1e15", "1000000000000000"),
            ("[0,-0,1,-1,0.5]", "[0,0,1,-1,0.5]"),
        ] {
            assert_eq!(canon(input), expected, "input {input}");
        }
    }

    #[test]
    fn utf16_order_differs_from_utf8_order() {
        // U+1F600 is 0xD83D 0xDE00 in UTF-16, below U+E000; in UTF-8 it is above.
        let input = "{\"\u{1f600}\":1,\"\u{e000}\":2,\"\u{ffff}\":3}";
        assert_eq!(
            canon(input),
            "{\"\u{1f600}\":1,\"\u{e000}\":2,\"\u{ffff}\":3}"
        );
        assert_eq!(
            canon("{\"\u{ffff}\":3,\"\u{e000}\":2,\"\u{1f600}\":1}"),
            "{\"\u{1f600}\":1,\"\u{e000}\":2,\"\u{ffff}\":3}"
        );
        assert_eq!(
            canon(r#"{"b":1,"a":2,"aa":3,"":4}"#),
            r#"{"":4,"a":2,"aa":3,"b":1}"#
        );
    }

    #[test]
    fn es6_number_formatting_from_text() {
        let vectors = [
            ("1e21", "1e+21"),
            ("1E21", "1e+21"),
            ("1e20", "100000000000000000000"),
            ("1e-7", "1e-7"),
            ("0.0000001", "1e-7"),
            ("0.000001", "0.000001"),
            ("1e-6", "0.000001"),
            ("123456789012345680000", "123456789012345680000"),
            ("-0", "0"),
            ("-0.0", "0"),
            ("0e10", "0"),
            ("-0e-10", "0"),
            ("5e-324", "5e-324"),
            ("-5e-324", "-5e-324"),
            ("1.7976931348623157e308", "1.7976931348623157e+308"),
            ("-1.7976931348623157e308", "-1.7976931348623157e+308"),
            ("9007199254740992", "9007199254740992"),
            ("9007199254740993", "9007199254740992"),
            ("-9007199254740993", "-9007199254740992"),
            ("9007199254740995", "9007199254740996"),
            ("18446744073709551615", "18446744073709552000"),
            ("18446744073709551616", "18446744073709552000"),
            ("-9223372036854775808", "-9223372036854776000"),
            ("-9223372036854775809", "-9223372036854776000"),
            (
                "123456789012345678901234567890123456789",
                "1.2345678901234568e+38",
            ),
            ("4.50", "4.5"),
            ("2e-3", "0.002"),
            ("1.0", "1"),
            ("100", "100"),
            ("0.1", "0.1"),
            ("1e+2", "100"),
            ("333333333.33333329", "333333333.3333333"),
            ("1E30", "1e+30"),
            ("0.000000000000000000000000001", "1e-27"),
        ];
        for (input, expected) in vectors {
            assert_eq!(canon(input), expected, "input {input}");
        }
    }

    #[test]
    fn es6_number_formatting_rfc8785_appendix_b() {
        let vectors: [(u64, &str); 25] = [
            (0x0000000000000000, "0"),
            (0x8000000000000000, "0"),
            (0x0000000000000001, "5e-324"),
            (0x8000000000000001, "-5e-324"),
            (0x7fefffffffffffff, "1.7976931348623157e+308"),
            (0xffefffffffffffff, "-1.7976931348623157e+308"),
            (0x4340000000000000, "9007199254740992"),
            (0xc340000000000000, "-9007199254740992"),
            (0x4430000000000000, "295147905179352830000"),
            (0x44b52d02c7e14af5, "9.999999999999997e+22"),
            (0x44b52d02c7e14af6, "1e+23"),
            (0x44b52d02c7e14af7, "1.0000000000000001e+23"),
            (0x444b1ae4d6e2ef4e, "999999999999999700000"),
            (0x444b1ae4d6e2ef4f, "999999999999999900000"),
            (0x444b1ae4d6e2ef50, "1e+21"),
            (0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"),
            (0x3eb0c6f7a0b5ed8d, "0.000001"),
            (0x41b3de4355555553, "333333333.3333332"),
            (0x41b3de4355555554, "333333333.33333325"),
            (0x41b3de4355555555, "333333333.3333333"),
            (0x41b3de4355555556, "333333333.3333334"),
            (0x41b3de4355555557, "333333333.33333343"),
            (0xbecbf647612f3696, "-0.0000033333333333333333"),
            (0x43143ff3c1cb0959, "1424953923781206.2"),
            (0x3ff0000000000000, "1"),
        ];
        for (bits, expected) in vectors {
            let v = f64::from_bits(bits);
            // Rust's `{:e}` is the shortest round-trip spelling: the parser
            // must get the same double back.
            let text = format!("{v:e}");
            assert_eq!(canon(&text), expected, "bits {bits:#018x} spelled {text}");
            let mut out = Vec::new();
            crate::number::write_double(&mut out, v);
            assert_eq!(out, expected.as_bytes(), "bits {bits:#018x}");
        }
    }

    #[test]
    fn numbers_beyond_double_range_are_errors() {
        for input in ["1e400", "-1e400", "[1e309]"] {
            let err = canon_err(input.as_bytes());
            assert!(matches!(err, CanonError::Syntax { .. }), "{input}: {err}");
        }
        // Underflow rounds to zero, as in JavaScript.
        assert_eq!(canon("1e-400"), "0");
    }

    #[test]
    fn string_escapes() {
        assert_eq!(
            canon(r#""\u0000\u0001\u001f\u0020\b\f\n\r\t\"\\\/\u007f""#),
            "\"\\u0000\\u0001\\u001f \\b\\f\\n\\r\\t\\\"\\\\/\u{7f}\""
        );
        assert_eq!(canon(r#""\u001F\u000B""#), r#""\u001f\u000b""#);
        // U+2028 and U+2029 stay literal, as does non-ASCII.
        assert_eq!(
            canon(r#""\u2028\u2029\u00e9\ud83d\ude00""#),
            "\"\u{2028}\u{2029}\u{e9}\u{1f600}\""
        );
        assert_eq!(canon("\"caf\u{e9} \u{1f600}\""), "\"caf\u{e9} \u{1f600}\"");
        assert_eq!(canon(r#"{"a\"b":"\\"}"#), r#"{"a\"b":"\\"}"#);
    }

    #[test]
    fn whitespace_and_scalars() {
        assert_eq!(canon(" \t\r\n[ 1 , 2 ,\n 3 ] \n"), "[1,2,3]");
        assert_eq!(canon("null"), "null");
        assert_eq!(canon("true"), "true");
        assert_eq!(canon(" false "), "false");
        assert_eq!(canon("\"x\""), "\"x\"");
        assert_eq!(canon("[]"), "[]");
        assert_eq!(canon("{}"), "{}");
        assert_eq!(
            canon(r#"{ "b" : [ {} , [ ] ] , "a" : { "d" : 1 , "c" : 2 } }"#),
            r#"{"a":{"c":2,"d":1},"b":[{},[]]}"#
        );
    }

    #[test]
    fn duplicate_keys_are_rejected() {
        for input in [
            r#"{"a":1,"a":2}"#,
            r#"{"a":1,"b":0,"a":1}"#,
            r#"{"a":1,"\u0061":2}"#,
            r#"[{"x":{"a":1,"a":1}}]"#,
        ] {
            match canon_err(input.as_bytes()) {
                CanonError::DuplicateKey {
                    key,
                    truncated,
                    line,
                    ..
                } => {
                    assert_eq!(key, "a", "{input}");
                    assert!(!truncated);
                    assert_eq!(line, 1);
                }
                other => panic!("{input}: {other:?}"),
            }
        }
        let err = canon_err(br#"{"a":1,"a":2}"#);
        assert!(
            err.to_string().starts_with("duplicate object key \"a\""),
            "{err}"
        );
        // Same name in different objects is fine.
        assert_eq!(
            canon(r#"{"a":{"a":1},"b":{"a":2}}"#),
            r#"{"a":{"a":1},"b":{"a":2}}"#
        );
    }

    #[test]
    fn duplicate_key_message_is_truncated() {
        let long = "k".repeat(200);
        let doc = format!("{{\"{long}\":1,\"{long}\":2}}");
        let err = canon_err(doc.as_bytes());
        match &err {
            CanonError::DuplicateKey { key, truncated, .. } => {
                assert_eq!(key.chars().count(), 64);
                assert!(*truncated);
            }
            other => panic!("{other:?}"),
        }
        let msg = err.to_string();
        assert!(!msg.contains(&long), "{msg}");
        assert!(msg.contains(&"k".repeat(64)), "{msg}");
    }

    #[test]
    fn syntax_errors() {
        let bad: [&[u8]; 22] = [
            b"",
            b" ",
            b"{",
            b"[1,]",
            b"{\"a\":1,}",
            b"{\"a\" 1}",
            b"{a:1}",
            b"'a'",
            b"01",
            b"1.",
            b".5",
            b"+1",
            b"NaN",
            b"Infinity",
            b"[1] x",
            b"{} {}",
            b"\"\xff\"",
            b"\xef\xbb\xbf{}",
            b"\"\\ud800\"",
            b"\"\\udc00\"",
            b"\"\\ud800\\u0041\"",
            b"\"a\nb\"",
        ];
        for input in bad {
            let err = canon_err(input);
            assert!(
                matches!(err, CanonError::Syntax { .. }),
                "{input:?}: {err:?}"
            );
        }
        // Invalid UTF-8 outside and inside strings, overlong encodings.
        for input in [&b"[\x80]"[..], b"\"\xc0\xaf\"", b"\"\xed\xa0\x80\""] {
            assert!(matches!(canon_err(input), CanonError::Syntax { .. }));
        }
    }

    #[test]
    fn syntax_error_message_has_position_and_no_content() {
        let err = canon_err(b"{\"secret\": tru}");
        let msg = err.to_string();
        assert!(msg.starts_with("invalid JSON at line 1 column "), "{msg}");
        assert!(!msg.contains("secret"), "{msg}");
        let err = canon_err(b"[1] trailing-secret");
        let msg = err.to_string();
        assert!(msg.contains("trailing characters"), "{msg}");
        assert!(!msg.contains("secret"), "{msg}");
    }

    #[test]
    fn nesting_depth_is_limited_without_overflow() {
        let ok = format!("{}{}", "[".repeat(100), "]".repeat(100));
        assert_eq!(canon(&ok), ok);
        let ok = format!("{}1{}", "{\"a\":".repeat(100), "}".repeat(100));
        assert_eq!(canon(&ok), ok);
        for depth in [129, 1_000, 100_000] {
            let deep = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
            let err = canon_err(deep.as_bytes());
            assert!(err.to_string().contains("recursion limit"), "{err}");
            let deep = "{\"a\":".repeat(depth);
            assert!(canonicalize(deep.as_bytes()).is_err());
        }
    }

    #[test]
    fn pointer_syntax() {
        for p in [
            "", "/", "/a", "/a/b", "/~0", "/~1", "/a~0b~1c", "//", "/0", "/-", "/ ",
        ] {
            assert!(is_valid_pointer(p), "{p:?}");
        }
        for p in ["a", "#/a", "/~", "/~2", "/a~", "/~a", " /a"] {
            assert!(!is_valid_pointer(p), "{p:?}");
        }
    }

    #[test]
    fn select_basic() {
        let doc = r#"{"amount":100,"currency":"EUR","ts":"2024-01-01T00:00:00Z","meta":{"a":[10,20,30]}}"#;
        assert_eq!(
            sel(doc, &["/currency", "/amount"]),
            r#"{"/amount":100,"/currency":"EUR"}"#
        );
        assert_eq!(sel(doc, &["/meta/a/1"]), r#"{"/meta/a/1":20}"#);
        assert_eq!(
            sel(doc, &["/meta/a/3", "/meta/a/-", "/meta/a/01", "/nope"]),
            "{}"
        );
        assert_eq!(sel(doc, &["/amount/x", "/meta/a/x"]), "{}");
        assert_eq!(sel(doc, &[""]), format!("{{\"\":{}}}", canon(doc)));
        assert_eq!(sel(doc, &[]), "{}");
        // A pointer listed twice appears once.
        assert_eq!(sel(doc, &["/amount", "/amount"]), r#"{"/amount":100}"#);
    }

    #[test]
    fn select_missing_differs_from_null() {
        let a = sel(r#"{"x":1}"#, &["/x", "/y"]);
        let b = sel(r#"{"x":1,"y":null}"#, &["/x", "/y"]);
        assert_eq!(a, r#"{"/x":1}"#);
        assert_eq!(b, r#"{"/x":1,"/y":null}"#);
        assert_ne!(a, b);
    }

    #[test]
    fn select_unescapes_tokens() {
        let doc = r#"{"a/b":1,"m~n":2,"~1":3,"":4,"c":{"":5}," ":6}"#;
        assert_eq!(sel(doc, &["/a~1b"]), r#"{"/a~1b":1}"#);
        assert_eq!(sel(doc, &["/m~0n"]), r#"{"/m~0n":2}"#);
        // "~01" is "~1", not "/".
        assert_eq!(sel(doc, &["/~01"]), r#"{"/~01":3}"#);
        assert_eq!(sel(doc, &["/"]), r#"{"/":4}"#);
        assert_eq!(sel(doc, &["/c/"]), r#"{"/c/":5}"#);
        assert_eq!(sel(doc, &["/ "]), r#"{"/ ":6}"#);
    }

    #[test]
    fn select_arrays() {
        let doc = r#"[10,[20,21],{"0":"zero"}]"#;
        assert_eq!(sel(doc, &["/0"]), r#"{"/0":10}"#);
        assert_eq!(sel(doc, &["/1/1"]), r#"{"/1/1":21}"#);
        assert_eq!(sel(doc, &["/2/0"]), r#"{"/2/0":"zero"}"#);
        assert_eq!(
            sel(
                doc,
                &["/3", "/-", "/+1", "/1e0", "/99999999999999999999999"]
            ),
            "{}"
        );
    }

    #[test]
    fn select_checks_the_whole_document() {
        let pointers = vec![String::from("/a")];
        assert!(matches!(
            select(br#"{"a":1,"b":{"c":1,"c":2}}"#, &pointers),
            Err(CanonError::DuplicateKey { .. })
        ));
        assert!(matches!(
            select(br#"{"a":1"#, &pointers),
            Err(CanonError::Syntax { .. })
        ));
        let bad = vec![String::from("/a"), String::from("a")];
        let err = select(br#"{"a":1}"#, &bad).expect_err("invalid pointer");
        assert_eq!(err, CanonError::InvalidPointer { index: 1 });
        assert!(err.to_string().contains("JSON Pointer"));
    }

    #[test]
    fn select_output_is_canonical() {
        let doc = r#"{"b":{"y":2.50,"x":1e2},"a":[3,"\u0041"]}"#;
        let out = sel(doc, &["/b", "/a"]);
        assert_eq!(out, r#"{"/a":[3,"A"],"/b":{"x":100,"y":2.5}}"#);
        assert_eq!(canon(&out), out);
    }

    // ---- property tests ----

    /// A JSON value with unique object names, for generating documents.
    #[derive(Debug, Clone)]
    enum Tj {
        Null,
        Bool(bool),
        Int(i64),
        Num(f64),
        Str(String),
        Arr(Vec<Tj>),
        Obj(Vec<(String, Tj)>),
    }

    fn arb_string() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<String>(),
            "[a-c\u{0}-\u{1f}\"\\\\/\u{7f}\u{80}\u{2028}\u{e000}\u{ffff}\u{10000}\u{1f600}]{0,4}",
        ]
    }

    fn arb_json() -> impl Strategy<Value = Tj> {
        let leaf = prop_oneof![
            Just(Tj::Null),
            any::<bool>().prop_map(Tj::Bool),
            any::<i64>().prop_map(Tj::Int),
            (-10_000i64..10_000).prop_map(Tj::Int),
            any::<f64>()
                .prop_filter("finite", |v| v.is_finite())
                .prop_map(Tj::Num),
            (-1e6f64..1e6).prop_map(Tj::Num),
            arb_string().prop_map(Tj::Str),
        ];
        leaf.prop_recursive(5, 64, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Tj::Arr),
                prop::collection::btree_map(arb_string(), inner, 0..6)
                    .prop_map(|m| Tj::Obj(m.into_iter().collect())),
            ]
        })
    }

    /// A tiny deterministic generator for spelling choices.
    struct Spell(u64);

    impl Spell {
        fn next(&mut self, n: u64) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (self.0 >> 33) % n
        }

        fn ws(&mut self, out: &mut String) {
            let choices = ["", "", " ", "\n", "\t", "\r\n  "];
            out.push_str(choices[self.next(6) as usize]);
        }

        fn string(&mut self, s: &str, out: &mut String) {
            out.push('"');
            for c in s.chars() {
                match c {
                    '"' => out.push_str("\\\""),
                    '\\' => out.push_str("\\\\"),
                    '\u{0}'..='\u{1f}' => out.push_str(&format!("\\u{:04X}", c as u32)),
                    _ if self.next(4) == 0 => {
                        let mut units = [0u16; 2];
                        for unit in c.encode_utf16(&mut units) {
                            out.push_str(&format!("\\u{:04x}", unit));
                        }
                    }
                    '/' if self.next(2) == 0 => out.push_str("\\/"),
                    _ => out.push(c),
                }
            }
            out.push('"');
        }

        fn render(&mut self, v: &Tj, out: &mut String) {
            self.ws(out);
            match v {
                Tj::Null => out.push_str("null"),
                Tj::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
                Tj::Int(i) => match self.next(3) {
                    0 => out.push_str(&format!("{i}")),
                    1 => out.push_str(&format!("{i}.0")),
                    _ => out.push_str(&format!("{:e}", *i as f64)),
                },
                Tj::Num(f) => match self.next(3) {
                    0 => out.push_str(&format!("{f}")),
                    1 => out.push_str(&format!("{f:e}")),
                    _ => out.push_str(&format!("{f:E}")),
                },
                Tj::Str(s) => self.string(s, out),
                Tj::Arr(items) => {
                    out.push('[');
                    for (i, item) in items.iter().enumerate() {
                        if i > 0 {
                            out.push(',');
                        }
                        self.render(item, out);
                    }
                    self.ws(out);
                    out.push(']');
                }
                Tj::Obj(members) => {
                    let mut order: Vec<usize> = (0..members.len()).collect();
                    for i in (1..order.len()).rev() {
                        let j = self.next(i as u64 + 1) as usize;
                        order.swap(i, j);
                    }
                    out.push('{');
                    for (n, &i) in order.iter().enumerate() {
                        if n > 0 {
                            out.push(',');
                        }
                        self.ws(out);
                        self.string(&members[i].0, out);
                        self.ws(out);
                        out.push(':');
                        self.render(&members[i].1, out);
                    }
                    self.ws(out);
                    out.push('}');
                }
            }
            self.ws(out);
        }
    }

    fn spell(v: &Tj, seed: u64) -> String {
        let mut out = String::new();
        Spell(seed).render(v, &mut out);
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn prop_idempotent(v in arb_json(), seed in any::<u64>()) {
            let text = spell(&v, seed);
            let once = canonicalize(text.as_bytes()).map_err(|e| TestCaseError::fail(format!("{e}: {text}")))?;
            let twice = canonicalize(&once).map_err(|e| TestCaseError::fail(format!("{e}")))?;
            prop_assert_eq!(once, twice);
        }

        #[test]
        fn prop_spelling_does_not_matter(v in arb_json(), a in any::<u64>(), b in any::<u64>()) {
            let one = canonicalize(spell(&v, a).as_bytes()).map_err(|e| TestCaseError::fail(format!("{e}")))?;
            let two = canonicalize(spell(&v, b).as_bytes()).map_err(|e| TestCaseError::fail(format!("{e}")))?;
            prop_assert_eq!(one, two);
        }

        #[test]
        fn prop_matches_oracle(v in arb_json(), seed in any::<u64>()) {
            let text = spell(&v, seed);
            let ours = canonicalize(text.as_bytes()).map_err(|e| TestCaseError::fail(format!("{e}")))?;
            let theirs = serde_json_canonicalizer::pipe(&text).map_err(|e| TestCaseError::fail(format!("{e}")))?;
            prop_assert_eq!(String::from_utf8(ours).map_err(|e| TestCaseError::fail(format!("{e}")))?, theirs);
        }

        #[test]
        fn prop_select_whole_document(v in arb_json(), seed in any::<u64>()) {
            let text = spell(&v, seed);
            let whole = canonicalize(text.as_bytes()).map_err(|e| TestCaseError::fail(format!("{e}")))?;
            let selected = select(text.as_bytes(), &[String::new()]).map_err(|e| TestCaseError::fail(format!("{e}")))?;
            let mut expected = b"{\"\":".to_vec();
            expected.extend_from_slice(&whole);
            expected.push(b'}');
            prop_assert_eq!(selected, expected);
        }

        #[test]
        fn prop_never_panics_on_bytes(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
            let _ = canonicalize(&bytes);
            let _ = select(&bytes, &[String::from("/a"), String::from("/0")]);
        }

        #[test]
        fn prop_valid_pointers(p in "(/([a-z~/]|~0|~1){0,4}){0,3}") {
            // Generated pointers may contain bare '~', which is invalid.
            let expected = {
                let b = p.as_bytes();
                (p.is_empty() || p.starts_with('/'))
                    && b.iter().enumerate().all(|(i, &c)| c != b'~' || matches!(b.get(i + 1), Some(b'0' | b'1')))
            };
            prop_assert_eq!(is_valid_pointer(&p), expected);
        }
    }

    fn exact(s: &str) -> String {
        match canonicalize_as(s.as_bytes(), Numbers::Exact) {
            Ok(bytes) => String::from_utf8(bytes).expect("canonical output is UTF-8"),
            Err(e) => panic!("canonicalize_as({s:?}) failed: {e}"),
        }
    }

    #[test]
    fn exact_numbers_keep_values_a_double_loses() {
        assert_eq!(
            exact(r#"{"b":[9007199254740993,1.0,-0],"a":{"id":18446744073709551616,"x":0.1}}"#),
            r#"{"a":{"id":18446744073709551616E0,"x":0.1},"b":[9007199254740993E0,1,0]}"#
        );
        assert_eq!(
            exact("[-9223372036854775808, 9223372036854775807]"),
            "[-9223372036854775808E0,9223372036854775807E0]"
        );
        assert_ne!(exact("[9007199254740993]"), exact("[9007199254740992]"));
        assert_eq!(exact("[9007199254740992]"), canon("[9007199254740992]"));
        // RFC 8785's own example number has more digits than a double
        // keeps: version 2 keeps them.
        assert_eq!(exact("[333333333.33333329]"), "[33333333333333329E-8]");
    }

    #[test]
    fn exact_numbers_agree_with_rfc8785_on_ordinary_documents() {
        for doc in [
            r#"{"numbers":[333333333.3333333,1E30,4.50,2e-3,0.000000000000000000000000001]}"#,
            r#"{"amount":100,"currency":"EUR","rate":1.25,"n":-7,"big":1e21}"#,
            r#"[0,-0,1e-7,123456789,0.5]"#,
        ] {
            assert_eq!(exact(doc), canon(doc), "{doc}");
        }
    }

    #[test]
    fn exact_numbers_beyond_the_double_range_are_kept() {
        assert_eq!(
            exact(r#"{"z":1e400,"a":[-1E999,1,2.5]}"#),
            r#"{"a":[-1E999,1,2.5],"z":1E400}"#
        );
        assert_ne!(exact("[1e400]"), exact("[1e401]"));
        assert_eq!(exact("[1e400]"), exact("[10e399]"));
        assert_eq!(exact("[1e-400]"), "[1E-400]");
        // Strings that look like numbers are not numbers.
        assert_eq!(
            exact(r#"{"s":"1e400","n":1e400}"#),
            r#"{"n":1E400,"s":"1e400"}"#
        );
    }

    #[test]
    fn exact_numbers_with_a_huge_exponent_are_refused_with_a_position() {
        let err =
            canonicalize_as(b"[1,\n 1e1234567890123456789]", Numbers::Exact).expect_err("refused");
        let CanonError::Syntax { line, reason, .. } = &err else {
            panic!("{err:?}")
        };
        assert_eq!(*line, 2, "{err}");
        assert!(reason.contains("exponent"), "{err}");
        // Other errors stay what they were, also after an overflow.
        let err = canonicalize_as(b"[1e400,]", Numbers::Exact).expect_err("refused");
        assert!(matches!(err, CanonError::Syntax { .. }), "{err}");
        let err = canonicalize_as(br#"{"a":1e400,"a":2}"#, Numbers::Exact).expect_err("dup");
        assert!(matches!(err, CanonError::DuplicateKey { .. }), "{err}");
    }

    #[test]
    fn exact_selection() {
        let pointers = vec!["/id".to_string(), "/big".to_string()];
        let out = select_as(
            br#"{"big":1e400,"id":9007199254740993,"ts":1}"#,
            &pointers,
            Numbers::Exact,
        )
        .expect("select");
        assert_eq!(out, br#"{"/big":1E400,"/id":9007199254740993E0}"#);
        let out = select_as(br#"{"id":1.0,"ts":1}"#, &pointers, Numbers::Exact).expect("select");
        assert_eq!(out, br#"{"/id":1}"#);
    }
}
