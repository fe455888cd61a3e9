//! Workloads for the simulator, loaded from public traces: Mooncake's
//! block-id traces (text synthesized per block id, so equal ids give equal
//! text) and recorded agent sessions as text (tau-bench).

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, bail};
use serde_json::Value;

/// One request of a workload.
#[derive(Debug, Clone)]
pub(crate) struct Request {
    /// Arrival time, ms from the start of the workload.
    pub(crate) at_ms: f64,
    /// Empty for traces without sessions.
    pub(crate) session: String,
    pub(crate) parent: String,
    /// The whole prompt as text (as the harness would send it).
    pub(crate) text: String,
    pub(crate) output_tokens: u32,
    /// The session ends with this call (sent as `x-dynamo-session-final`).
    pub(crate) session_final: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Format {
    Auto,
    Mooncake,
    Text,
}

/// A recorded completion of N bytes is asked for as N / 4 output tokens
/// (the call's `max_tokens`), by `replay` and `simulate` alike: a property
/// of the workload, which the real-engine comparison sent so, not of any
/// tokenizer.
const COMPLETION_BYTES_PER_TOKEN: usize = 4;

/// Words that are one token each in the simulated engine's vocabulary, and
/// stay one token each in any sequence (each starts with the space the
/// BPE's pre-tokenizer cuts at): a block of N of them is N engine tokens,
/// as a Mooncake block of N tokens should be.
const WORDS: [&str; 16] = [
    " cache", " route", " agent", " tool", " call", " token", " block", " prefix", " model", " worker", " batch",
    " decode", " session", " request", " engine", " router",
];

/// Deterministic text for one Mooncake block id, `tokens` words long
/// (equal ids, equal text), and where each word ends in it.
fn block_text(id: u64, tokens: usize) -> (String, Vec<usize>) {
    let mut out = String::with_capacity(tokens * 8);
    let mut ends = Vec::with_capacity(tokens);
    let mut state = id.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for _ in 0..tokens {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.push_str(WORDS[(state % 16) as usize]);
        ends.push(out.len());
    }
    (out, ends)
}

fn load_mooncake(path: &Path, block_tokens: usize) -> anyhow::Result<Vec<Request>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut requests = Vec::new();
    let mut cache: HashMap<u64, (String, Vec<usize>)> = HashMap::new();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).with_context(|| format!("line {}", n + 1))?;
        let ids = v["hash_ids"]
            .as_array()
            .with_context(|| format!("line {}: no hash_ids", n + 1))?;
        let input = v["input_length"].as_u64().unwrap_or(0) as usize;
        let mut prompt = String::new();
        for (i, id) in ids.iter().enumerate() {
            let id = id.as_u64().unwrap_or(0);
            // The last block may be partial: only its first tokens.
            let tokens = if i + 1 == ids.len() {
                input.saturating_sub(i * block_tokens).clamp(1, block_tokens)
            } else {
                block_tokens
            };
            let (full, ends) = cache.entry(id).or_insert_with(|| block_text(id, block_tokens));
            let end = ends.get(tokens.saturating_sub(1)).copied().unwrap_or(full.len());
            prompt.push_str(&full[..end]);
        }
        requests.push(Request {
            at_ms: v["timestamp"].as_f64().unwrap_or(0.0),
            session: String::new(),
            parent: String::new(),
            session_final: false,
            text: prompt,
            output_tokens: u32::try_from(v["output_length"].as_u64().unwrap_or(1))
                .unwrap_or(u32::MAX)
                .max(1),
        });
    }
    Ok(requests)
}

fn load_text_file(path: &Path, out: &mut Vec<Request>) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).with_context(|| format!("{}:{}", path.display(), n + 1))?;
        let input = v["input"]
            .as_str()
            .with_context(|| format!("{}:{}: no input", path.display(), n + 1))?;
        let output = v["output"].as_str().unwrap_or_default();
        out.push(Request {
            // Recorded in µs.
            at_ms: v["timestamp"].as_f64().unwrap_or(0.0) / 1000.0,
            session: v["session_id"].as_str().unwrap_or_default().to_owned(),
            parent: v["parent_session_id"].as_str().unwrap_or_default().to_owned(),
            session_final: v["session_final"].as_bool().unwrap_or(false),
            text: input.to_owned(),
            output_tokens: u32::try_from((output.len() / COMPLETION_BYTES_PER_TOKEN).max(1)).unwrap_or(u32::MAX),
        });
    }
    Ok(())
}

fn load_text(path: &Path) -> anyhow::Result<Vec<Request>> {
    let mut requests = Vec::new();
    if path.is_dir() {
        let mut files: Vec<_> = std::fs::read_dir(path)?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "jsonl"))
            .collect();
        files.sort();
        for file in files {
            load_text_file(&file, &mut requests)?;
        }
    } else {
        load_text_file(path, &mut requests)?;
    }
    Ok(requests)
}

