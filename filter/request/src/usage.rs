//! Reads the engine's `usage` from a response as it streams by, without
//! holding the whole response: JSON bodies keep only their tail (engines put
//! `usage` last), SSE streams are read line by line and only lines that
//! mention `usage` are parsed.
//!
//! Shapes understood: OpenAI chat and completions (`prompt_tokens`,
//! `prompt_tokens_details.cached_tokens`, also in the final chunk of a stream
//! with `stream_options.include_usage`), OpenAI Responses (`input_tokens`,
//! `input_tokens_details.cached_tokens`, streamed in `response.completed`),
//! and Anthropic Messages (`input_tokens` + `cache_read_input_tokens` +
//! `cache_creation_input_tokens`, streamed in `message_start` and
//! `message_delta`).

use serde_json::Value;

use crate::scan;

/// Token counts of one response, as the engine reported them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// All prompt tokens, cached or not.
    pub prompt_tokens: Option<u64>,
    /// Prompt tokens served from the engine's prefix cache.
    pub cached_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
}

/// The raw fields seen so far; later events overwrite earlier ones.
#[derive(Debug, Clone, Copy, Default)]
struct Tally {
    prompt_tokens: Option<u64>,
    cached_tokens: Option<u64>,
    /// `input_tokens` of the latest usage without Anthropic's cache fields:
    /// the whole prompt (OpenAI Responses; vLLM's Messages `message_start`).
    input_tokens: Option<u64>,
    /// The latest usage with Anthropic's cache fields, as one event gave it.
    split: Option<Split>,
    output_tokens: Option<u64>,
}

/// Anthropic's split of a prompt, from one usage object: `input_tokens`
/// there counts only the uncached remainder.
#[derive(Debug, Clone, Copy)]
struct Split {
    input_tokens: Option<u64>,
    cache_read_input_tokens: u64,
    cache_creation_input_tokens: u64,
}

impl Tally {
    fn merge(&mut self, usage: &Value) {
        let n = |path: &str| usage.pointer(path).and_then(Value::as_u64);
        let read = n("/cache_read_input_tokens");
        let created = n("/cache_creation_input_tokens");
        if read.is_some() || created.is_some() {
            // Taken whole from this one object: mixing an `input_tokens` of
            // another event (a total, in vLLM's `message_start`) with this
            // split would count the cached part twice.
            self.split = Some(Split {
                input_tokens: n("/input_tokens"),
                cache_read_input_tokens: read.unwrap_or(0),
                cache_creation_input_tokens: created.unwrap_or(0),
            });
        } else if let Some(input) = n("/input_tokens") {
            self.input_tokens = Some(input);
        }
        let fields = [
            (&mut self.prompt_tokens, n("/prompt_tokens")),
            (&mut self.cached_tokens, n("/prompt_tokens_details/cached_tokens")),
            (&mut self.output_tokens, n("/completion_tokens").or(n("/output_tokens"))),
        ];
        for (slot, value) in fields {
            if value.is_some() {
                *slot = value;
            }
        }
        if let Some(cached) = n("/input_tokens_details/cached_tokens") {
            self.cached_tokens = Some(cached);
        }
    }

    fn usage(self) -> Usage {
        if let Some(split) = self.split {
            let read = split.cache_read_input_tokens;
            let prompt_tokens = match split.input_tokens {
                // A split in full: remainder plus the cached parts.
                Some(input) => Some(
                    input
                        .saturating_add(read)
                        .saturating_add(split.cache_creation_input_tokens),
                ),
                // Cache fields alone: the total came in an event of its own.
                None => self.input_tokens,
            };
            return Usage {
                prompt_tokens,
                cached_tokens: Some(read),
                completion_tokens: self.output_tokens,
            };
        }
        Usage {
            prompt_tokens: self.prompt_tokens.or(self.input_tokens),
            cached_tokens: self.cached_tokens,
            completion_tokens: self.output_tokens,
        }
    }
}

