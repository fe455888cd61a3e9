//! `kvmesh-bench gen-agents`: a seeded generator of coding-agent sessions
//! in the simulator's text format (one JSON line per model call, as the
//! tau-bench traces): a large shared system + tools prefix in a few
//! variants, a per-session repository context, turns that each append a
//! tool call and its result, think and tool gaps, and subagent fan-out
//! whose children either share only the system prefix or fork the parent's
//! whole context.

use std::io::Write;
use std::path::PathBuf;

use serde_json::json;

#[derive(Debug, clap::Args)]
pub(crate) struct Options {
    #[arg(long, default_value_t = 32)]
    sessions: usize,
    /// Calls per root session.
    #[arg(long, default_value_t = 20)]
    turns: usize,
    /// Subagents spawned by each root session, in one fan-out.
    #[arg(long, default_value_t = 4)]
    subagents: usize,
    /// Calls per subagent.
    #[arg(long, default_value_t = 6)]
    subagent_turns: usize,
    /// Distinct system prompts (harness and version mix).
    #[arg(long, default_value_t = 3)]
    system_variants: usize,
    /// Mean ms between root session starts.
    #[arg(long, default_value_t = 2000.0)]
    arrival_ms: f64,
    /// Multiplies every text length (system prompt, repository, turns,
    /// tool results): 0.1 gives prompts a tenth as long, for engines that
    /// prefill on a CPU.
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// Share of tool calls that wait long (a build, a test suite, a human
    /// approving): their wait is exponential with mean `--long-tool-ms`.
    #[arg(long, default_value_t = 0.0)]
    long_tool_share: f64,
    #[arg(long, default_value_t = 60_000.0)]
    long_tool_ms: f64,
    /// Share of root sessions that stop early, after a uniform number of
    /// turns (their subagents with them, if before the fan-out).
    #[arg(long, default_value_t = 0.0)]
    early_end_share: f64,
    /// Share of sessions (roots and subagents) whose last call says it is
    /// the last (`"session_final": true`, sent as `x-dynamo-session-final`).
    #[arg(long, default_value_t = 0.0)]
    final_share: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Output file (stdout without it).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// With the default shares of 0 no random number is drawn for them, so
/// traces made before these options existed stay the same.
fn chance(rng: &mut Rng, share: f64) -> bool {
    share > 0.0 && ((rng.next() >> 11) as f64 / (1u64 << 53) as f64) < share
}

/// xorshift64*: seeded and reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// Exponential with the given mean (think and tool gaps).
    fn exp(&mut self, mean: f64) -> f64 {
        let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        -mean * (1.0 - u).max(1e-12).ln()
    }
}

fn words(rng: &mut Rng, n: usize, vocab: &[&str]) -> String {
    (0..n)
        .map(|_| vocab[rng.below(vocab.len() as u64) as usize])
        .collect::<Vec<_>>()
        .join(" ")
}

const CODE: &[&str] = &[
    "fn",
    "let",
    "mut",
    "impl",
    "match",
    "Some(x)",
    "None",
    "self.cache",
    "return",
    "Ok(())",
    "pub struct",
    "async",
    "await",
    "if",
    "else",
    "for",
    "in",
    "vec![]",
    "String::new()",
    "=>",
    "{",
    "}",
    ";",
];
const PROSE: &[&str] = &[
    "the", "agent", "must", "read", "files", "before", "editing", "them", "and", "run", "tests", "after", "each",
    "change", "keep", "diffs", "small", "explain", "why", "use", "tools",
];

struct Line {
    at_ms: f64,
    input: String,
    output: String,
    session: String,
    parent: Option<String>,
    session_final: bool,
}

