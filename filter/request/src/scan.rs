//! A small, allocation-light JSON scanner over raw request bytes: split an
//! object into its members and an array into its elements without building a
//! tree, and write a value minified with some keys dropped.
//!
//! Why not `serde_json::Value`: an agent request is mostly a few huge strings,
//! and building a tree of them costs more in V8 than everything else the
//! filter does. Here strings are skipped with SIMD `memchr` and copied as they
//! are (escapes included). The scanner checks structure (brackets, strings,
//! separators, nesting depth) but not the grammar of numbers and literals: a
//! body it accepts that the engine rejects only costs a routing decision.

use std::ops::Range;

/// Deepest nesting accepted: deeper bodies are refused, never recursed into.
pub(crate) const MAX_DEPTH: usize = 128;

/// Why the bytes are not a JSON value the scanner can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ScanError {
    #[error("unexpected end of input")]
    Eof,
    #[error("unexpected byte at offset {0}")]
    Unexpected(usize),
    #[error("nesting deeper than {MAX_DEPTH}")]
    TooDeep,
}

type Result<T> = std::result::Result<T, ScanError>;

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

fn skip_ws(bytes: &[u8], mut pos: usize) -> usize {
    while pos < bytes.len() && is_ws(bytes[pos]) {
        pos += 1;
    }
    pos
}

/// `pos` is at an opening quote; returns the offset just past the closing one.
///
/// Searches for quotes only, then counts the backslashes before each: agent
/// prompts are full of `\n` escapes but hold few escaped quotes, so this makes
/// one SIMD search per string instead of one per escape.
fn skip_string(bytes: &[u8], pos: usize) -> Result<usize> {
    let mut at = pos + 1;
    loop {
        let found = memchr::memchr(b'"', bytes.get(at..).ok_or(ScanError::Eof)?).ok_or(ScanError::Eof)?;
        at += found;
        let backslashes = bytes[pos + 1..at].iter().rev().take_while(|&&b| b == b'\\').count();
        if backslashes % 2 == 0 {
            return Ok(at + 1);
        }
        at += 1;
    }
}

/// A scalar (number, `true`, `false`, `null`): runs to the next delimiter.
fn skip_scalar(bytes: &[u8], pos: usize) -> Result<usize> {
    let end = bytes[pos..]
        .iter()
        .position(|&b| is_ws(b) || matches!(b, b',' | b']' | b'}' | b':' | b'[' | b'{' | b'"'))
        .map_or(bytes.len(), |n| pos + n);
    if end == pos {
        return Err(ScanError::Unexpected(pos));
    }
    Ok(end)
}

/// Skips the value starting at `pos` (after whitespace); returns its span.
pub(crate) fn value_span(bytes: &[u8], pos: usize) -> Result<Range<usize>> {
    let start = skip_ws(bytes, pos);
    let end = skip_value(bytes, start)?;
    Ok(start..end)
}

/// Skips the value at exactly `pos`, iteratively (no recursion on depth).
fn skip_value(bytes: &[u8], pos: usize) -> Result<usize> {
    match bytes.get(pos).copied().ok_or(ScanError::Eof)? {
        b'"' => skip_string(bytes, pos),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut at = pos;
            loop {
                let b = *bytes.get(at).ok_or(ScanError::Eof)?;
                match b {
                    b'"' => at = skip_string(bytes, at)?,
                    b'{' | b'[' => {
                        depth += 1;
                        if depth > MAX_DEPTH {
                            return Err(ScanError::TooDeep);
                        }
                        at += 1;
                    }
                    b'}' | b']' => {
                        depth -= 1;
                        at += 1;
                        if depth == 0 {
                            return Ok(at);
                        }
                    }
                    _ => at += 1,
                }
            }
        }
        b'}' | b']' | b',' | b':' => Err(ScanError::Unexpected(pos)),
        _ => skip_scalar(bytes, pos),
    }
}

/// Calls `each` with (raw key without its quotes, value span) for every
/// member of the object spanning `span`. When the input ends inside a value,
/// that member is passed with its value running to the end of the input
/// before `Eof` is returned, so a caller reading a cut body keeps it.
pub(crate) fn for_each_member(
    bytes: &[u8],
    span: Range<usize>,
    mut each: impl FnMut(Range<usize>, Range<usize>),
) -> Result<()> {
    let bytes = &bytes[..span.end];
    let eof_or = |at: usize| {
        if at >= bytes.len() {
            ScanError::Eof
        } else {
            ScanError::Unexpected(at)
        }
    };
    let mut at = skip_ws(bytes, span.start);
    if bytes.get(at) != Some(&b'{') {
        return Err(eof_or(at));
    }
    at = skip_ws(bytes, at + 1);
    if bytes.get(at) == Some(&b'}') {
        return Ok(());
    }
    loop {
        if bytes.get(at) != Some(&b'"') {
            return Err(eof_or(at));
        }
        let key_end = skip_string(bytes, at)?;
        let key = at + 1..key_end - 1;
        at = skip_ws(bytes, key_end);
        if bytes.get(at) != Some(&b':') {
            return Err(eof_or(at));
        }
        let start = skip_ws(bytes, at + 1);
        let value = match skip_value(bytes, start) {
            Ok(end) => start..end,
            Err(ScanError::Eof) => {
                each(key, start..bytes.len());
                return Err(ScanError::Eof);
            }
            Err(err) => return Err(err),
        };
        at = skip_ws(bytes, value.end);
        each(key, value);
        match bytes.get(at) {
            Some(b',') => at = skip_ws(bytes, at + 1),
            Some(b'}') => return Ok(()),
            _ => return Err(eof_or(at)),
        }
    }
}

