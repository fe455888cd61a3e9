//! The scanner against serde_json: on any JSON value, however it is
//! formatted, minifying (with keys dropped) gives the same value serde_json
//! sees with those keys removed; and it never panics on arbitrary bytes.

use proptest::prelude::*;
use serde_json::Value;

use crate::scan::{self, ScanError};

fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        // Exact binary fractions: serde_json's own float parsing does not
        // round-trip every f64, and that is not what is tested here.
        any::<i32>().prop_map(|n| Value::from(f64::from(n) / 8.0)),
        ".{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(6, 64, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec(
                (prop_oneof!["[a-z]{1,6}", Just("cache_control".to_owned())], inner),
                0..6
            )
            .prop_map(|members| Value::Object(members.into_iter().collect())),
        ]
    })
}

fn without(value: &Value, key: &str) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .filter(|(k, _)| k.as_str() != key)
                .map(|(k, v)| (k.clone(), without(v, key)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(|v| without(v, key)).collect()),
        other => other.clone(),
    }
}

fn minified(bytes: &[u8], drop: &[&str]) -> Result<Vec<u8>, ScanError> {
    let mut out = Vec::new();
    scan::write_minified(bytes, 0..bytes.len(), drop, &mut out, usize::MAX, &mut |_| {})?;
    Ok(out)
}

proptest! {
    #[test]
    fn minify_agrees_with_serde_json(value in arb_json(), pretty in any::<bool>()) {
        let text = if pretty { serde_json::to_vec_pretty(&value) } else { serde_json::to_vec(&value) }.unwrap();
        let out = minified(&text, &["cache_control"]).unwrap();
        let reparsed: Value = serde_json::from_slice(&out).unwrap();
        prop_assert_eq!(reparsed, without(&value, "cache_control"));
        // Minified output has no whitespace outside strings: minifying it
        // again changes nothing, and pretty and compact inputs agree.
        prop_assert_eq!(minified(&out, &["cache_control"]).unwrap(), out.clone());
        let compact = serde_json::to_vec(&value).unwrap();
        prop_assert_eq!(minified(&compact, &["cache_control"]).unwrap(), out);
    }

    #[test]
    fn members_and_elements_match_serde_json(value in arb_json()) {
        let text = serde_json::to_vec_pretty(&value).unwrap();
        match &value {
            Value::Object(map) => {
                let mut seen = Vec::new();
                scan::for_each_member(&text, 0..text.len(), |k, v| seen.push((k, v))).unwrap();
                prop_assert_eq!(seen.len(), map.len());
                for (k, v) in seen {
                    let key: String = serde_json::from_slice(&[b"\"", &text[k], b"\""].concat()).unwrap();
                    let parsed: Value = serde_json::from_slice(&text[v]).unwrap();
                    prop_assert_eq!(Some(&parsed), map.get(&key));
                }
            }
            Value::Array(items) => {
                let mut seen = Vec::new();
                scan::for_each_element(&text, 0..text.len(), |e| {
                    seen.push(e);
                    true
                })
                .unwrap();
                let parsed: Vec<Value> = seen.into_iter().map(|e| serde_json::from_slice(&text[e]).unwrap()).collect();
                prop_assert_eq!(&parsed, items);
            }
            _ => {}
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = minified(&bytes, &["cache_control"]);
        let _ = scan::for_each_member(&bytes, 0..bytes.len(), |_, _| {});
        let _ = scan::for_each_element(&bytes, 0..bytes.len(), |_| true);
    }

    #[test]
    fn every_prefix_of_a_value_is_an_error_or_a_shorter_value(value in arb_json()) {
        let text = serde_json::to_vec(&value).unwrap();
        for cut in 0..text.len() {
            let _ = minified(&text[..cut], &[]);
        }
    }
}

#[test]
fn dropped_members_leave_valid_json_wherever_they_stand() {
    for (input, expected) in [
        (r#"{"cache_control":{"type":"ephemeral"}}"#, "{}"),
        (r#"{"a":1,"cache_control":{"type":"ephemeral"}}"#, r#"{"a":1}"#),
        (r#"{"cache_control":1,"a":1}"#, r#"{"a":1}"#),
        (r#"{"a":1,"cache_control":1,"b":2}"#, r#"{"a":1,"b":2}"#),
        (
            r#"[{"type":"text","text":"x","cache_control":{"type":"ephemeral","ttl":"1h"}}]"#,
            r#"[{"type":"text","text":"x"}]"#,
        ),
        (
            "{ \"a\" : [ 1 , 2 ] , \"s\" : \"a b\\\" c\" }",
            r#"{"a":[1,2],"s":"a b\" c"}"#,
        ),
    ] {
        assert_eq!(
            String::from_utf8(minified(input.as_bytes(), &["cache_control"]).unwrap()).unwrap(),
            expected
        );
    }
}

#[test]
fn malformed_structure_is_an_error() {
    for bad in [
        &b"{"[..],
        b"{\"a\"}",
        b"{\"a\":}",
        b"[1,]",
        b"{\"a\":1,}",
        b"\"open",
        b"}",
        b"[1 2]",
        b"{1:2}",
    ] {
        assert!(minified(bad, &[]).is_err(), "{}", String::from_utf8_lossy(bad));
    }
    let deep = "[".repeat(10_000);
    assert_eq!(minified(deep.as_bytes(), &[]), Err(ScanError::TooDeep));
    let deep_closed = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
    assert_eq!(minified(deep_closed.as_bytes(), &[]), Err(ScanError::TooDeep));
    assert_eq!(scan::value_span(deep_closed.as_bytes(), 0), Err(ScanError::TooDeep));
}

#[test]
fn writing_stops_at_the_limit_even_inside_a_string() {
    let text = format!(r#"{{"a":"{}","b":[1,2,3]}}"#, "x".repeat(1000));
    let mut out = Vec::new();
    scan::write_minified(text.as_bytes(), 0..text.len(), &[], &mut out, 100, &mut |_| {}).unwrap();
    assert_eq!(out.len(), 100);
    assert_eq!(&out[..], &text.as_bytes()[..100]);
}
