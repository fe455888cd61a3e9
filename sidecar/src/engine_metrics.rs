//! Reads an inference engine's Prometheus text exposition (vLLM, SGLang or
//! TensorRT-LLM) into an [`EngineSnapshot`]: the load, KV usage, KV capacity
//! and prefix-cache counters a router needs, under whichever names the
//! engine's version uses (docs: `shared/design/ENGINES.md`). Also owns the
//! rule that tells, from two snapshots, that the engine restarted.
//!
//! Pure: the caller fetches the text. Nothing here fails: lines it does not
//! understand are skipped, and a value it cannot find stays `None`.

use std::borrow::Cow;
use std::collections::HashMap;

/// The engine whose metric names a scrape follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineKind {
    Vllm,
    Sglang,
    Trtllm,
}

impl EngineKind {
    /// The engine whose naming `metric` follows, by its name's prefix.
    fn of_metric(metric: &str) -> Option<Self> {
        if metric.starts_with("vllm:") {
            Some(Self::Vllm)
        } else if metric.starts_with("sglang:") {
            Some(Self::Sglang)
        } else if metric.starts_with("trtllm_") {
            Some(Self::Trtllm)
        } else {
            None
        }
    }
}

/// What one scrape of an engine's metrics says, in engine-neutral terms.
/// Counters are cumulative since the engine started; see [`restarted`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineSnapshot {
    pub kind: Option<EngineKind>,
    /// Requests running.
    pub running: Option<f64>,
    /// Requests queued.
    pub waiting: Option<f64>,
    /// Share of the KV cache in use, 0..=1.
    pub kv_usage: Option<f64>,
    /// KV cache capacity in tokens.
    pub capacity_tokens: Option<u64>,
    pub block_size_tokens: Option<u64>,
    /// Counter: prompt tokens looked up in the prefix cache.
    pub prefix_queries_tokens: Option<f64>,
    /// Counter: prompt tokens served from the prefix cache.
    pub prefix_hits_tokens: Option<f64>,
    /// Counter: prompt tokens processed.
    pub prompt_tokens_total: Option<f64>,
    /// Unix seconds at which the engine's process started.
    pub process_start_time: Option<f64>,
}

/// Reads a Prometheus text exposition into a snapshot. Values of one metric
/// name are summed over its label sets (one series per data-parallel engine
/// or per cache source), except the usage share, which is averaged, and the
/// block size, which is one setting and not an amount.
pub fn parse(text: &str) -> EngineSnapshot {
    let mut kind = None;
    let mut metrics = Metrics::default();
    for sample in text.lines().filter_map(parse_line) {
        kind = kind.or_else(|| EngineKind::of_metric(sample.name));
        metrics.add(&sample);
    }
    let process_start_time = metrics.max(&["process_start_time_seconds"]);
    let snapshot = EngineSnapshot {
        kind,
        process_start_time,
        ..EngineSnapshot::default()
    };
    match kind {
        None => snapshot,
        Some(EngineKind::Vllm) => read_vllm(&metrics, snapshot),
        Some(EngineKind::Sglang) => read_sglang(&metrics, snapshot),
        Some(EngineKind::Trtllm) => read_trtllm(&metrics, snapshot),
    }
}

/// True when `now` shows a restart or cache reset since `before`: any of the
/// counters above went down, or process_start_time changed.
///
/// A field missing from either snapshot says nothing, so a first scrape (or
/// one of an engine that lacks the metric) never counts as a restart. A
/// cache reset that keeps the process (vLLM's `/reset_prefix_cache`,
/// SGLang's `/flush_cache`) leaves the counters growing, so it cannot be seen
/// here. The engine kind changing also counts: another engine now answers
/// at that address, with a cache of its own.
pub fn restarted(before: &EngineSnapshot, now: &EngineSnapshot) -> bool {
    let went_down = |was: Option<f64>, is: Option<f64>| matches!((was, is), (Some(was), Some(is)) if is < was);
    let counter_went_down = went_down(before.prefix_queries_tokens, now.prefix_queries_tokens)
        || went_down(before.prefix_hits_tokens, now.prefix_hits_tokens)
        || went_down(before.prompt_tokens_total, now.prompt_tokens_total);
    let start_time_changed = matches!(
        (before.process_start_time, now.process_start_time),
        (Some(was), Some(is)) if was != is
    );
    let kind_changed = matches!((before.kind, now.kind), (Some(was), Some(is)) if was != is);
    counter_went_down || start_time_changed || kind_changed
}

