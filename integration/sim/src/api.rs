//! The four inference APIs the simulated worker speaks: how each request
//! becomes the prompt the engine sees (the sim's own chat template), and how
//! each reply and its `usage` are written, as JSON or as server-sent events,
//! in the shapes vLLM and Anthropic use. Under `--agent-script` the reply
//! is the scripted agent model's decision (`ScriptedReply`), in the shapes
//! of the OpenAI and Anthropic APIs that the harness CLIs parse.

use serde_json::{Value, json};

use crate::agent::{CallInput, Script, ToolCall};
use crate::engine::Served;
use crate::tokenizer;

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

    fn openai_usage(&self) -> Value {
        openai_usage(&self.served, u64::from(self.call.output_tokens))
    }

    fn responses_usage(&self) -> Value {
        responses_usage(&self.served, u64::from(self.call.output_tokens))
    }

    fn anthropic_usage(&self, output_tokens: u64) -> Value {
        anthropic_usage(&self.served, output_tokens)
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

/// What the engine answers to one call under `--agent-script`: the
/// scripted decision (`crate::agent`) in the shapes the real harness CLIs
/// accepted from the server that recorded them, with the sim's own usage.
#[derive(Debug, Clone)]
pub struct ScriptedReply {
    pub call: Call,
    pub served: Served,
    pub script: Script,
    /// Makes the reply's ids unique across workers and restarts: harnesses
    /// match tool results to calls by id, and one session's calls may be
    /// answered by several workers.
    pub uid: String,
    /// Unix seconds, for `created` and `created_at`.
    pub created: u64,
}

/// A streamed scripted reply's events: sent when the prefill is done, then
/// one group per decode step (the piece of the reply that step generated;
/// a group may be empty), then at the end.
#[derive(Debug, Clone, Default)]
pub struct ScriptedEvents {
    pub start: Vec<String>,
    pub steps: Vec<Vec<String>>,
    pub end: Vec<String>,
}

/// The scripted decision as one API carries it.
enum Said<'a> {
    Text(&'a str),
    /// A function call; `arguments` is `input` as JSON text.
    Function {
        call: &'a ToolCall,
        input: Value,
        arguments: String,
    },
    /// A custom tool's call (Responses only).
    Custom {
        call: &'a ToolCall,
        input: &'a str,
    },
}

impl Said<'_> {
    /// The generated text: what the decode steps produce, piece by piece.
    fn payload(&self) -> &str {
        match self {
            Self::Text(text) => text,
            Self::Function { arguments, .. } => arguments,
            Self::Custom { input, .. } => input,
        }
    }
}

