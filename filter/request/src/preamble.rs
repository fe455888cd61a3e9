//! Claude Code's billing preamble: the first block of its `system`,
//! `x-anthropic-billing-header: cc_version=<version>.<3 hex>; cc_entrypoint=…;`,
//! whose digits differ between sessions with different first prompts
//! (docs/harnesses/claude-code.md). Left in, it breaks the canonical prefix of
//! two sessions right after their tools.
//!
//! Engines that serve `/v1/messages` strip it before templating, each its own
//! way:
//!
//! - vLLM, `AnthropicServingMessages._convert_system_message` in
//!   `vllm/entrypoints/anthropic/serving.py`: skips every `system` block
//!   whose `type` is `text` and whose `text` starts with
//!   `x-anthropic-billing-header` (a plain-string `system` is kept whole).
//! - Dynamo with `--strip-anthropic-preamble` (`DYN_STRIP_ANTHROPIC_PREAMBLE`),
//!   `strip_billing_preamble` in `lib/llm/src/http/service/anthropic.rs`:
//!   joins the blocks' texts with `\n` (`deserialize_system_prompt` in
//!   `lib/llm/src/protocols/anthropic/types.rs`), and when the result,
//!   leading whitespace trimmed, starts with `x-anthropic-billing-header:`
//!   and holds a newline, drops everything up to and including the first one.
//!
//! kvmesh leaves out what both leave out, and nothing else: `system` is an
//! array, its first element is a `text` block whose text starts with
//! `x-anthropic-billing-header:` and holds no newline (Dynamo would keep the
//! rest of a block that does), and a second element follows (without one,
//! Dynamo finds no newline and keeps it). That is exactly what Claude Code
//! sends. The block is out of the canonical stream always, and out of the
//! body sent upstream with `strip_preambles` (for engines that strip
//! nothing), so every engine then sees what the stream says.

use std::ops::Range;

use crate::canonical::json_string;
use crate::scan;

/// How the block's text starts (with the colon: Dynamo's test is the narrower).
const BILLING_PREFIX: &str = "x-anthropic-billing-header:";

/// The bytes to remove from `body` to strip the preamble of the `system`
/// value at `system`: its first element and everything up to the second
/// (separator and whitespace), so the array stays well formed. `None` when
/// the value has no preamble by the rule in the module doc.
pub(crate) fn billing_block(body: &[u8], system: Range<usize>) -> Option<Range<usize>> {
    if body.get(system.start) != Some(&b'[') {
        return None;
    }
    let mut elements: [Option<Range<usize>>; 2] = [None, None];
    let mut found = 0;
    // Only the first two elements are read; whatever follows is the
    // minifier's to check (a malformed rest fails the whole request).
    let _ = scan::for_each_element(body, system, |element| {
        if let Some(slot) = elements.get_mut(found) {
            *slot = Some(element);
        }
        found += 1;
        found < elements.len()
    });
    let [Some(first), Some(second)] = elements else {
        return None;
    };
    is_billing_text(body, first.clone()).then_some(first.start..second.start)
}

/// A `{"type":"text","text":"x-anthropic-billing-header:…"}` block whose
/// text holds no newline. Keys are compared as sent (an escaped spelling is
/// not recognised: the block then stays, which costs only sharing).
fn is_billing_text(body: &[u8], element: Range<usize>) -> bool {
    let (mut text_type, mut billing) = (false, false);
    // The last of duplicate keys counts, as in the engines' JSON parsers.
    let scanned = scan::for_each_member(body, element, |key, value| {
        let value = body.get(value).unwrap_or_default();
        match body.get(key).unwrap_or_default() {
            b"type" => text_type = value == b"\"text\"",
            // Decoded, so an escape in the text is read as the engine reads
            // it; a text that is not UTF-8 or not a string is no preamble.
            // One that cannot start with the prefix (its first character
            // neither `x` nor an escape) is not decoded: a long system
            // prompt first would be copied for nothing.
            b"text" => {
                billing = matches!(value.get(1), Some(b'x' | b'\\'))
                    && json_string(value).is_some_and(|t| t.starts_with(BILLING_PREFIX) && !t.contains('\n'));
            }
            _ => {}
        }
    });
    scanned.is_ok() && text_type && billing
}