fn read_vllm(metrics: &Metrics<'_>, snapshot: EngineSnapshot) -> EngineSnapshot {
    // vLLM states its cache size only as labels of an info metric, one
    // series per engine; data-parallel engines each hold their own blocks.
    let mut capacity_tokens = None::<u64>;
    let mut block_size_tokens = None::<u64>;
    for config in &metrics.vllm_cache_configs {
        let (Some(blocks), Some(block_size)) = (config.num_gpu_blocks, config.block_size) else {
            // `num_gpu_blocks` is "None" until the engine has profiled memory.
            block_size_tokens = block_size_tokens.max(config.block_size);
            continue;
        };
        block_size_tokens = block_size_tokens.max(Some(block_size));
        if let Some(tokens) = blocks.checked_mul(block_size) {
            capacity_tokens = Some(capacity_tokens.unwrap_or(0).saturating_add(tokens));
        }
    }
    // Current names first: a version in transition may show the deprecated
    // ones as well, and summing both would count every token twice.
    // (0.7/0.8 counted the old prefix-cache counters in blocks, not tokens;
    // nothing in the text tells them apart.)
    EngineSnapshot {
        running: metrics.sum(&["vllm:num_requests_running"]),
        waiting: metrics.sum(&["vllm:num_requests_waiting"]),
        kv_usage: metrics.mean(&["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"]),
        capacity_tokens,
        block_size_tokens,
        prefix_queries_tokens: metrics.sum(&["vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"]),
        prefix_hits_tokens: metrics.sum(&["vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"]),
        prompt_tokens_total: metrics.sum(&["vllm:prompt_tokens_total"]),
        ..snapshot
    }
}

fn read_sglang(metrics: &Metrics<'_>, snapshot: EngineSnapshot) -> EngineSnapshot {
    // SGLang looks every prompt token up in its radix cache, so the prompt
    // tokens are also the prefix-cache queries.
    let prompt_tokens_total = metrics.sum(&["sglang:prompt_tokens_total"]);
    EngineSnapshot {
        running: metrics.sum(&["sglang:num_running_reqs"]),
        waiting: metrics.sum(&["sglang:num_queue_reqs"]),
        kv_usage: metrics.mean(&["sglang:token_usage"]),
        capacity_tokens: metrics.sum(&["sglang:max_total_num_tokens"]).and_then(whole_tokens),
        block_size_tokens: metrics.max(&["sglang:page_size"]).and_then(whole_tokens),
        prefix_queries_tokens: prompt_tokens_total,
        prefix_hits_tokens: metrics.sum(&["sglang:cached_tokens_total"]),
        prompt_tokens_total,
        ..snapshot
    }
}

fn read_trtllm(metrics: &Metrics<'_>, snapshot: EngineSnapshot) -> EngineSnapshot {
    let block_size_tokens = metrics
        .max(&["trtllm_kv_cache_tokens_per_block"])
        .and_then(whole_tokens);
    let max_blocks = metrics.sum(&["trtllm_kv_cache_max_blocks"]).and_then(whole_tokens);
    let capacity_tokens = max_blocks
        .zip(block_size_tokens)
        .and_then(|(blocks, block_size)| blocks.checked_mul(block_size));
    EngineSnapshot {
        running: metrics.sum(&["trtllm_num_requests_running"]),
        waiting: metrics.sum(&["trtllm_num_requests_waiting"]),
        kv_usage: metrics.mean(&["trtllm_kv_cache_utilization"]),
        capacity_tokens,
        block_size_tokens,
        prefix_hits_tokens: metrics.sum(&["trtllm_prompt_cached_tokens_total"]),
        ..snapshot
    }
}

/// A token or block count given as a float (Prometheus values all are).
fn whole_tokens(value: f64) -> Option<u64> {
    // Above 2^64 the cast would saturate and pass garbage off as a huge
    // cache; NaN and the infinities fall outside the range too.
    const LIMIT: f64 = 18_446_744_073_709_551_616.0;
    (0.0..LIMIT).contains(&value).then(|| value.round() as u64)
}

