//! The four inference APIs the simulated worker speaks: how each request
//! becomes the prompt the engine sees (the sim's own chat template), and how
//! each reply and its `usage` are written, as JSON or as server-sent events,
//! in the shapes vLLM and Anthropic use.

use serde_json::{Value, json};

use crate::engine::Served;

/// An inference API, by its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Chat,
    Completions,
    Responses,
    Messages,
}

/// One parsed request.
#[derive(Debug, Clone)]
pub struct Call {
    pub api: Api,
    pub model: String,
    /// The templated prompt: what the engine tokenizes and caches.
    pub prompt: Vec<u8>,
    pub stream: bool,
    pub include_usage: bool,
    pub output_tokens: u32,
}

/// Text of a message content: a string, or the text of its blocks.
fn push_content(out: &mut Vec<u8>, content: &Value) {
    match content {
        Value::String(text) => out.extend_from_slice(text.as_bytes()),
        Value::Array(blocks) => {
            for block in blocks {
                if let Some(text) = block
                    .get("text")
                    .or_else(|| block.get("thinking"))
                    .and_then(Value::as_str)
                {
                    out.extend_from_slice(text.as_bytes());
                } else if let Some(inner) = block.get("content") {
                    push_content(out, inner);
                } else {
                    let mut block = block.clone();
                    if let Some(map) = block.as_object_mut() {
                        map.remove("cache_control");
                    }
                    out.extend_from_slice(block.to_string().as_bytes());
                }
                out.push(b'\n');
            }
        }
        Value::Null => {}
        other => out.extend_from_slice(other.to_string().as_bytes()),
    }
}

/// One turn in ChatML form, the template of Qwen and many open models.
fn push_turn(out: &mut Vec<u8>, role: &str, item: &Value) {
    out.extend_from_slice(b"<|im_start|>");
    out.extend_from_slice(role.as_bytes());
    out.push(b'\n');
    push_content(out, item.get("content").unwrap_or(&Value::Null));
    for key in ["tool_calls", "input", "arguments", "output"] {
        if let Some(extra) = item.get(key) {
            push_content(out, extra);
        }
    }
    out.extend_from_slice(b"<|im_end|>\n");
}

fn push_system(out: &mut Vec<u8>, tools: Option<&Value>, system: Option<&Value>) {
    if tools.is_none() && system.is_none() {
        return;
    }
    out.extend_from_slice(b"<|im_start|>system\n");
    if let Some(system) = system {
        push_content(out, system);
    }
    if let Some(tools) = tools {
        out.extend_from_slice(b"\n# Tools\n");
        out.extend_from_slice(tools.to_string().as_bytes());
    }
    out.extend_from_slice(b"<|im_end|>\n");
}

fn role(item: &Value, fallback: &str) -> String {
    item.get("role")
        .and_then(Value::as_str)
        .or_else(|| item.get("type").and_then(Value::as_str))
        .unwrap_or(fallback)
        .to_owned()
}

impl Call {
    /// Parses a request body of `api`; the error is the engine's 400 message.
    pub fn parse(api: Api, body: &Value, default_output_tokens: u32) -> Result<Self, String> {
        let mut prompt = Vec::new();
        match api {
            Api::Chat | Api::Messages => {
                let messages = body
                    .get("messages")
                    .and_then(Value::as_array)
                    .ok_or("`messages` must be an array")?;
                push_system(&mut prompt, body.get("tools"), body.get("system"));
                for message in messages {
                    push_turn(&mut prompt, &role(message, "user"), message);
                }
                prompt.extend_from_slice(b"<|im_start|>assistant\n");
            }
            Api::Completions => match body.get("prompt") {
                Some(Value::String(text)) => prompt.extend_from_slice(text.as_bytes()),
                Some(Value::Array(parts)) => parts.iter().for_each(|p| push_content(&mut prompt, p)),
                _ => return Err("`prompt` must be a string or an array".to_owned()),
            },
            Api::Responses => {
                push_system(&mut prompt, body.get("tools"), body.get("instructions"));
                match body.get("input") {
                    Some(Value::String(text)) => push_turn(&mut prompt, "user", &json!({ "content": text })),
                    Some(Value::Array(items)) => {
                        for item in items {
                            push_turn(&mut prompt, &role(item, "user"), item);
                        }
                    }
                    None => {}
                    Some(_) => return Err("`input` must be a string or an array".to_owned()),
                }
                prompt.extend_from_slice(b"<|im_start|>assistant\n");
            }
        }
        let model = match body.get("model") {
            Some(Value::String(model)) => model.clone(),
            None => "sim".to_owned(),
            Some(_) => return Err("`model` must be a string".to_owned()),
        };
        let output_tokens = ["max_completion_tokens", "max_output_tokens", "max_tokens"]
            .iter()
            .find_map(|k| body.get(*k).and_then(Value::as_u64))
            .map_or(default_output_tokens, |n| {
                u32::try_from(n.clamp(1, 4096)).unwrap_or(4096)
            });
        let stream = body.get("stream").and_then(Value::as_bool) == Some(true);
        // As vLLM answers (0.32, measured): stream options on a call that
        // does not stream are an error, not ignored.
        if !stream
            && body.get("stream_options").is_some_and(|o| !o.is_null())
            && matches!(api, Api::Chat | Api::Completions)
        {
            return Err("Stream options can only be defined when `stream=True`.".to_owned());
        }
        Ok(Self {
            api,
            model,
            prompt,
            stream,
            include_usage: body.pointer("/stream_options/include_usage").and_then(Value::as_bool) == Some(true),
            output_tokens,
        })
    }
}

/// What the engine answers to one call.
#[derive(Debug, Clone)]
pub struct Reply {
    pub call: Call,
    pub served: Served,
    pub text: String,
}

