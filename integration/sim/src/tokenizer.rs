//! The engine's tokenizer: a real byte-level BPE, not kvmesh's assumption of
//! 4 bytes per token. It is the vocabulary of the tiny model the real vLLM
//! runs in this project's tests (`integration/vllm/make_model.py`: 2,048
//! tokens trained on the project's own docs, the ChatML markers as added
//! tokens), bundled as `tokenizer.json`, so a simulated engine counts a
//! prompt's tokens, and cuts it into KV blocks, as the real engine here
//! does. Its bytes per token vary with the content: prose like the docs it
//! was trained on packs more bytes into a token than code, JSON or text it
//! has never seen (`docs/simulator.md` gives the figures).
//!
//! A prompt is encoded in segments cut where the BPE's pre-tokenizer cuts
//! anyway (before a newline or a space that follows a non-space and is
//! followed by a non-space), so the tokens are those of the whole text, and
//! each segment's tokens are remembered: an agent's calls resend the same
//! conversation, and only what is new costs an encoding.

use std::collections::HashMap;
use std::sync::OnceLock;

/// The tiny model's tokenizer, as `make_model.py` builds it.
const VOCABULARY: &str = include_str!("../tokenizer.json");

/// A segment is cut at the first pre-token boundary past this many bytes.
const SEGMENT_BYTES: usize = 1024;

/// Bytes of text whose tokens are remembered before the memo starts over.
const MEMO_BYTES: usize = 64 << 20;

/// The bundled BPE, loaded once per process.
fn shared() -> &'static anyhow::Result<tokenizers::Tokenizer> {
    static BPE: OnceLock<anyhow::Result<tokenizers::Tokenizer>> = OnceLock::new();
    BPE.get_or_init(|| {
        VOCABULARY
            .parse()
            .map_err(|e| anyhow::anyhow!("the bundled tokenizer.json does not load: {e}"))
    })
}

/// Encodes `text` whole, without a memo (short texts: a reply).
fn encode_once(bpe: &tokenizers::Tokenizer, text: &[u8]) -> Vec<u32> {
    match bpe.encode_fast(String::from_utf8_lossy(text).as_ref(), false) {
        Ok(encoding) => encoding.get_ids().to_vec(),
        // Not expected of a byte-level BPE; a token per byte keeps the
        // count sane if it ever happens.
        Err(_) => text.iter().map(|&b| u32::from(b)).collect(),
    }
}

/// How many tokens `text` is (a reply's length in decode steps); a byte
/// per token if the bundled vocabulary failed to load.
pub fn count(text: &[u8]) -> usize {
    match shared() {
        Ok(bpe) => encode_once(bpe, text).len(),
        Err(_) => text.len(),
    }
}

pub struct Tokenizer {
    bpe: &'static tokenizers::Tokenizer,
    /// Each token's length in bytes of text (byte-level BPE: one character
    /// of its vocabulary entry per byte; added tokens their own length).
    token_bytes: Vec<u32>,
    memo: HashMap<Box<[u8]>, Box<[u32]>>,
    memo_bytes: usize,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocabulary", &self.token_bytes.len())
            .field("memo_bytes", &self.memo_bytes)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// The bundled vocabulary.
    pub fn new() -> anyhow::Result<Self> {
        let bpe = shared().as_ref().map_err(|e| anyhow::anyhow!("{e}"))?;
        let vocabulary = bpe.get_vocab(true);
        let added = bpe.get_added_vocabulary().get_vocab();
        let mut token_bytes = vec![0u32; vocabulary.values().map(|&id| id as usize + 1).max().unwrap_or(0)];
        for (text, id) in vocabulary {
            let bytes = if added.contains_key(&text) {
                text.len()
            } else {
                text.chars().count()
            };
            if let Some(slot) = token_bytes.get_mut(id as usize) {
                *slot = u32::try_from(bytes).unwrap_or(u32::MAX);
            }
        }
        Ok(Self {
            bpe,
            token_bytes,
            memo: HashMap::new(),
            memo_bytes: 0,
        })
    }

    /// The token ids of `text` (bytes that are not UTF-8 are read as
    /// replacement characters, as a server decoding the request would).
    pub fn encode(&mut self, text: &[u8]) -> Vec<u32> {
        let mut tokens = Vec::with_capacity(text.len() / 2);
        for segment in segments(text) {
            if let Some(known) = self.memo.get(segment) {
                tokens.extend_from_slice(known);
                continue;
            }
            let ids = encode_once(self.bpe, segment);
            tokens.extend_from_slice(&ids);
            if self.memo_bytes + segment.len() > MEMO_BYTES {
                self.memo.clear();
                self.memo_bytes = 0;
            }
            self.memo_bytes += segment.len();
            self.memo.insert(segment.into(), ids.into());
        }
        tokens
    }