/// A count given as a label value: "16", or "16.0" from some exporters.
fn label_count(text: &str) -> Option<u64> {
    text.parse::<u64>()
        .ok()
        .or_else(|| text.parse::<f64>().ok().and_then(whole_tokens))
}

/// One metric name's values over all its label sets.
#[derive(Debug, Clone, Copy)]
struct Aggregate {
    sum: f64,
    max: f64,
    series: u32,
}

/// The cache settings one engine states in `vllm:cache_config_info`.
#[derive(Debug, Clone, Copy)]
struct VllmCacheConfig {
    num_gpu_blocks: Option<u64>,
    block_size: Option<u64>,
}

/// Every metric of one scrape, aggregated by name.
#[derive(Debug, Default)]
struct Metrics<'a> {
    by_name: HashMap<&'a str, Aggregate>,
    vllm_cache_configs: Vec<VllmCacheConfig>,
}

impl<'a> Metrics<'a> {
    fn add(&mut self, sample: &Sample<'a>) {
        if sample.name == "vllm:cache_config_info" {
            self.vllm_cache_configs.push(VllmCacheConfig {
                num_gpu_blocks: sample.label("num_gpu_blocks").and_then(label_count),
                block_size: sample.label("block_size").and_then(label_count),
            });
        }
        // A NaN or infinite value (an engine's gauge before its first
        // measurement) would poison every sum it joins; it is no reading.
        if !sample.value.is_finite() {
            return;
        }
        self.by_name
            .entry(sample.name)
            .and_modify(|aggregate| {
                aggregate.sum += sample.value;
                aggregate.max = aggregate.max.max(sample.value);
                aggregate.series += 1;
            })
            .or_insert(Aggregate {
                sum: sample.value,
                max: sample.value,
                series: 1,
            });
    }

    /// The first of `names` (current name, then older ones) that was scraped.
    fn first(&self, names: &[&str]) -> Option<Aggregate> {
        names.iter().find_map(|name| self.by_name.get(name).copied())
    }

    /// `None` when the sum overflowed: finite values near `f64::MAX` add up
    /// to infinity, which is no reading either (and would reach the
    /// router as an infinite queue).
    fn sum(&self, names: &[&str]) -> Option<f64> {
        self.first(names)
            .map(|aggregate| aggregate.sum)
            .filter(|sum| sum.is_finite())
    }

    fn mean(&self, names: &[&str]) -> Option<f64> {
        self.first(names)
            .map(|aggregate| aggregate.sum / f64::from(aggregate.series.max(1)))
            .filter(|mean| mean.is_finite())
    }

    fn max(&self, names: &[&str]) -> Option<f64> {
        self.first(names).map(|aggregate| aggregate.max)
    }
}

/// A label's name and its value, unescaped.
type Label<'a> = (&'a str, Cow<'a, str>);

/// One sample line: `name{label="value",…} value [timestamp]`.
#[derive(Debug, Clone, PartialEq)]
struct Sample<'a> {
    name: &'a str,
    labels: Vec<Label<'a>>,
    value: f64,
}

impl Sample<'_> {
    fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(label, _)| *label == name)
            .map(|(_, value)| value.as_ref())
    }
}

fn is_metric_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

fn is_label_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Parses one line of the text format; `None` for comments, blank lines and
/// anything malformed. The timestamp, and anything after it (OpenMetrics
/// exemplars), is ignored: only the latest value matters here.
fn parse_line(line: &str) -> Option<Sample<'_>> {
    let line = line.trim_start();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(|c: char| !is_metric_name_char(c)).unwrap_or(line.len());
    let (name, rest) = line.split_at(name_end);
    if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
        return None;
    }
    let rest = rest.trim_start();
    let (labels, rest) = match rest.strip_prefix('{') {
        Some(inside) => parse_labels(inside)?,
        None => (Vec::new(), rest),
    };
    let value = rest.split_ascii_whitespace().next()?.parse::<f64>().ok()?;
    Some(Sample { name, labels, value })
}