impl Reply {
    fn id(&self) -> String {
        let prefix = match self.call.api {
            Api::Chat => "chatcmpl",
            Api::Completions => "cmpl",
            Api::Responses => "resp",
            Api::Messages => "msg",
        };
        format!("{prefix}-{}", self.served.request_id)
    }

    /// `usage` as vLLM's OpenAI server writes it with
    /// `--enable-prompt-tokens-details`.
    fn openai_usage(&self) -> Value {
        let s = &self.served;
        let out = u64::from(self.call.output_tokens);
        json!({"prompt_tokens": s.prompt_tokens, "completion_tokens": out, "total_tokens": s.prompt_tokens + out,
               "prompt_tokens_details": {"cached_tokens": s.cached_tokens}})
    }

    fn responses_usage(&self) -> Value {
        let s = &self.served;
        let out = u64::from(self.call.output_tokens);
        json!({"input_tokens": s.prompt_tokens, "input_tokens_details": {"cached_tokens": s.cached_tokens},
               "output_tokens": out, "total_tokens": s.prompt_tokens + out})
    }

    /// Anthropic counts only uncached tokens as `input_tokens`.
    fn anthropic_usage(&self, output_tokens: u64) -> Value {
        let s = &self.served;
        json!({"input_tokens": s.uncached_tokens(), "cache_read_input_tokens": s.cached_tokens,
               "cache_creation_input_tokens": 0, "output_tokens": output_tokens})
    }

    fn response_object(&self, status: &str) -> Value {
        let mut object = json!({"id": self.id(), "object": "response", "status": status, "model": self.call.model,
            "output": [{"type": "message", "role": "assistant", "status": status,
                        "content": [{"type": "output_text", "text": self.text, "annotations": []}]}]});
        if status == "completed" {
            object["usage"] = self.responses_usage();
        }
        object
    }

    /// The non-streamed body.
    pub fn json(&self) -> Value {
        let (id, model, text) = (self.id(), &self.call.model, &self.text);
        match self.call.api {
            Api::Chat => json!({"id": id, "object": "chat.completion", "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": self.openai_usage()}),
            Api::Completions => json!({"id": id, "object": "text_completion", "model": model,
                "choices": [{"index": 0, "text": text, "finish_reason": "stop"}], "usage": self.openai_usage()}),
            Api::Responses => self.response_object("completed"),
            Api::Messages => json!({"id": id, "type": "message", "role": "assistant", "model": model,
                "content": [{"type": "text", "text": text}], "stop_reason": "end_turn", "stop_sequence": null,
                "usage": self.anthropic_usage(u64::from(self.call.output_tokens))}),
        }
    }

    /// Events sent once the prefill is done, before the first token.
    pub fn sse_start(&self) -> Vec<String> {
        match self.call.api {
            Api::Chat => vec![data(
                &self.chunk(json!({"role": "assistant", "content": ""}), Value::Null),
            )],
            Api::Completions => Vec::new(),
            Api::Responses => vec![event(
                "response.created",
                &json!({"type": "response.created",
                "response": self.response_object("in_progress")}),
            )],
            Api::Messages => vec![
                event(
                    "message_start",
                    &json!({"type": "message_start", "message": {"id": self.id(),
                    "type": "message", "role": "assistant", "content": [], "model": self.call.model,
                    "usage": self.anthropic_usage(1)}}),
                ),
                event(
                    "content_block_start",
                    &json!({"type": "content_block_start", "index": 0,
                    "content_block": {"type": "text", "text": ""}}),
                ),
            ],
        }
    }

    /// The event of one output token.
    pub fn sse_token(&self, token: &str) -> String {
        match self.call.api {
            Api::Chat => data(&self.chunk(json!({"content": token}), Value::Null)),
            Api::Completions => data(
                &json!({"id": self.id(), "object": "text_completion", "model": self.call.model,
                "choices": [{"index": 0, "text": token, "finish_reason": null}]}),
            ),
            Api::Responses => event(
                "response.output_text.delta",
                &json!({"type": "response.output_text.delta",
                "output_index": 0, "content_index": 0, "delta": token}),
            ),
            Api::Messages => event(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": token}}),
            ),
        }
    }

    /// Events after the last token, usage included where the API puts it.
    pub fn sse_end(&self) -> Vec<String> {
        match self.call.api {
            Api::Chat | Api::Completions => {
                let mut events = vec![match self.call.api {
                    Api::Chat => data(&self.chunk(json!({}), json!("stop"))),
                    _ => data(
                        &json!({"id": self.id(), "object": "text_completion", "model": self.call.model,
                        "choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}),
                    ),
                }];
                if self.call.include_usage {
                    events.push(data(&json!({"id": self.id(), "model": self.call.model, "choices": [],
                        "usage": self.openai_usage()})));
                }
                events.push("data: [DONE]\n\n".to_owned());
                events
            }
            Api::Responses => vec![event(
                "response.completed",
                &json!({"type": "response.completed",
                "response": self.response_object("completed")}),
            )],
            Api::Messages => vec![
                event("content_block_stop", &json!({"type": "content_block_stop", "index": 0})),
                event(
                    "message_delta",
                    &json!({"type": "message_delta",
                    "delta": {"stop_reason": "end_turn", "stop_sequence": null},
                    "usage": {"output_tokens": self.call.output_tokens}}),
                ),
                event("message_stop", &json!({"type": "message_stop"})),
            ],
        }
    }

    fn chunk(&self, delta: Value, finish: Value) -> Value {
        json!({"id": self.id(), "object": "chat.completion.chunk", "model": self.call.model,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    }
}

fn data(value: &Value) -> String {
    format!("data: {value}\n\n")
}

fn event(name: &str, value: &Value) -> String {
    format!("event: {name}\ndata: {value}\n\n")
}