/// Calls `each` with the span of every element of the array spanning `span`,
/// in order, until it returns `false`. Elements before a malformed one have
/// been seen when it fails, so a caller can keep what came before a cut.
pub(crate) fn for_each_element(
    bytes: &[u8],
    span: Range<usize>,
    mut each: impl FnMut(Range<usize>) -> bool,
) -> Result<()> {
    let bytes = &bytes[..span.end];
    let mut at = skip_ws(bytes, span.start);
    if bytes.get(at) != Some(&b'[') {
        return Err(ScanError::Unexpected(at));
    }
    at = skip_ws(bytes, at + 1);
    if bytes.get(at) == Some(&b']') {
        return Ok(());
    }
    loop {
        let element = value_span(bytes, at)?;
        at = skip_ws(bytes, element.end);
        if !each(element) {
            return Ok(());
        }
        match bytes.get(at) {
            Some(b',') => at = skip_ws(bytes, at + 1),
            Some(b']') => return Ok(()),
            Some(_) => return Err(ScanError::Unexpected(at)),
            None => return Err(ScanError::Eof),
        }
    }
}

/// What the minifier expects next.
#[derive(Debug, Clone, Copy)]
enum Expect {
    Value,
    /// After a value: a separator, a closing bracket, or the end.
    AfterValue,
    /// An object member's key (`first`: a `}` may close the object here).
    Key {
        first: bool,
    },
    /// An array element (`first`: a `]` may close the array here).
    Element {
        first: bool,
    },
}

/// Appends the value spanning `span` to `out` with whitespace outside strings
/// removed and every object member whose key is in `drop_keys` left out (at
/// any depth). Strings are copied byte for byte, escapes included.
///
/// Writing stops once `out` holds `max_len` bytes (nothing past them is
/// hashed): the output then ends mid-value, and the rest is not checked.
pub(crate) fn write_minified(
    bytes: &[u8],
    span: Range<usize>,
    drop_keys: &[&str],
    out: &mut Vec<u8>,
    max_len: usize,
) -> Result<()> {
    let bytes = &bytes[..span.end];
    // Per open container: (is an object, has written a member or element).
    let mut stack: Vec<(bool, bool)> = Vec::new();
    let mut at = span.start;
    let mut expect = Expect::Value;
    let byte_at = |at: usize| bytes.get(at).copied().ok_or(ScanError::Eof);
    loop {
        if out.len() >= max_len {
            out.truncate(max_len);
            return Ok(());
        }
        at = skip_ws(bytes, at);
        match expect {
            Expect::Value => match byte_at(at)? {
                open @ (b'{' | b'[') => {
                    if stack.len() >= MAX_DEPTH {
                        return Err(ScanError::TooDeep);
                    }
                    out.push(open);
                    stack.push((open == b'{', false));
                    at += 1;
                    expect = if open == b'{' {
                        Expect::Key { first: true }
                    } else {
                        Expect::Element { first: true }
                    };
                }
                b'"' => {
                    let end = skip_string(bytes, at)?;
                    // A huge string is copied only up to the limit.
                    let room = max_len.saturating_sub(out.len());
                    out.extend_from_slice(&bytes[at..end.min(at.saturating_add(room))]);
                    at = end;
                    expect = Expect::AfterValue;
                }
                b'}' | b']' | b',' | b':' => return Err(ScanError::Unexpected(at)),
                _ => {
                    let end = skip_scalar(bytes, at)?;
                    out.extend_from_slice(&bytes[at..end]);
                    at = end;
                    expect = Expect::AfterValue;
                }
            },
            Expect::AfterValue => {
                let Some(&(is_object, _)) = stack.last() else {
                    return Ok(());
                };
                match (byte_at(at)?, is_object) {
                    (b',', true) => expect = Expect::Key { first: false },
                    (b',', false) => expect = Expect::Element { first: false },
                    (b'}', true) | (b']', false) => {
                        out.push(bytes[at]);
                        stack.pop();
                    }
                    _ => return Err(ScanError::Unexpected(at)),
                }
                at += 1;
            }
            Expect::Element { first } => {
                if first && byte_at(at)? == b']' {
                    out.push(b']');
                    stack.pop();
                    at += 1;
                    expect = Expect::AfterValue;
                    continue;
                }
                mark_written(&mut stack, out);
                expect = Expect::Value;
            }
            Expect::Key { first } => {
                let b = byte_at(at)?;
                if first && b == b'}' {
                    out.push(b'}');
                    stack.pop();
                    at += 1;
                    expect = Expect::AfterValue;
                    continue;
                }
                if b != b'"' {
                    return Err(ScanError::Unexpected(at));
                }
                let key_end = skip_string(bytes, at)?;
                let colon = skip_ws(bytes, key_end);
                if byte_at(colon)? != b':' {
                    return Err(ScanError::Unexpected(colon));
                }
                let key = &bytes[at + 1..key_end - 1];
                if drop_keys.iter().any(|k| k.as_bytes() == key) {
                    let value = value_span(bytes, colon + 1)?;
                    let after = skip_ws(bytes, value.end);
                    match byte_at(after)? {
                        b',' => expect = Expect::Key { first: false },
                        b'}' => {
                            out.push(b'}');
                            stack.pop();
                            expect = Expect::AfterValue;
                        }
                        _ => return Err(ScanError::Unexpected(after)),
                    }
                    at = after + 1;
                    continue;
                }
                mark_written(&mut stack, out);
                out.extend_from_slice(&bytes[at..key_end]);
                out.push(b':');
                at = colon + 1;
                expect = Expect::Value;
            }
        }
    }
}

/// Writes the comma before every member or element but a container's first.
fn mark_written(stack: &mut [(bool, bool)], out: &mut Vec<u8>) {
    if let Some(top) = stack.last_mut() {
        if top.1 {
            out.push(b',');
        }
        top.1 = true;
    }
}