fn detect(path: &Path) -> anyhow::Result<Format> {
    let sample = if path.is_dir() {
        let first = std::fs::read_dir(path)?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|e| e == "jsonl") && p.metadata().is_ok_and(|m| m.len() > 0))
            .with_context(|| format!("no .jsonl file in {}", path.display()))?;
        std::fs::read_to_string(first)?
    } else {
        std::fs::read_to_string(path)?
    };
    let line = sample.lines().find(|l| !l.trim().is_empty()).unwrap_or_default();
    let v: Value = serde_json::from_str(line).context("the trace's first line is not JSON")?;
    if v.get("hash_ids").is_some() {
        Ok(Format::Mooncake)
    } else if v.get("input").is_some() {
        Ok(Format::Text)
    } else {
        bail!("cannot tell the trace's format: give --format")
    }
}

/// How to read a workload: the flags `simulate` and `replay` share.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct WorkloadArgs {
    /// A trace file or directory.
    #[arg(long)]
    pub(crate) trace: std::path::PathBuf,
    #[arg(long, value_enum, default_value = "auto")]
    pub(crate) format: Format,
    /// Arrival times divided by this (2 = twice the load).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) speed: f64,
    /// Mooncake block size in tokens.
    #[arg(long, default_value_t = 512)]
    pub(crate) block_tokens: usize,
    /// Start root sessions this many ms apart (for traces recorded one
    /// session after another).
    #[arg(long)]
    pub(crate) session_spacing_ms: Option<f64>,
    /// Use only the first N requests.
    #[arg(long)]
    pub(crate) limit: Option<usize>,
}

impl WorkloadArgs {
    /// The workload these flags describe, and its format.
    pub(crate) fn load(&self) -> anyhow::Result<(Format, Vec<Request>)> {
        let (format, mut requests) = load(
            &self.trace,
            self.format,
            self.block_tokens,
            self.speed,
            self.session_spacing_ms,
        )?;
        if let Some(limit) = self.limit {
            requests.truncate(limit);
        }
        if requests.is_empty() {
            bail!("{} holds no requests", self.trace.display());
        }
        Ok((format, requests))
    }
}

/// Loads a workload, sorted by arrival, times from 0, divided by `speed`;
/// with `session_spacing_ms`, root sessions start that far apart (children
/// move with their parent).
pub(crate) fn load(
    path: &Path,
    format: Format,
    block_tokens: usize,
    speed: f64,
    session_spacing_ms: Option<f64>,
) -> anyhow::Result<(Format, Vec<Request>)> {
    let format = if format == Format::Auto { detect(path)? } else { format };
    let mut requests = match format {
        Format::Mooncake => load_mooncake(path, block_tokens)?,
        Format::Text | Format::Auto => load_text(path)?,
    };
    if let Some(spacing) = session_spacing_ms {
        // Each root session keeps its own timing, shifted to start at k·spacing.
        let mut roots: Vec<(f64, String)> = Vec::new();
        let mut start: HashMap<String, f64> = HashMap::new();
        for r in &requests {
            let root = if r.parent.is_empty() { &r.session } else { &r.parent };
            let e = start.entry(root.clone()).or_insert(r.at_ms);
            *e = e.min(r.at_ms);
        }
        for (s, t) in &start {
            roots.push((*t, s.clone()));
        }
        roots.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let offset: HashMap<String, f64> = roots
            .iter()
            .enumerate()
            .map(|(k, (t, s))| (s.clone(), k as f64 * spacing - t))
            .collect();
        for r in &mut requests {
            let root = if r.parent.is_empty() {
                r.session.clone()
            } else {
                r.parent.clone()
            };
            r.at_ms += offset.get(&root).copied().unwrap_or(0.0);
        }
    }
    requests.sort_by(|a, b| a.at_ms.total_cmp(&b.at_ms));
    let t0 = requests.first().map_or(0.0, |r| r.at_ms);
    for r in &mut requests {
        r.at_ms = (r.at_ms - t0) / speed.max(1e-9);
    }
    Ok((format, requests))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_block_ids_give_equal_text_of_as_many_engine_tokens() {
        assert_eq!(block_text(7, 512), block_text(7, 512));
        assert_ne!(block_text(7, 512).0, block_text(8, 512).0);
        // A block is as many tokens as it stands for, alone and in a row
        // of blocks, under the simulated engine's tokenizer.
        let mut tokenizer = kvmesh_sim::tokenizer::Tokenizer::new().unwrap();
        assert_eq!(tokenizer.encode(block_text(7, 512).0.as_bytes()).len(), 512);
        let row: String = (0..5).map(|id| block_text(id, 512).0).collect();
        assert_eq!(tokenizer.encode(row.as_bytes()).len(), 5 * 512);
    }
}
