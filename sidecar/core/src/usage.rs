//! Whether an engine's `usage` can be believed. A worker (or anything that
//! can send an Outcome) reports the figures; a counter or a learned rate fed
//! `u64::MAX` once is wrong for good, so implausible usage is dropped whole.

use kvmesh_vocab::limits::MAX_PROMPT_TOKENS;

/// Tokens an engine may count beyond one per byte of the canonical stream:
/// its chat template (role markers, tool-call scaffolding) is not in the
/// stream kvmesh hashes. A byte-level tokenizer gives at most about one
/// token per byte, so a prompt of `b` bytes holds at most `b` + this.
pub const TEMPLATE_TOKENS: u64 = 4096;

/// The most prompt bytes one token is believed to stand for: learned bytes
/// per token are clamped to 1..=this (a token is at least a byte, and no
/// tokenizer's average token is longer than a few words).
pub const MAX_BYTES_PER_TOKEN: u64 = 16;

/// Why a usage report was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum UsageError {
    #[error("prompt_tokens {0} is over MAX_PROMPT_TOKENS")]
    PromptOverLimit(u64),
    #[error("prompt_tokens {tokens} is more than a prompt of {bytes} bytes can hold")]
    PromptOverPick { tokens: u64, bytes: u64 },
    #[error("cached_tokens {cached} is over prompt_tokens {prompt}")]
    CachedOverPrompt { cached: u64, prompt: u64 },
}

impl UsageError {
    /// A metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::PromptOverLimit(_) => "prompt_over_limit",
            Self::PromptOverPick { .. } => "prompt_over_pick",
            Self::CachedOverPrompt { .. } => "cached_over_prompt",
        }
    }
}

/// Checks one report's usage. `prompt_bytes` is the canonical stream of
/// its Pick when that Pick is known and covered the whole prompt (`None`
/// for an unknown pick or a truncated one: only the absolute bounds apply).
pub fn check_usage(
    prompt_bytes: Option<u64>,
    prompt_tokens: Option<u64>,
    cached_tokens: Option<u64>,
) -> Result<(), UsageError> {
    for tokens in [prompt_tokens, cached_tokens].into_iter().flatten() {
        if tokens > MAX_PROMPT_TOKENS {
            return Err(UsageError::PromptOverLimit(tokens));
        }
    }
    if let (Some(tokens), Some(bytes)) = (prompt_tokens, prompt_bytes)
        && tokens > bytes.saturating_add(TEMPLATE_TOKENS)
    {
        return Err(UsageError::PromptOverPick { tokens, bytes });
    }
    if let (Some(cached), Some(prompt)) = (cached_tokens, prompt_tokens)
        && cached > prompt
    {
        return Err(UsageError::CachedOverPrompt { cached, prompt });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_beyond_the_bounds_is_refused_and_plausible_usage_passes() {
        assert_eq!(check_usage(Some(4000), Some(1200), Some(1000)), Ok(()));
        assert_eq!(check_usage(None, None, None), Ok(()));
        assert_eq!(
            check_usage(None, Some(u64::MAX), None),
            Err(UsageError::PromptOverLimit(u64::MAX))
        );
        assert_eq!(
            check_usage(None, None, Some(u64::MAX)),
            Err(UsageError::PromptOverLimit(u64::MAX))
        );
        assert_eq!(
            check_usage(Some(100), Some(100 + TEMPLATE_TOKENS + 1), None),
            Err(UsageError::PromptOverPick {
                tokens: 100 + TEMPLATE_TOKENS + 1,
                bytes: 100
            })
        );
        assert_eq!(
            check_usage(Some(4000), Some(10), Some(11)),
            Err(UsageError::CachedOverPrompt { cached: 11, prompt: 10 })
        );
    }
}
