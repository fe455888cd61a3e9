//! Usage read from JSON bodies and SSE streams of every API, fed in
//! arbitrary chunk sizes.

use crate::{Usage, UsageReader};

fn read(content_type: &str, body: &str, chunk: usize) -> Usage {
    let mut reader = UsageReader::new(Some(content_type), 64 * 1024);
    for piece in body.as_bytes().chunks(chunk.max(1)) {
        reader.feed(piece);
    }
    reader.finish()
}

fn usage(prompt: u64, cached: u64, completion: u64) -> Usage {
    Usage {
        prompt_tokens: Some(prompt),
        cached_tokens: Some(cached),
        completion_tokens: Some(completion),
    }
}

const CHAT_JSON: &str = r#"{"id":"c1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"the \"usage\": {\"prompt_tokens\": 1} in text is not usage"}}],"usage":{"prompt_tokens":1200,"completion_tokens":30,"total_tokens":1230,"prompt_tokens_details":{"cached_tokens":1024}}}"#;

const CHAT_SSE: &str = "data: {\"id\":\"c\",\"choices\":[{\"delta\":{\"role\":\"assistant\"}}],\"usage\":null}\n\n\
data: {\"id\":\"c\",\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n\
data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":900,\"completion_tokens\":12,\"prompt_tokens_details\":{\"cached_tokens\":512}}}\n\n\
data: [DONE]\n\n";

const RESPONSES_SSE: &str = "event: response.created\r\ndata: {\"type\":\"response.created\",\"response\":{\"usage\":null}}\r\n\r\n\
event: response.output_text.delta\r\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"x\"}\r\n\r\n\
event: response.completed\r\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"r\",\"usage\":{\"input_tokens\":5000,\"input_tokens_details\":{\"cached_tokens\":4096},\"output_tokens\":77,\"total_tokens\":5077}}}\r\n\r\n";

const ANTHROPIC_SSE: &str = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"usage\":{\"input_tokens\":40,\"cache_creation_input_tokens\":60,\"cache_read_input_tokens\":3000,\"output_tokens\":1}}}\n\n\
event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"ok\"}}\n\n\
event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":55}}\n\n\
event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";

const ANTHROPIC_JSON: &str = r#"{"id":"m","type":"message","role":"assistant","content":[{"type":"text","text":"ok"}],"stop_reason":"end_turn","usage":{"input_tokens":10,"cache_creation_input_tokens":0,"cache_read_input_tokens":2048,"output_tokens":9}}"#;

const RESPONSES_JSON: &str = r#"{"id":"r","object":"response","output":[{"type":"message","content":[{"type":"output_text","text":"x"}]}],"usage":{"input_tokens":300,"input_tokens_details":{"cached_tokens":256},"output_tokens":4,"total_tokens":304},"user":null,"metadata":{}}"#;

#[test]
fn every_shape_in_every_chunking() {
    for chunk in [1, 2, 3, 7, 64, 100_000] {
        assert_eq!(
            read("application/json", CHAT_JSON, chunk),
            usage(1200, 1024, 30),
            "chat json /{chunk}"
        );
        assert_eq!(
            read("text/event-stream", CHAT_SSE, chunk),
            usage(900, 512, 12),
            "chat sse /{chunk}"
        );
        assert_eq!(
            read("text/event-stream; charset=utf-8", RESPONSES_SSE, chunk),
            usage(5000, 4096, 77)
        );
        assert_eq!(read("text/event-stream", ANTHROPIC_SSE, chunk), usage(3100, 3000, 55));
        assert_eq!(read("application/json", ANTHROPIC_JSON, chunk), usage(2058, 2048, 9));
        assert_eq!(read("application/json", RESPONSES_JSON, chunk), usage(300, 256, 4));
    }
}

#[test]
fn a_long_json_body_keeps_its_tail_and_still_finds_usage() {
    let content = "x".repeat(1_000_000);
    let body = format!(
        r#"{{"choices":[{{"message":{{"content":"{content}"}}}}],"usage":{{"prompt_tokens":7,"completion_tokens":1,"prompt_tokens_details":{{"cached_tokens":3}}}}}}"#
    );
    assert_eq!(read("application/json", &body, 16 * 1024), usage(7, 3, 1));
}

#[test]
fn no_usage_and_garbage_give_nothing_and_never_panic() {
    assert_eq!(read("application/json", r#"{"choices":[]}"#, 5), Usage::default());
    assert_eq!(
        read("text/event-stream", "data: {\"usage\": broken\n\n", 5),
        Usage::default()
    );
    assert_eq!(
        read("application/json", "\u{0}\u{1}usage\"usage\":{", 2),
        Usage::default()
    );
    // An overlong SSE line is skipped, and the next line still read.
    let long = format!("data: {{\"x\":\"{}\"}}\n{}", "y".repeat(200_000), CHAT_SSE);
    assert_eq!(read("text/event-stream", &long, 4096), usage(900, 512, 12));
    // A vLLM without --enable-prompt-tokens-details reports no cached count.
    let plain = r#"{"usage":{"prompt_tokens":10,"completion_tokens":2}}"#;
    let got = read("application/json", plain, 3);
    assert_eq!((got.prompt_tokens, got.cached_tokens), (Some(10), None));
}

fn messages_stream(start_usage: &str, delta_usage: &str) -> String {
    format!(
        "event: message_start\ndata: {{\"type\":\"message_start\",\"message\":{{\"id\":\"m\",\"usage\":{start_usage}}}}}\n\n\
event: message_delta\ndata: {{\"type\":\"message_delta\",\"delta\":{{\"stop_reason\":\"end_turn\"}},\"usage\":{delta_usage}}}\n\n"
    )
}

/// Streamed Messages put the prompt's split in different events depending
/// on the engine; each shape counts the prompt once.
#[test]
fn a_streamed_messages_prompt_is_counted_once_whichever_event_splits_it() {
    for chunk in [1, 7, 4096] {
        // vLLM: the total in `message_start`, the split (repeating
        // `input_tokens`, as the remainder) in `message_delta`.
        let vllm = messages_stream(
            r#"{"input_tokens":1717,"output_tokens":0}"#,
            r#"{"input_tokens":53,"cache_read_input_tokens":1664,"cache_creation_input_tokens":0,"output_tokens":5}"#,
        );
        assert_eq!(read("text/event-stream", &vllm, chunk), usage(1717, 1664, 5));
        // The same without `input_tokens` in `message_delta`: the cache
        // fields alone must not be added to the total a second time.
        let no_repeat = messages_stream(
            r#"{"input_tokens":1717,"output_tokens":0}"#,
            r#"{"cache_read_input_tokens":1664,"cache_creation_input_tokens":0,"output_tokens":5}"#,
        );
        assert_eq!(read("text/event-stream", &no_repeat, chunk), usage(1717, 1664, 5));
        // Anthropic: the split in `message_start`, only output after.
        let anthropic = messages_stream(
            r#"{"input_tokens":53,"cache_read_input_tokens":1664,"cache_creation_input_tokens":0,"output_tokens":1}"#,
            r#"{"output_tokens":5}"#,
        );
        assert_eq!(read("text/event-stream", &anthropic, chunk), usage(1717, 1664, 5));
    }
}

#[test]
fn hostile_token_counts_saturate() {
    let json = r#"{"usage":{"input_tokens":18446744073709551615,"cache_read_input_tokens":18446744073709551615,"cache_creation_input_tokens":5,"output_tokens":1}}"#;
    assert_eq!(read("application/json", json, 4096).prompt_tokens, Some(u64::MAX));
}