    /// The text's length in bytes up to the end of each of `tokens`, in
    /// order (what a block of tokens spans in the prompt).
    pub fn byte_ends(&self, tokens: &[u32]) -> Vec<u64> {
        let mut end = 0u64;
        tokens
            .iter()
            .map(|&t| {
                end += u64::from(self.token_bytes.get(t as usize).copied().unwrap_or(1));
                end
            })
            .collect()
    }
}

/// `text` cut into segments at pre-token boundaries: before a `\n` or a
/// ` ` that follows a non-space and is followed by a non-space, the first
/// such boundary past `SEGMENT_BYTES` into the segment. Cuts depend only on
/// the text before them, so two prompts that share a prefix share its
/// segments.
fn segments(text: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut start = 0;
    std::iter::from_fn(move || {
        if start >= text.len() {
            return None;
        }
        let from = start;
        let mut i = from + SEGMENT_BYTES;
        while i + 1 < text.len() {
            let (before, at, after) = (text[i - 1], text[i], text[i + 1]);
            if (at == b'\n' || at == b' ') && !before.is_ascii_whitespace() && !after.is_ascii_whitespace() {
                start = i;
                return Some(&text[from..i]);
            }
            i += 1;
        }
        start = text.len();
        Some(&text[from..])
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(tokenizer: &Tokenizer, text: &str) -> Vec<u32> {
        tokenizer.bpe.encode_fast(text, false).unwrap().get_ids().to_vec()
    }

    #[test]
    fn segments_encode_as_the_whole_text() {
        let mut tokenizer = Tokenizer::new().unwrap();
        let prose = "The router keeps a session on the worker that holds its prefix. ".repeat(60);
        let code = "fn main() {\n    let x = vec![1, 2, 3];\n    println!(\"{x:?}\");\n}\n".repeat(40);
        let json = r#"{"role":"tool","content":"  indented\n\tand tabbed  "}"#.repeat(50);
        let mixed = format!("<|im_start|>system\n{prose}<|im_end|>\n<|im_start|>user\n{code}{json}<|im_end|>\n");
        for text in [prose.as_str(), code.as_str(), json.as_str(), mixed.as_str()] {
            assert!(segments(text.as_bytes()).count() > 1, "{}", text.len());
            assert_eq!(tokenizer.encode(text.as_bytes()), whole(&tokenizer, text));
            // Again, from the memo.
            assert_eq!(tokenizer.encode(text.as_bytes()), whole(&tokenizer, text));
        }
        let ids = tokenizer.encode(mixed.as_bytes());
        assert_eq!(tokenizer.byte_ends(&ids).last().copied(), Some(mixed.len() as u64));
    }

    #[test]
    fn bytes_per_token_vary_with_the_content_and_are_not_four() {
        let mut tokenizer = Tokenizer::new().unwrap();
        let mut ratio = |text: &str| text.len() as f64 / tokenizer.encode(text.as_bytes()).len() as f64;
        // Prose of the kind it was trained on, code, and text it never saw.
        let prose = ratio(
            &"the sidecar picks the worker that holds the session's prefix and the filter routes there. ".repeat(20),
        );
        let code = ratio(&"if let Some(w) = workers.get(i) { total += w.load(); }\n".repeat(20));
        let hex = ratio(&"9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08".repeat(20));
        for r in [prose, code, hex] {
            assert!((r - 4.0).abs() > 0.5, "{prose} {code} {hex}");
        }
        assert!(prose > 1.5 * hex, "{prose} {hex}");
        assert!(prose > code, "{prose} {code}");
    }

    #[test]
    fn the_chat_markers_are_single_tokens() {
        let mut tokenizer = Tokenizer::new().unwrap();
        assert_eq!(tokenizer.encode(b"<|im_start|>").len(), 1);
        assert_eq!(tokenizer.encode(b"<|im_end|>").len(), 1);
    }

    #[test]
    fn bytes_that_are_not_utf8_still_encode() {
        let mut tokenizer = Tokenizer::new().unwrap();
        assert!(!tokenizer.encode(&[0xff, 0xfe, b'a', b' ', 0xc3]).is_empty());
    }
}
