//! Figures over several seeds: the seed list a flag names, and the mean and
//! range of every figure of the per-seed results, in the same JSON shape.

use anyhow::{Context, bail};
use serde_json::{Value, json};

/// `1-5`, `1,4,7`, `3`, or a mix (`1-3,9`), in the order given.
pub(crate) fn parse_seeds(list: &str) -> anyhow::Result<Vec<u64>> {
    let mut seeds = Vec::new();
    for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let number = |s: &str| {
            s.trim()
                .parse::<u64>()
                .with_context(|| format!("--seeds: {s:?} is not a seed"))
        };
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (number(a)?, number(b)?);
                if b < a {
                    bail!("--seeds: the range {part:?} runs backwards");
                }
                if b - a >= 10_000 {
                    bail!("--seeds: the range {part:?} is over 10,000 seeds");
                }
                seeds.extend(a..=b);
            }
            None => seeds.push(number(part)?),
        }
    }
    if seeds.is_empty() {
        bail!("--seeds: no seed in {list:?}");
    }
    Ok(seeds)
}

/// The mean of each number across `values`, recursively through objects;
/// anything else (arrays, strings, nulls) is the first value's.
pub(crate) fn mean(values: &[Value]) -> Value {
    let Some(first) = values.first() else {
        return Value::Null;
    };
    match first {
        Value::Number(_) => {
            let numbers: Vec<f64> = values.iter().filter_map(Value::as_f64).collect();
            if numbers.len() == values.len() {
                json!(numbers.iter().sum::<f64>() / numbers.len() as f64)
            } else {
                first.clone()
            }
        }
        Value::Object(map) => Value::Object(
            map.keys()
                .map(|key| {
                    let each: Vec<Value> = values.iter().map(|v| v[key.as_str()].clone()).collect();
                    (key.clone(), mean(&each))
                })
                .collect(),
        ),
        _ => first.clone(),
    }
}

/// `[min, max]` of each number across `values`, recursively through
/// objects; what is not a number in every value is left out.
pub(crate) fn range(values: &[Value]) -> Value {
    let Some(first) = values.first() else {
        return Value::Null;
    };
    match first {
        Value::Number(_) => {
            let numbers: Vec<f64> = values.iter().filter_map(Value::as_f64).collect();
            if numbers.len() != values.len() {
                return Value::Null;
            }
            let min = numbers.iter().copied().fold(f64::INFINITY, f64::min);
            let max = numbers.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            json!([min, max])
        }
        Value::Object(map) => Value::Object(
            map.keys()
                .filter_map(|key| {
                    let each: Vec<Value> = values.iter().map(|v| v[key.as_str()].clone()).collect();
                    let r = range(&each);
                    let keep = match &r {
                        Value::Object(o) => !o.is_empty(),
                        Value::Null => false,
                        _ => true,
                    };
                    keep.then(|| (key.clone(), r))
                })
                .collect(),
        ),
        _ => Value::Null,
    }
}

/// A table cell: the mean, and with several seeds its `[min-max]`.
pub(crate) fn cell(result: &Value, key: &str, digits: usize, unit: &str, with_range: bool) -> String {
    let mean = result[key].as_f64().unwrap_or(0.0);
    let bounds = &result["range"][key];
    match (with_range, bounds[0].as_f64(), bounds[1].as_f64()) {
        (true, Some(lo), Some(hi)) => format!("{mean:.digits$}{unit} [{lo:.digits$}-{hi:.digits$}]"),
        _ => format!("{mean:.digits$}{unit}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_lists_and_ranges() {
        assert_eq!(parse_seeds("1-5").unwrap(), [1, 2, 3, 4, 5]);
        assert_eq!(parse_seeds("1,4,7").unwrap(), [1, 4, 7]);
        assert_eq!(parse_seeds("3").unwrap(), [3]);
        assert_eq!(parse_seeds("1-2, 9").unwrap(), [1, 2, 9]);
        assert!(parse_seeds("5-1").is_err());
        assert!(parse_seeds("x").is_err());
        assert!(parse_seeds("").is_err());
    }

    #[test]
    fn every_number_gets_its_mean_and_range() {
        let runs = [
            json!({"hit_rate": 0.9, "session_affinity": null, "insights": {"figures": {"a": 1}, "top": [1]}}),
            json!({"hit_rate": 0.7, "session_affinity": null, "insights": {"figures": {"a": 3}, "top": [2]}}),
        ];
        let m = mean(&runs);
        assert!((m["hit_rate"].as_f64().unwrap() - 0.8).abs() < 1e-12);
        assert_eq!(m["insights"]["figures"]["a"], json!(2.0));
        assert_eq!(m["insights"]["top"], json!([1]));
        assert!(m["session_affinity"].is_null());
        let r = range(&runs);
        assert_eq!(r["hit_rate"], json!([0.7, 0.9]));
        assert_eq!(r["insights"]["figures"]["a"], json!([1.0, 3.0]));
        assert!(r.get("session_affinity").is_none());
        assert!(r["insights"].get("top").is_none());
    }
}
