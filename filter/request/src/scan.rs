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
/// `dropped` is called with the span of each value left out, in order, up
/// to where writing stopped (the markers a caller reads before they go).
pub(crate) fn write_minified(
    bytes: &[u8],
    span: Range<usize>,
    drop_keys: &[&str],
    out: &mut Vec<u8>,
    max_len: usize,
    dropped: &mut impl FnMut(Range<usize>),
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
                    dropped(value);
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

/// What a [`Tracker`] has found complete since it was last asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Found {
    /// `members()[n]` is complete.
    Member(usize),
    /// Element `element` of tracked array `array` is complete.
    Element { array: usize, element: usize },
}

/// An array member whose elements the tracker records as they complete.
#[derive(Debug, Clone, Default)]
pub(crate) struct TrackedArray {
    /// The member's key (one of the tracked keys).
    pub(crate) key: &'static str,
    /// The array value's span (its end is set when it closes).
    pub(crate) span: Range<usize>,
    pub(crate) elements: Vec<Range<usize>>,
    /// The elements follow `for_each_element`'s grammar up to the close: a
    /// caller may use `elements` in its place.
    pub(crate) valid: bool,
}

/// A resumable [`skip_value`]: the same rules (strings by quote search and
/// backslash parity, containers by depth alone, scalars to the next
/// delimiter), applied to bytes that arrive in pieces.
#[derive(Debug, Clone, Copy)]
enum Skip {
    String {
        open: usize,
    },
    Scalar,
    /// `depth` containers open; complete when it falls back to `floor`.
    /// `string` is the opening quote of a string being skipped inside.
    Container {
        depth: usize,
        floor: usize,
        string: Option<usize>,
    },
}

impl Skip {
    /// Starts skipping the value whose first byte is at `pos` (not
    /// whitespace), `depth` containers deep.
    fn start(bytes: &[u8], pos: usize, depth: usize) -> Result<(Self, usize)> {
        match bytes[pos] {
            b'"' => Ok((Self::String { open: pos }, pos + 1)),
            b'{' | b'[' => {
                if depth + 1 > MAX_DEPTH {
                    return Err(ScanError::TooDeep);
                }
                Ok((
                    Self::Container {
                        depth: depth + 1,
                        floor: depth,
                        string: None,
                    },
                    pos + 1,
                ))
            }
            b'}' | b']' | b',' | b':' => Err(ScanError::Unexpected(pos)),
            _ => Ok((Self::Scalar, pos)),
        }
    }

    /// Skips from `*at` towards the end of `bytes`; the end of the value
    /// once it is complete.
    fn advance(&mut self, bytes: &[u8], at: &mut usize) -> Result<Option<usize>> {
        match self {
            Self::String { open } => Ok(close_string(bytes, *open, at)),
            Self::Scalar => match bytes[*at..]
                .iter()
                .position(|&b| is_ws(b) || matches!(b, b',' | b']' | b'}' | b':' | b'[' | b'{' | b'"'))
            {
                Some(n) => {
                    *at += n;
                    Ok(Some(*at))
                }
                None => {
                    *at = bytes.len();
                    Ok(None)
                }
            },
            Self::Container { depth, floor, string } => loop {
                if let Some(open) = *string {
                    if close_string(bytes, open, at).is_none() {
                        return Ok(None);
                    }
                    *string = None;
                }
                let Some(&b) = bytes.get(*at) else {
                    return Ok(None);
                };
                match b {
                    b'"' => *string = Some(*at),
                    b'{' | b'[' => {
                        *depth += 1;
                        if *depth > MAX_DEPTH {
                            return Err(ScanError::TooDeep);
                        }
                    }
                    b'}' | b']' => {
                        *depth -= 1;
                        if *depth == *floor {
                            *at += 1;
                            return Ok(Some(*at));
                        }
                    }
                    _ => {}
                }
                *at += 1;
            },
        }
    }
}

/// Searches for the quote closing the string opened at `open`, from `*at`;
/// the offset past it when found (`*at` is then there too).
fn close_string(bytes: &[u8], open: usize, at: &mut usize) -> Option<usize> {
    loop {
        let Some(found) = bytes.get(*at..).and_then(|rest| memchr::memchr(b'"', rest)) else {
            *at = bytes.len();
            return None;
        };
        *at += found;
        let backslashes = bytes[open + 1..*at].iter().rev().take_while(|&&b| b == b'\\').count();
        *at += 1;
        if backslashes % 2 == 0 {
            return Some(*at);
        }
    }
}

/// Where a [`Tracker`] is in the top-level object.
#[derive(Debug, Clone, Copy)]
enum Top {
    Open,
    /// After `{`: a key or `}`.
    First,
    Key,
    /// In a key whose opening quote is at this offset.
    InKey(usize),
    Colon,
    Value,
    InValue(Skip),
    /// Inside a tracked array (its index in `arrays`).
    InArray(usize, Elements),
    AfterValue,
    Done,
    Failed,
}

/// Where a [`Tracker`] is inside a tracked array.
#[derive(Debug, Clone, Copy)]
enum Elements {
    /// After `[`: an element or `]`.
    First,
    Next,
    In {
        start: usize,
        skip: Skip,
    },
    After,
}

/// [`for_each_member`] over a body that arrives in pieces: each call to
/// `feed` resumes where the last one stopped, so every byte is looked at
/// once however the body is split. The members of `tracked` keys that are
/// arrays also have their elements recorded, as [`for_each_element`] would
/// find them.
///
/// Once `done`, `members` are exactly what `for_each_member` finds in the
/// whole body; before that (or after a failure) the caller scans the body
/// itself, so every error is the one-shot scanner's.
#[derive(Debug)]
pub(crate) struct Tracker {
    at: usize,
    top: Top,
    key: Range<usize>,
    value_start: usize,
    tracked: &'static [&'static str],
    pub(crate) members: Vec<(Range<usize>, Range<usize>)>,
    pub(crate) arrays: Vec<TrackedArray>,
    found: Vec<Found>,
}