#[derive(Debug)]
enum Mode {
    /// Server-sent events: the current partial line, and whether it grew
    /// past the cap (then it is skipped to its end).
    Sse { line: Vec<u8>, skipping: bool },
    /// A JSON body: its last bytes.
    Json { tail: Vec<u8> },
}

/// Incremental usage reader for one response.
#[derive(Debug)]
pub struct UsageReader {
    mode: Mode,
    tally: Tally,
    cap: usize,
}

impl UsageReader {
    /// A reader for a response of `content_type`, keeping at most `cap`
    /// bytes (of a JSON body's tail, or of one SSE line).
    pub fn new(content_type: Option<&str>, cap: usize) -> Self {
        let sse = content_type.is_some_and(|ct| ct.trim_start().to_ascii_lowercase().starts_with("text/event-stream"));
        let mode = if sse {
            Mode::Sse {
                line: Vec::new(),
                skipping: false,
            }
        } else {
            Mode::Json { tail: Vec::new() }
        };
        Self {
            mode,
            tally: Tally::default(),
            cap: cap.max(1024),
        }
    }

    /// Reads the next chunk of the response body.
    pub fn feed(&mut self, chunk: &[u8]) {
        match &mut self.mode {
            Mode::Json { tail } => {
                tail.extend_from_slice(chunk);
                // Drop the head in large steps, not on every chunk.
                if tail.len() > 2 * self.cap {
                    let excess = tail.len() - self.cap;
                    tail.drain(..excess);
                }
            }
            Mode::Sse { line, skipping } => {
                let mut rest = chunk;
                while let Some(newline) = memchr::memchr(b'\n', rest) {
                    if !*skipping && line.len() + newline <= self.cap {
                        line.extend_from_slice(&rest[..newline]);
                        read_sse_line(line, &mut self.tally);
                    }
                    line.clear();
                    *skipping = false;
                    rest = &rest[newline + 1..];
                }
                if !*skipping {
                    if line.len() + rest.len() > self.cap {
                        line.clear();
                        *skipping = true;
                    } else {
                        line.extend_from_slice(rest);
                    }
                }
            }
        }
    }

    /// The usage seen, once the response has ended.
    pub fn finish(mut self) -> Usage {
        match &mut self.mode {
            Mode::Json { tail } => {
                if let Some(usage) = last_usage_object(tail) {
                    self.tally.merge(&usage);
                }
            }
            Mode::Sse { line, skipping } => {
                if !*skipping {
                    read_sse_line(line, &mut self.tally);
                }
            }
        }
        self.tally.usage()
    }
}

fn read_sse_line(line: &[u8], tally: &mut Tally) {
    let Some(data) = line.strip_prefix(b"data:") else {
        return;
    };
    // Token chunks never mention usage: skip them without parsing.
    if memchr::memmem::find(data, b"usage").is_none() {
        return;
    }
    let Ok(event) = serde_json::from_slice::<Value>(data.trim_ascii()) else {
        return;
    };
    let usage = match event.get("type").and_then(Value::as_str) {
        Some("response.completed") => event.pointer("/response/usage"),
        Some("message_start") => event.pointer("/message/usage"),
        _ => event.get("usage"),
    };
    if let Some(usage) = usage.filter(|u| u.is_object()) {
        tally.merge(usage);
    }
}

/// The last `"usage": {...}` object in `bytes` (a whole body or its tail).
fn last_usage_object(bytes: &[u8]) -> Option<Value> {
    let finder = memchr::memmem::FinderRev::new(b"\"usage\"");
    let mut end = bytes.len();
    while let Some(at) = finder.rfind(&bytes[..end]) {
        let after_key = at + b"\"usage\"".len();
        let colon = after_key
            + bytes[after_key..]
                .iter()
                .take_while(|b| b.is_ascii_whitespace())
                .count();
        if bytes.get(colon) == Some(&b':')
            && let Ok(span) = scan::value_span(bytes, colon + 1)
            && bytes.get(span.start) == Some(&b'{')
            && let Ok(value) = serde_json::from_slice::<Value>(&bytes[span])
        {
            return Some(value);
        }
        end = at;
    }
    None
}