pub(crate) fn run(o: Options) -> anyhow::Result<()> {
    let mut rng = Rng(o.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let n = |words: usize| ((words as f64 * o.scale).round() as usize).max(1);
    // Shared prefixes: system prompt and tool schemas, ~6k tokens each.
    let systems: Vec<String> = (0..o.system_variants.max(1))
        .map(|v| {
            format!(
                "<system variant {v}>\n{}\n<tools>\n{}\n",
                words(&mut rng, n(2500), PROSE),
                words(&mut rng, n(3500), CODE)
            )
        })
        .collect();
    let mut lines = Vec::new();
    let mut start = 0.0;
    for s in 0..o.sessions {
        start += rng.exp(o.arrival_ms);
        let session = format!("gen-{}-{s}", o.seed);
        let system = &systems[rng.below(systems.len() as u64) as usize];
        let mut context = format!("{system}<repo session {s}>\n{}\n", words(&mut rng, n(1500), CODE));
        let mut at = start;
        let fan_out_at = o.turns / 2;
        let turns = if chance(&mut rng, o.early_end_share) {
            1 + rng.below(o.turns.saturating_sub(1) as u64) as usize
        } else {
            o.turns
        };
        let says_final = chance(&mut rng, o.final_share);
        for turn in 0..turns {
            context.push_str(&format!("<user turn {turn}> {}\n", words(&mut rng, n(40), PROSE)));
            let output = format!("<tool_call read_file src/m{turn}.rs> {}", words(&mut rng, n(30), PROSE));
            lines.push(Line {
                at_ms: at,
                input: context.clone(),
                output: output.clone(),
                session: session.clone(),
                parent: None,
                session_final: says_final && turn + 1 == turns,
            });
            // Think time, then the tool's own time (drawn in this order).
            let think_ms = rng.exp(1500.0);
            let tool_ms = if chance(&mut rng, o.long_tool_share) {
                rng.exp(o.long_tool_ms)
            } else {
                rng.exp(800.0)
            };
            at += think_ms + tool_ms;
            let result_words = n(300 + rng.below(600) as usize);
            context.push_str(&format!(
                "{output}\n<tool_result>\n{}\n",
                words(&mut rng, result_words, CODE)
            ));
            if turn == fan_out_at {
                // Parallel subagents: half fork the whole context, half
                // start from the system prompt with their own task.
                for k in 0..o.subagents {
                    let child = format!("{session}-sub{k}");
                    let mut child_context = if k % 2 == 0 {
                        context.clone()
                    } else {
                        format!("{system}<subagent task {k}> {}\n", words(&mut rng, n(200), PROSE))
                    };
                    let mut child_at = at + rng.exp(50.0);
                    let child_final = chance(&mut rng, o.final_share);
                    for t in 0..o.subagent_turns {
                        let output = format!("<tool_call grep {t}> {}", words(&mut rng, n(20), PROSE));
                        lines.push(Line {
                            at_ms: child_at,
                            input: child_context.clone(),
                            output: output.clone(),
                            session: child.clone(),
                            parent: Some(session.clone()),
                            session_final: child_final && t + 1 == o.subagent_turns,
                        });
                        child_at += rng.exp(600.0) + rng.exp(300.0);
                        child_context
                            .push_str(&format!("{output}\n<tool_result>\n{}\n", words(&mut rng, n(200), CODE)));
                    }
                }
            }
        }
    }
    lines.sort_by(|a, b| a.at_ms.total_cmp(&b.at_ms));
    let mut out: Box<dyn Write> = match &o.out {
        Some(path) => Box::new(std::io::BufWriter::new(std::fs::File::create(path)?)),
        None => Box::new(std::io::stdout().lock()),
    };
    for l in &lines {
        let mut v = json!({"timestamp": (l.at_ms * 1000.0).round() as u64, "input": l.input, "output": l.output, "session_id": l.session});
        if let Some(parent) = &l.parent {
            v["parent_session_id"] = json!(parent);
        }
        if l.session_final {
            v["session_final"] = json!(true);
        }
        writeln!(out, "{v}")?;
    }
    out.flush()?;
    Ok(())
}