impl ScriptedReply {
    fn said(&self) -> Said<'_> {
        match &self.script {
            Script::Text(text) => Said::Text(text),
            Script::Call(call) => match &call.input {
                CallInput::Custom(input) if self.call.api == Api::Responses => Said::Custom { call, input },
                // Only Responses has custom tools; elsewhere the text is the
                // single argument of a function.
                CallInput::Custom(input) => Said::function(call, json!({ "input": input })),
                CallInput::Json(input) => Said::function(call, input.clone()),
            },
        }
    }

    /// Decode steps: the reply's tokens, as the engine's tokenizer counts
    /// them (a model stops at the end of its turn, not at `max_tokens`),
    /// within the call's output limit.
    pub fn output_tokens(&self) -> u32 {
        let said = self.said();
        let name = match &said {
            Said::Text(_) => 0,
            Said::Function { call, .. } | Said::Custom { call, .. } => tokenizer::count(call.name.as_bytes()),
        };
        let tokens = tokenizer::count(said.payload().as_bytes()) + name;
        u32::try_from(tokens)
            .unwrap_or(u32::MAX)
            .clamp(1, self.call.output_tokens.max(1))
    }

    fn id(&self, prefix: &str) -> String {
        format!("{prefix}{}", self.uid)
    }

    fn stop_reason(&self) -> &'static str {
        match self.script {
            Script::Text(_) => "end_turn",
            Script::Call(_) => "tool_use",
        }
    }

    /// The non-streamed body.
    pub fn json(&self) -> Value {
        let out = u64::from(self.output_tokens());
        match self.call.api {
            Api::Chat | Api::Completions => {
                let (message, finish) = match self.said() {
                    Said::Text(text) => (json!({"role": "assistant", "content": text}), "stop"),
                    Said::Function { call, arguments, .. } => (
                        json!({"role": "assistant", "content": null,
                               "tool_calls": [self.chat_tool_call(call, &arguments)]}),
                        "tool_calls",
                    ),
                    // Not on Chat: `said` makes a custom call a function
                    // there. Legacy completions are never scripted.
                    Said::Custom { .. } => (json!({"role": "assistant", "content": ""}), "stop"),
                };
                json!({"id": self.id("chatcmpl-"), "object": "chat.completion", "created": self.created,
                       "model": self.call.model, "usage": openai_usage(&self.served, out),
                       "choices": [{"index": 0, "message": message, "finish_reason": finish}]})
            }
            Api::Responses => self.response_object("completed", vec![self.responses_item(true)]),
            Api::Messages => {
                let mut message = self.message_object();
                message["content"] = json!([self.messages_block(true)]);
                message
            }
        }
    }

    fn chat_tool_call(&self, call: &ToolCall, arguments: &str) -> Value {
        json!({"id": self.id("call_"), "type": "function",
               "function": {"name": call.name, "arguments": arguments}})
    }

    fn chat_chunk(&self, delta: Value, finish: Value) -> Value {
        json!({"id": self.id("chatcmpl-"), "object": "chat.completion.chunk", "created": self.created,
               "model": self.call.model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    }

    /// The response object; with usage once completed.
    fn response_object(&self, status: &str, output: Vec<Value>) -> Value {
        let usage = if status == "completed" {
            let mut usage = responses_usage(&self.served, u64::from(self.output_tokens()));
            usage["output_tokens_details"] = json!({"reasoning_tokens": 0});
            usage
        } else {
            Value::Null
        };
        json!({"id": self.id("resp_"), "object": "response", "created_at": self.created, "status": status,
               "model": self.call.model, "output": output, "usage": usage, "error": null,
               "incomplete_details": null})
    }

    fn responses_item_id(&self) -> String {
        match self.said() {
            Said::Text(_) => self.id("msg_"),
            Said::Function { .. } => self.id("fc_"),
            Said::Custom { .. } => self.id("ctc_"),
        }
    }

    /// The output item, whole (`done`) or as it is announced before its
    /// first delta.
    fn responses_item(&self, done: bool) -> Value {
        let id = self.responses_item_id();
        let status = if done { "completed" } else { "in_progress" };
        let (mut item, namespace) = match self.said() {
            Said::Text(text) => {
                let content = if done {
                    json!([{"type": "output_text", "text": text, "annotations": []}])
                } else {
                    json!([])
                };
                let item = json!({"type": "message", "id": id, "role": "assistant", "status": status,
                                  "content": content});
                (item, None)
            }
            Said::Function { call, arguments, .. } => {
                let arguments = if done { arguments.as_str() } else { "" };
                let item = json!({"type": "function_call", "id": id, "call_id": self.id("call_"),
                                  "name": call.name, "arguments": arguments, "status": status});
                (item, call.namespace.as_deref())
            }
            Said::Custom { call, input } => {
                let input = if done { input } else { "" };
                let item = json!({"type": "custom_tool_call", "id": id, "call_id": self.id("call_"),
                                  "name": call.name, "input": input, "status": status});
                (item, call.namespace.as_deref())
            }
        };
        if let Some(namespace) = namespace {
            item["namespace"] = json!(namespace);
        }
        item
    }

    /// The message, without its content, as `message_start` carries it
    /// (the non-streamed body sets content and keeps the rest).
    fn message_object(&self) -> Value {
        json!({"id": self.id("msg_"), "type": "message", "role": "assistant", "model": self.call.model,
               "content": [], "stop_reason": self.stop_reason(), "stop_sequence": null,
               "usage": anthropic_usage(&self.served, u64::from(self.output_tokens()))})
    }

    /// The content block, whole (`done`) or as `content_block_start` opens it.
    fn messages_block(&self, done: bool) -> Value {
        match self.said() {
            Said::Text(text) => json!({"type": "text", "text": if done { text } else { "" }}),
            Said::Function { call, input, .. } => json!({"type": "tool_use", "id": self.id("toolu_"),
                "name": call.name, "input": if done { input } else { json!({}) }}),
            Said::Custom { call, input } => json!({"type": "tool_use", "id": self.id("toolu_"),
                "name": call.name, "input": if done { json!({"input": input}) } else { json!({}) }}),
        }
    }

    /// The streamed reply, every event of it. The payload (the text, the
    /// arguments, the custom input) is cut into one piece per decode step.
    pub fn sse(&self) -> ScriptedEvents {
        let said = self.said();
        let pieces = pieces(said.payload(), self.output_tokens());
        let mut events = ScriptedEvents::default();
        match self.call.api {
            Api::Chat | Api::Completions => {
                let tool = matches!(said, Said::Function { .. });
                events.start.push(data(
                    &self.chat_chunk(json!({"role": "assistant", "content": ""}), Value::Null),
                ));
                if let Said::Function { call, .. } = &said {
                    events.start.push(data(&self.chat_chunk(
                        json!({"tool_calls": [{"index": 0, "id": self.id("call_"), "type": "function",
                               "function": {"name": call.name, "arguments": ""}}]}),
                        Value::Null,
                    )));
                }
                events.steps = pieces
                    .iter()
                    .map(|piece| {
                        let delta = if tool {
                            json!({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
                        } else {
                            json!({"content": piece})
                        };
                        nonempty(piece, || data(&self.chat_chunk(delta, Value::Null)))
                    })
                    .collect();
                let finish = if tool { "tool_calls" } else { "stop" };
                events.end.push(data(&self.chat_chunk(json!({}), json!(finish))));
                if self.call.include_usage {
                    let usage = openai_usage(&self.served, u64::from(self.output_tokens()));
                    events.end.push(data(
                        &json!({"id": self.id("chatcmpl-"), "object": "chat.completion.chunk",
                        "created": self.created, "model": self.call.model, "choices": [], "usage": usage}),
                    ));
                }
                events.end.push("data: [DONE]\n\n".to_owned());
            }
            Api::Responses => {
                let mut seq = 0u64;
                let mut ev = |kind: &str, mut fields: Value| {
                    fields["type"] = json!(kind);
                    fields["sequence_number"] = json!(seq);
                    seq += 1;
                    event(kind, &fields)
                };
                let item_id = self.responses_item_id();
                let started = self.response_object("in_progress", Vec::new());
                events.start.push(ev("response.created", json!({"response": started})));
                events
                    .start
                    .push(ev("response.in_progress", json!({"response": started})));
                events.start.push(ev(
                    "response.output_item.added",
                    json!({"output_index": 0, "item": self.responses_item(false)}),
                ));
                let text_part = |text: &str| json!({"type": "output_text", "text": text, "annotations": []});
                if matches!(said, Said::Text(_)) {
                    events.start.push(ev(
                        "response.content_part.added",
                        json!({"output_index": 0, "item_id": item_id, "content_index": 0, "part": text_part("")}),
                    ));
                }
                let delta_kind = match said {
                    Said::Text(_) => "response.output_text.delta",
                    Said::Function { .. } => "response.function_call_arguments.delta",
                    Said::Custom { .. } => "response.custom_tool_call_input.delta",
                };
                for piece in &pieces {
                    let mut fields = json!({"output_index": 0, "item_id": item_id, "delta": piece});
                    if matches!(said, Said::Text(_)) {
                        fields["content_index"] = json!(0);
                    }
                    events.steps.push(nonempty(piece, || ev(delta_kind, fields)));
                }
                match &said {
                    Said::Text(text) => {
                        events.end.push(ev(
                            "response.output_text.done",
                            json!({"output_index": 0, "item_id": item_id, "content_index": 0, "text": text}),
                        ));
                        events.end.push(ev(
                            "response.content_part.done",
                            json!({"output_index": 0, "item_id": item_id, "content_index": 0,
                                   "part": text_part(text)}),
                        ));
                    }
                    Said::Function { arguments, .. } => {
                        events.end.push(ev(
                            "response.function_call_arguments.done",
                            json!({"output_index": 0, "item_id": item_id, "arguments": arguments}),
                        ));
                    }
                    Said::Custom { .. } => {}
                }
                let item = self.responses_item(true);
                events.end.push(ev(
                    "response.output_item.done",
                    json!({"output_index": 0, "item": item}),
                ));
                let done = self.response_object("completed", vec![item]);
                events.end.push(ev("response.completed", json!({"response": done})));
            }
            Api::Messages => {
                let mut message = self.message_object();
                message["stop_reason"] = Value::Null;
                message["usage"] = anthropic_usage(&self.served, 1);
                events.start.push(event(
                    "message_start",
                    &json!({"type": "message_start", "message": message}),
                ));
                events.start.push(event(
                    "content_block_start",
                    &json!({"type": "content_block_start",
                    "index": 0, "content_block": self.messages_block(false)}),
                ));
                let text = matches!(said, Said::Text(_));
                events.steps = pieces
                    .iter()
                    .map(|piece| {
                        let delta = if text {
                            json!({"type": "text_delta", "text": piece})
                        } else {
                            json!({"type": "input_json_delta", "partial_json": piece})
                        };
                        nonempty(piece, || {
                            event(
                                "content_block_delta",
                                &json!({"type": "content_block_delta", "index": 0, "delta": delta}),
                            )
                        })
                    })
                    .collect();
                events.end.push(event(
                    "content_block_stop",
                    &json!({"type": "content_block_stop", "index": 0}),
                ));
                events.end.push(event(
                    "message_delta",
                    &json!({"type": "message_delta",
                    "delta": {"stop_reason": self.stop_reason(), "stop_sequence": null},
                    "usage": {"output_tokens": self.output_tokens()}}),
                ));
                events.end.push(event("message_stop", &json!({"type": "message_stop"})));
            }
        }
        events
    }
}

impl<'a> Said<'a> {
    fn function(call: &'a ToolCall, input: Value) -> Self {
        let arguments = input.to_string();
        Self::Function { call, input, arguments }
    }
}

/// `text` cut into `n` pieces of about equal length at character
/// boundaries; the last ones are empty when the text is shorter than `n`.
fn pieces(text: &str, n: u32) -> Vec<&str> {
    let n = usize::try_from(n.max(1)).unwrap_or(1);
    let size = text.len().div_ceil(n).max(1);
    let mut pieces = Vec::with_capacity(n);
    let mut rest = text;
    while pieces.len() < n {
        // The last piece takes what is left.
        let cut = if pieces.len() + 1 == n {
            rest.len()
        } else {
            rest.ceil_char_boundary(size.min(rest.len()))
        };
        let (piece, tail) = rest.split_at(cut);
        pieces.push(piece);
        rest = tail;
    }
    pieces
}

/// One step's events: the piece's, or none for an empty piece.
fn nonempty(piece: &str, event: impl FnOnce() -> String) -> Vec<String> {
    if piece.is_empty() { Vec::new() } else { vec![event()] }
}

/// `usage` as vLLM's OpenAI server writes it with
/// `--enable-prompt-tokens-details`.
fn openai_usage(s: &Served, out: u64) -> Value {
    json!({"prompt_tokens": s.prompt_tokens, "completion_tokens": out, "total_tokens": s.prompt_tokens + out,
           "prompt_tokens_details": {"cached_tokens": s.cached_tokens}})
}

fn responses_usage(s: &Served, out: u64) -> Value {
    json!({"input_tokens": s.prompt_tokens, "input_tokens_details": {"cached_tokens": s.cached_tokens},
           "output_tokens": out, "total_tokens": s.prompt_tokens + out})
}

/// Anthropic counts only uncached tokens as `input_tokens`.
fn anthropic_usage(s: &Served, output_tokens: u64) -> Value {
    json!({"input_tokens": s.uncached_tokens(), "cache_read_input_tokens": s.cached_tokens,
           "cache_creation_input_tokens": 0, "output_tokens": output_tokens})
}

fn data(value: &Value) -> String {
    format!("data: {value}\n\n")
}

fn event(name: &str, value: &Value) -> String {
    format!("event: {name}\ndata: {value}\n\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_text_once_at_character_boundaries() {
        for (text, n) in [("echo hi", 3), ("é日本語テキスト", 4), ("ab", 5), ("", 2), ("x", 1)] {
            let pieces = pieces(text, n);
            assert_eq!(pieces.len(), n as usize, "{text:?} {n}");
            assert_eq!(pieces.concat(), text);
        }
        // About equal: no piece more than one character over its share.
        let pieces = pieces("0123456789", 3);
        assert_eq!(pieces, ["0123", "4567", "89"]);
    }

    #[test]
    fn a_scripted_reply_decodes_its_own_tokens_within_the_call_limit() {
        let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
        let reply = |text: &str, body: &Value| ScriptedReply {
            call: Call::parse(Api::Chat, body, 16).unwrap_or_else(|e| panic!("{e}")),
            served: Served {
                request_id: 1,
                prompt_tokens: 10,
                cached_tokens: 0,
                host_loaded_tokens: 0,
            },
            script: Script::Text(text.to_owned()),
            uid: "u".to_owned(),
            created: 0,
        };
        // As many steps as the tokenizer's tokens, capped at max_tokens 4.
        let short = "the worker";
        let tokens = tokenizer::count(short.as_bytes());
        assert!((1..4).contains(&tokens), "{tokens}");
        assert_eq!(reply(short, &body).output_tokens() as usize, tokens);
        assert_eq!(reply(&"x".repeat(40), &body).output_tokens(), 4);
        assert_eq!(reply("", &body).output_tokens(), 1);
        let long = reply(&"x".repeat(40), &body);
        let events = long.sse();
        assert_eq!(events.steps.len(), 4);
        assert!(events.steps.iter().all(|step| step.len() == 1));
    }
}