impl Tracker {
    pub(crate) fn new(tracked: &'static [&'static str]) -> Self {
        Self {
            at: 0,
            top: Top::Open,
            key: 0..0,
            value_start: 0,
            tracked,
            members: Vec::new(),
            arrays: Vec::new(),
            found: Vec::new(),
        }
    }

    /// The top-level object closed: `members` are final.
    pub(crate) fn done(&self) -> bool {
        matches!(self.top, Top::Done)
    }

    /// What completed since the last call, in body order.
    pub(crate) fn take_found(&mut self) -> Vec<Found> {
        std::mem::take(&mut self.found)
    }

    /// Scans `bytes` (the whole body so far, grown since the last call)
    /// from where the last call stopped.
    pub(crate) fn feed(&mut self, bytes: &[u8]) {
        if let Err(_err) = self.run(bytes) {
            self.top = Top::Failed;
        }
    }

    fn run(&mut self, bytes: &[u8]) -> Result<()> {
        loop {
            if !matches!(self.top, Top::InKey(_) | Top::InValue(_) | Top::InArray(..)) {
                self.at = skip_ws(bytes, self.at);
            }
            let Some(&b) = bytes.get(self.at) else {
                return Ok(());
            };
            self.top = match self.top {
                Top::Done | Top::Failed => return Ok(()),
                Top::Open if b == b'{' => {
                    self.at += 1;
                    Top::First
                }
                Top::First if b == b'}' => {
                    self.at += 1;
                    Top::Done
                }
                Top::First | Top::Key if b == b'"' => {
                    self.at += 1;
                    Top::InKey(self.at - 1)
                }
                Top::InKey(open) => match close_string(bytes, open, &mut self.at) {
                    Some(end) => {
                        self.key = open + 1..end - 1;
                        Top::Colon
                    }
                    None => Top::InKey(open),
                },
                Top::Colon if b == b':' => {
                    self.at += 1;
                    Top::Value
                }
                Top::Value => {
                    self.value_start = self.at;
                    let key = &bytes[self.key.clone()];
                    let tracked = self.tracked.iter().find(|k| k.as_bytes() == key);
                    if let (b'[', Some(&key)) = (b, tracked) {
                        self.at += 1;
                        self.arrays.push(TrackedArray {
                            key,
                            span: self.value_start..self.value_start,
                            ..TrackedArray::default()
                        });
                        Top::InArray(self.arrays.len() - 1, Elements::First)
                    } else {
                        let (skip, at) = Skip::start(bytes, self.at, 0)?;
                        self.at = at;
                        Top::InValue(skip)
                    }
                }
                Top::InValue(mut skip) => match skip.advance(bytes, &mut self.at)? {
                    Some(end) => self.member(end),
                    None => Top::InValue(skip),
                },
                Top::InArray(array, elements) => self.array(bytes, array, elements)?,
                Top::AfterValue if b == b',' => {
                    self.at += 1;
                    Top::Key
                }
                Top::AfterValue if b == b'}' => {
                    self.at += 1;
                    Top::Done
                }
                _ => return Err(ScanError::Unexpected(self.at)),
            };
        }
    }

    fn member(&mut self, end: usize) -> Top {
        self.members.push((self.key.clone(), self.value_start..end));
        self.found.push(Found::Member(self.members.len() - 1));
        Top::AfterValue
    }

    /// One step inside a tracked array; on a departure from
    /// `for_each_element`'s grammar, its elements stop counting and the
    /// rest of the array is skipped as `skip_value` would.
    fn array(&mut self, bytes: &[u8], array: usize, elements: Elements) -> Result<Top> {
        if !matches!(elements, Elements::In { .. }) {
            self.at = skip_ws(bytes, self.at);
        }
        let Some(&b) = bytes.get(self.at) else {
            return Ok(Top::InArray(array, elements));
        };
        let next = match elements {
            Elements::First if b == b']' => {
                self.at += 1;
                return Ok(self.close_array(array, true));
            }
            Elements::First | Elements::Next => match Skip::start(bytes, self.at, 1) {
                Ok((skip, at)) => {
                    let start = self.at;
                    self.at = at;
                    Elements::In { start, skip }
                }
                Err(ScanError::TooDeep) => return Err(ScanError::TooDeep),
                Err(_) => return Ok(self.abandon(array)),
            },
            Elements::In { start, mut skip } => match skip.advance(bytes, &mut self.at)? {
                Some(end) => {
                    let tracked = &mut self.arrays[array];
                    tracked.elements.push(start..end);
                    self.found.push(Found::Element {
                        array,
                        element: tracked.elements.len() - 1,
                    });
                    Elements::After
                }
                None => Elements::In { start, skip },
            },
            Elements::After if b == b',' => {
                self.at += 1;
                Elements::Next
            }
            Elements::After if b == b']' => {
                self.at += 1;
                return Ok(self.close_array(array, true));
            }
            Elements::After => return Ok(self.abandon(array)),
        };
        Ok(Top::InArray(array, next))
    }

    fn close_array(&mut self, array: usize, valid: bool) -> Top {
        self.arrays[array].valid = valid;
        self.arrays[array].span.end = self.at;
        self.member(self.at)
    }

    /// The array is skipped on as one value, one container deep.
    fn abandon(&mut self, array: usize) -> Top {
        self.arrays[array].valid = false;
        self.arrays[array].elements.clear();
        Top::InValue(Skip::Container {
            depth: 1,
            floor: 0,
            string: None,
        })
    }
}