/// Parses the label pairs after `{` up to the closing `}`; returns them and
/// the text after the `}`. A `}` or `,` inside a quoted value is part of it.
fn parse_labels(input: &str) -> Option<(Vec<Label<'_>>, &str)> {
    let mut labels = Vec::new();
    let mut rest = input.trim_start();
    loop {
        if let Some(after) = rest.strip_prefix('}') {
            return Some((labels, after));
        }
        let name_end = rest.find(|c: char| !is_label_name_char(c))?;
        let (name, after_name) = rest.split_at(name_end);
        if name.is_empty() {
            return None;
        }
        let quoted = after_name
            .trim_start()
            .strip_prefix('=')?
            .trim_start()
            .strip_prefix('"')?;
        let (value, after_value) = parse_quoted(quoted)?;
        labels.push((name, value));
        rest = after_value.trim_start();
        if let Some(after_comma) = rest.strip_prefix(',') {
            // A trailing comma before `}` is allowed by the format.
            rest = after_comma.trim_start();
        } else if !rest.starts_with('}') {
            return None;
        }
    }
}

/// Reads a label value after its opening quote up to the closing one,
/// undoing the format's escapes (`\\`, `\"`, `\n`); returns the value and
/// the text after the closing quote, or `None` if the quote never closes.
/// Borrows the value unless it had an escape.
fn parse_quoted(input: &str) -> Option<(Cow<'_, str>, &str)> {
    let mut unescaped: Option<String> = None;
    let mut copied_up_to = 0;
    let mut chars = input.char_indices();
    while let Some((at, c)) = chars.next() {
        match c {
            '"' => {
                let tail = input.get(copied_up_to..at)?;
                let value = match unescaped {
                    None => Cow::Borrowed(tail),
                    Some(mut value) => {
                        value.push_str(tail);
                        Cow::Owned(value)
                    }
                };
                return Some((value, input.get(at + 1..)?));
            }
            '\\' => {
                let value = unescaped.get_or_insert_with(String::new);
                value.push_str(input.get(copied_up_to..at)?);
                let (_, escaped) = chars.next()?;
                match escaped {
                    'n' => value.push('\n'),
                    '\\' | '"' => value.push(escaped),
                    // Not an escape of the format: keep what was written.
                    other => {
                        value.push('\\');
                        value.push(other);
                    }
                }
                copied_up_to = at + 1 + escaped.len_utf8();
            }
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM 0.11+ with two data-parallel engines, as its `/metrics` shows
    /// them (trimmed: histograms cut to a few buckets).
    const VLLM: &str = r#"# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12345.0
python_gc_objects_collected_total{generation="1"} 678.0
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.76234567812e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-30B-A3B"} 3.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-30B-A3B"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-30B-A3B"} 1.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-30B-A3B"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-30B-A3B"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-30B-A3B"} 0.75
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-30B-A3B"} 12000.0
vllm:prefix_cache_queries_total{engine="1",model_name="Qwen/Qwen3-30B-A3B"} 8000.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-30B-A3B"} 9000.0
vllm:prefix_cache_hits_total{engine="1",model_name="Qwen/Qwen3-30B-A3B"} 6000.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="Qwen/Qwen3-30B-A3B"} 12000.0
vllm:prompt_tokens_total{engine="1",model_name="Qwen/Qwen3-30B-A3B"} 8000.0
vllm:prompt_tokens_created{engine="0",model_name="Qwen/Qwen3-30B-A3B"} 1.762345690e+09
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="Qwen/Qwen3-30B-A3B"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-30B-A3B"} 40.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="Qwen/Qwen3-30B-A3B"} 40.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="Qwen/Qwen3-30B-A3B"} 2.5
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="27000",prefix_caching_hash_algo="sha256"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",enable_prefix_caching="True",engine="1",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="25000",prefix_caching_hash_algo="sha256"} 1.0
"#;

    /// SGLang 0.5 with `--enable-metrics`.
    const SGLANG: &str = r#"# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 4.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 2.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 0.42
# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 452000.0
# HELP sglang:page_size The page size of the KV cache.
# TYPE sglang:page_size gauge
sglang:page_size{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 1.0
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 0.5
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 20000.0
# HELP sglang:cached_tokens_total Number of cached prompt tokens.
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{cache_source="device",model_name="meta-llama/Llama-3.1-8B-Instruct"} 9000.0
sglang:cached_tokens_total{cache_source="host",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1000.0
"#;

    /// `trtllm-serve`'s `/prometheus/metrics`.
    const TRTLLM: &str = "# HELP trtllm_num_requests_running Number of running requests\n\
# TYPE trtllm_num_requests_running gauge\n\
trtllm_num_requests_running{model_name=\"nvidia/Llama-3.1-8B-Instruct-FP8\"} 5.0\n\
# TYPE trtllm_num_requests_waiting gauge\n\
trtllm_num_requests_waiting{model_name=\"nvidia/Llama-3.1-8B-Instruct-FP8\"} 1.0\n\
# TYPE trtllm_kv_cache_utilization gauge\n\
trtllm_kv_cache_utilization{model_name=\"nvidia/Llama-3.1-8B-Instruct-FP8\"} 0.3\n\
trtllm_kv_cache_max_blocks{model_name=\"nvidia/Llama-3.1-8B-Instruct-FP8\"} 4096.0\n\
trtllm_kv_cache_free_blocks{model_name=\"nvidia/Llama-3.1-8B-Instruct-FP8\"} 2867.0\n\
trtllm_kv_cache_used_blocks{model_name=\"nvidia/Llama-3.1-8B-Instruct-FP8\"} 1229.0\n\
trtllm_kv_cache_tokens_per_block{model_name=\"nvidia/Llama-3.1-8B-Instruct-FP8\"} 32.0\n\
trtllm_kv_cache_hit_rate{model_name=\"nvidia/Llama-3.1-8B-Instruct-FP8\"} 0.6\n\
# TYPE trtllm_prompt_cached_tokens_total counter\n\
trtllm_prompt_cached_tokens_total{model_name=\"nvidia/Llama-3.1-8B-Instruct-FP8\"} 7000.0\n\
process_start_time_seconds 1762345000.5\n";

    /// vLLM 0.8, before the KV metrics were renamed.
    const VLLM_OLD_NAMES: &str = r#"# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
vllm:num_requests_waiting{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:gpu_cache_usage_perc{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.5
vllm:gpu_prefix_cache_queries_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
vllm:gpu_prefix_cache_hits_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 40.0
vllm:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 1600.0
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",num_gpu_blocks="1000"} 1.0
"#;

    #[test]
    fn vllm_sums_engines_and_reads_cache_config() {
        let snapshot = parse(VLLM);
        assert_eq!(
            snapshot,
            EngineSnapshot {
                kind: Some(EngineKind::Vllm),
                running: Some(5.0),
                waiting: Some(1.0),
                kv_usage: Some(0.5),
                capacity_tokens: Some((27_000 + 25_000) * 16),
                block_size_tokens: Some(16),
                prefix_queries_tokens: Some(20_000.0),
                prefix_hits_tokens: Some(15_000.0),
                prompt_tokens_total: Some(20_000.0),
                process_start_time: Some(1_762_345_678.12),
            }
        );
    }

    #[test]
    fn sglang_sums_cache_sources_and_uses_prompt_tokens_as_queries() {
        assert_eq!(
            parse(SGLANG),
            EngineSnapshot {
                kind: Some(EngineKind::Sglang),
                running: Some(4.0),
                waiting: Some(2.0),
                kv_usage: Some(0.42),
                capacity_tokens: Some(452_000),
                block_size_tokens: Some(1),
                prefix_queries_tokens: Some(20_000.0),
                prefix_hits_tokens: Some(10_000.0),
                prompt_tokens_total: Some(20_000.0),
                process_start_time: None,
            }
        );
    }

    #[test]
    fn trtllm_capacity_is_blocks_times_tokens_per_block() {
        assert_eq!(
            parse(TRTLLM),
            EngineSnapshot {
                kind: Some(EngineKind::Trtllm),
                running: Some(5.0),
                waiting: Some(1.0),
                kv_usage: Some(0.3),
                capacity_tokens: Some(4096 * 32),
                block_size_tokens: Some(32),
                prefix_queries_tokens: None,
                prefix_hits_tokens: Some(7000.0),
                prompt_tokens_total: None,
                process_start_time: Some(1_762_345_000.5),
            }
        );
    }

    #[test]
    fn vllm_old_names_are_read() {
        assert_eq!(
            parse(VLLM_OLD_NAMES),
            EngineSnapshot {
                kind: Some(EngineKind::Vllm),
                running: Some(1.0),
                waiting: Some(0.0),
                kv_usage: Some(0.5),
                capacity_tokens: Some(16_000),
                block_size_tokens: Some(16),
                prefix_queries_tokens: Some(100.0),
                prefix_hits_tokens: Some(40.0),
                prompt_tokens_total: Some(1600.0),
                process_start_time: None,
            }
        );
    }

    #[test]
    fn vllm_current_name_wins_over_a_deprecated_one_shown_beside_it() {
        let text = "vllm:kv_cache_usage_perc 0.2\nvllm:gpu_cache_usage_perc 0.9\n\
                    vllm:gpu_prefix_cache_hits_total 7\nvllm:prefix_cache_hits_total 70\n";
        let snapshot = parse(text);
        assert_eq!(snapshot.kv_usage, Some(0.2));
        assert_eq!(snapshot.prefix_hits_tokens, Some(70.0));
    }

    #[test]
    fn vllm_cache_config_before_profiling_has_no_capacity() {
        let snapshot = parse(r#"vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0"#);
        assert_eq!(snapshot.kind, Some(EngineKind::Vllm));
        assert_eq!(snapshot.capacity_tokens, None);
        assert_eq!(snapshot.block_size_tokens, Some(16));
    }

    #[test]
    fn labels_with_quotes_braces_commas_and_escapes() {
        let line = r#"vllm:num_requests_running{model_name="org/m \"v2\" {x}, y",path="C:\\models\\m",note="a\nb",} 3 1700000000000"#;
        let sample = parse_line(line);
        let expected = Sample {
            name: "vllm:num_requests_running",
            labels: vec![
                ("model_name", Cow::Owned("org/m \"v2\" {x}, y".to_owned())),
                ("path", Cow::Owned("C:\\models\\m".to_owned())),
                ("note", Cow::Owned("a\nb".to_owned())),
            ],
            value: 3.0,
        };
        assert_eq!(sample, Some(expected));
    }

    #[test]
    fn line_forms() {
        let value = |line: &str| parse_line(line).map(|sample| sample.value);
        assert_eq!(value("up 1"), Some(1.0));
        assert_eq!(value("  up\t2.5e3  "), Some(2500.0));
        assert_eq!(value("up{} 1"), Some(1.0));
        assert_eq!(value("up { a = \"b\" } 4"), Some(4.0));
        assert_eq!(value("up +Inf"), Some(f64::INFINITY));
        assert_eq!(value("up -Inf"), Some(f64::NEG_INFINITY));
        assert!(value("up NaN").is_some_and(f64::is_nan));
        assert_eq!(value("# TYPE up gauge"), None);
        assert_eq!(value(""), None);
        assert_eq!(value("up"), None);
        assert_eq!(value("up{a=\"b\"}"), None);
        assert_eq!(value("up abc"), None);
        assert_eq!(value("9up 1"), None);
        assert_eq!(value("up{a=b} 1"), None);
        assert_eq!(value("up{a=\"b\" c=\"d\"} 1"), None);
        assert_eq!(value("up{a=\"unterminated} 1"), None);
        assert_eq!(value("up{a=\"b\"\\"), None);
        assert_eq!(value("up{=\"b\"} 1"), None);
    }

    #[test]
    fn non_finite_values_are_no_reading() {
        let snapshot = parse(
            "vllm:kv_cache_usage_perc NaN\nvllm:num_requests_running{engine=\"0\"} +Inf\n\
             vllm:num_requests_running{engine=\"1\"} 2\n",
        );
        assert_eq!(snapshot.kv_usage, None);
        assert_eq!(snapshot.running, Some(2.0));
    }

    #[test]
    fn sums_that_overflow_are_no_reading() {
        let snapshot = parse(
            "vllm:num_requests_waiting{engine=\"0\"} 1e308\nvllm:num_requests_waiting{engine=\"1\"} 1e308\n\
             vllm:kv_cache_usage_perc{engine=\"0\"} 1.7e308\nvllm:kv_cache_usage_perc{engine=\"1\"} 1.7e308\n",
        );
        assert_eq!((snapshot.waiting, snapshot.kv_usage), (None, None));
    }

    #[test]
    fn impossible_counts_are_dropped() {
        let snapshot = parse("sglang:max_total_num_tokens -5\nsglang:page_size 1e30\n");
        assert_eq!(snapshot.capacity_tokens, None);
        assert_eq!(snapshot.block_size_tokens, None);
        let overflow = parse(r#"vllm:cache_config_info{block_size="18446744073709551615",num_gpu_blocks="2"} 1"#);
        assert_eq!(overflow.capacity_tokens, None);
    }

    #[test]
    fn garbage_gives_an_empty_snapshot() {
        for text in [
            "",
            "\n\n\n",
            "<html><body>502 Bad Gateway</body></html>",
            "{\"object\":\"error\",\"message\":\"not found\"}",
            "{{{{}}}} \"\"\" \\\\ ===",
            "vllm:\u{0}\u{7f}{\u{1f600}=\"\u{1f600}\"} \u{1f600}",
            "\u{feff}\r\n\r\n",
        ] {
            assert_eq!(parse(text), EngineSnapshot::default(), "{text:?}");
        }
    }

    #[test]
    fn arbitrary_text_never_panics() {
        // Deterministic xorshift over an alphabet dense in the format's own
        // punctuation, so most inputs get deep into the label parser.
        const ALPHABET: &[char] = &[
            'v',
            'l',
            'm',
            ':',
            '_',
            '{',
            '}',
            '"',
            '\\',
            '=',
            ',',
            ' ',
            '\n',
            '#',
            '1',
            '.',
            'e',
            '+',
            '-',
            'N',
            'a',
            'I',
            'n',
            'f',
            'é',
            '\u{1f600}',
            '\t',
            '\r',
        ];
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let prefixes = ["", "vllm:cache_config_info{", "sglang:page_size{a=\"", "trtllm_x "];
        for round in 0..5000 {
            let mut text = prefixes[round % prefixes.len()].to_owned();
            let len = next() % 80;
            for _ in 0..len {
                text.push(ALPHABET[(next() % ALPHABET.len() as u64) as usize]);
            }
            let _ = parse(&text);
        }
    }

    fn counters(queries: f64, hits: f64, prompt: f64, start: f64) -> EngineSnapshot {
        EngineSnapshot {
            kind: Some(EngineKind::Vllm),
            prefix_queries_tokens: Some(queries),
            prefix_hits_tokens: Some(hits),
            prompt_tokens_total: Some(prompt),
            process_start_time: Some(start),
            ..EngineSnapshot::default()
        }
    }

    #[test]
    fn restart_when_a_counter_goes_down() {
        let before = counters(1000.0, 800.0, 1000.0, 100.0);
        assert!(restarted(&before, &counters(10.0, 800.0, 1000.0, 100.0)));
        assert!(restarted(&before, &counters(1000.0, 0.0, 1000.0, 100.0)));
        assert!(restarted(&before, &counters(1000.0, 800.0, 999.0, 100.0)));
    }

    #[test]
    fn restart_when_the_start_time_changes() {
        let before = counters(1000.0, 800.0, 1000.0, 100.0);
        assert!(restarted(&before, &counters(1000.0, 800.0, 1000.0, 200.0)));
        // A restart that already served more than before still shows.
        assert!(restarted(&before, &counters(5000.0, 4000.0, 5000.0, 200.0)));
    }

    #[test]
    fn no_restart_while_counters_grow_or_stand_still() {
        let before = counters(1000.0, 800.0, 1000.0, 100.0);
        assert!(!restarted(&before, &before));
        assert!(!restarted(&before, &counters(1500.0, 900.0, 1500.0, 100.0)));
        assert!(!restarted(&parse(VLLM), &parse(VLLM)));
    }

    #[test]
    fn missing_fields_say_nothing() {
        let full = counters(1000.0, 800.0, 1000.0, 100.0);
        assert!(!restarted(&EngineSnapshot::default(), &full));
        assert!(!restarted(&full, &EngineSnapshot::default()));
        // SGLang has no start time: only its counters can show a restart.
        let sglang = parse(SGLANG);
        assert!(!restarted(&EngineSnapshot::default(), &sglang));
        let mut after_restart = sglang.clone();
        after_restart.prefix_hits_tokens = Some(0.0);
        after_restart.prompt_tokens_total = Some(0.0);
        after_restart.prefix_queries_tokens = Some(0.0);
        assert!(restarted(&sglang, &after_restart));
    }

    #[test]
    fn restart_when_another_engine_answers() {
        let vllm = EngineSnapshot {
            kind: Some(EngineKind::Vllm),
            ..EngineSnapshot::default()
        };
        let sglang = EngineSnapshot {
            kind: Some(EngineKind::Sglang),
            ..EngineSnapshot::default()
        };
        assert!(restarted(&vllm, &sglang));
    }
}
