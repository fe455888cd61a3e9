//! The scripted agent model of `--agent-script`: what a model driving a
//! coding agent would answer to one request, decided from that request
//! alone (no server state, no I/O), so the real harness CLIs can run whole
//! sessions against the sim. The script: a call to the shell tool the
//! request declares (`echo hi`, `echo sub` in a subagent); then, when a user
//! message says `KVSPAWN`, a call to the subagent tool (and to its wait tool
//! where the harness needs one); then a final text answer. Title and summary
//! side calls get a short text. `api.rs` writes the decision in each API's
//! shapes.
//!
//! It is a port of the throwaway capture server that recorded
//! filter/request/tests/real-harnesses, whose decisions the real CLIs
//! (Claude Code, Codex, OpenCode, OpenClaw) accepted; it keeps that server's
//! rules, markers and texts so the sim answers as that recording did.

use std::borrow::Cow;

use serde_json::{Map, Value, json};

use crate::api::Api;

/// The task the scripted model gives a subagent. `KVSUB` in it is how the
/// subagent's own calls are recognised later.
pub const SUB_PROMPT: &str = "KVSUB: run `echo sub` in the shell and report what it printed.";

/// A user text with this in it asks for a subagent after the shell call.
const SPAWN_MARKER: &str = "KVSPAWN";
/// A conversation whose first or last user text has this is a subagent's.
const SUB_MARKER: &str = "KVSUB";
/// OpenClaw appends a user message with its runtime state to every call; it
/// is not something the user said, so it does not start a new turn.
const OPENCLAW_INTERNAL: &str = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT";
/// Codex hands a task to an agent (a spawned subagent) in an
/// `agent_message` of this type; other agent messages are not a new turn.
const CODEX_NEW_TASK: &str = "NEW_TASK";
/// Codex's default tool namespace: its tools are called without a
/// namespace (the recorded runs answered `exec` bare, and Codex ran it).
const DEFAULT_NAMESPACE: &str = "functions";

/// Shell tools by preference (Claude Code, OpenCode, Codex without code
/// mode, OpenClaw): the first one the request declares is the shell.
const SHELL_TOOLS: [&str; 7] = [
    "Bash",
    "bash",
    "exec_command",
    "shell_command",
    "shell",
    "exec",
    "local_shell",
];
/// Subagent tools by preference.
const SUB_TOOLS: [&str; 5] = ["Task", "Agent", "spawn_agent", "task", "sessions_spawn"];
/// Tools that wait for a spawned subagent.
const WAIT_TOOLS: [&str; 3] = ["wait_agent", "wait", "sessions_wait"];

/// After this many tool results in one turn the script gives up with a text
/// answer, so a harness that keeps calling back cannot loop forever.
const MAX_RESULTS_PER_TURN: usize = 6;
/// Bytes of any one message's text that are read: markers and requests
/// sit near the start, and a hostile body must not cost more than this per
/// message in copies and searches.
const MAX_TEXT_BYTES: usize = 256 * 1024;
/// Bytes of a tool result or a message text parsed as JSON (a subagent's id,
/// tools carried as text).
const MAX_PARSED_BYTES: usize = 256 * 1024;
/// Required properties of a schema given values: real tools have a handful,
/// and each one is copied into every event of the reply.
const MAX_REQUIRED: usize = 64;

/// What the scripted model answers.
#[derive(Debug, Clone, PartialEq)]
pub enum Script {
    /// A final answer: the turn ends.
    Text(String),
    /// One tool call: the harness runs it and calls back with its result.
    Call(ToolCall),
}

/// A call to a tool the request declared.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The namespace the tool was declared in, when the harness needs it
    /// back (Codex answers `unsupported call` without it).
    pub namespace: Option<String>,
    pub input: CallInput,
}

/// The input of a tool call.
#[derive(Debug, Clone, PartialEq)]
pub enum CallInput {
    /// The JSON arguments of a function tool (an object).
    Json(Value),
    /// The free-form input of a custom tool: Codex's code-mode `exec` takes
    /// JavaScript.
    Custom(String),
}

impl Script {
    fn text(text: &str) -> Self {
        Self::Text(text.to_owned())
    }
}

/// Decides the scripted answer to a request of `api`. Legacy completions
/// have no tools and no turns: `None`, the sim answers them as usual.
pub fn decide(api: Api, body: &Value) -> Option<Script> {
    if api == Api::Completions {
        return None;
    }
    let tools = declared_tools(api, body);
    let convo = Convo::read(api, body);
    let in_sub = convo.first.contains(SUB_MARKER) || convo.last.contains(SUB_MARKER);
    let spawn_mode = convo.spawn_asked && !in_sub;
    let since = convo.results_since_user;
    let done = || {
        Script::text(if in_sub {
            "Subagent done: it printed sub."
        } else {
            "Done: the shell printed hi."
        })
    };
    let command = if in_sub { "echo sub" } else { "echo hi" };

    // Side calls first: Codex's title thread and its compaction declare the
    // whole tool set, yet want text.
    let low = convo.last.to_ascii_lowercase();
    if low.contains("task title") || low.starts_with("generate a concise") {
        return Some(Script::text("Run echo in shell"));
    }
    if (low.contains("checkpoint") || low.contains("summar") || low.contains("compact")) && !convo.last.contains("KV") {
        return Some(Script::text("Summary: the user asked to run echo hi; it printed hi."));
    }

    // Codex's code mode: the shell is reached through the JavaScript of its
    // custom `exec` tool, subagents through the `collaboration` namespace.
    if let Some(exec) = tools.find("exec").filter(|t| t.kind == Kind::Custom) {
        let spawn = tools.find("spawn_agent");
        let wait = tools.find("wait_agent");
        return Some(match (since, spawn, wait) {
            (0, _, _) => Script::Call(exec.call(CallInput::Custom(format!(
                "const r = await tools.exec_command({{cmd: \"{command}\"}});\ntext(r.output);"
            )))),
            (1, Some(spawn), _) if spawn_mode => {
                Script::Call(spawn.call(CallInput::Json(json!({"task_name": "sub_echo", "message": SUB_PROMPT}))))
            }
            (2, Some(_), Some(wait)) if spawn_mode => {
                Script::Call(wait.call(CallInput::Json(json!({"timeout_ms": 30000}))))
            }
            _ => done(),
        });
    }
    if since >= MAX_RESULTS_PER_TURN {
        return Some(Script::text("Done (cap)."));
    }

    // OpenClaw: subagents are spawned through its deferred-tool caller
    // (`tool_call` naming `sessions_spawn`), then the turn yields.
    if let (Some(exec), Some(caller), Some(yield_tool)) = (
        tools.find("exec"),
        tools.find("tool_call"),
        tools.find("sessions_yield"),
    ) {
        return Some(match since {
            0 => Script::Call(exec.call(CallInput::Json(json!({"command": command})))),
            1 if spawn_mode => Script::Call(caller.call(CallInput::Json(json!({"id": "sessions_spawn",
                "args": {"task": SUB_PROMPT, "mode": "run", "label": "kvsub"}})))),
            2 if spawn_mode => Script::Call(yield_tool.call(CallInput::Json(json!({})))),
            _ => done(),
        });
    }

    let shell = SHELL_TOOLS.iter().find_map(|name| tools.find(name));
    let Some(shell) = shell else {
        // No tools at all is a title call (Claude Code's, OpenCode's).
        return Some(Script::text(if tools.is_empty() {
            "A title: listing files"
        } else {
            "Done."
        }));
    };
    if since == 0 {
        // A shell declared as a custom tool takes the command line itself.
        let input = if shell.kind == Kind::Custom {
            CallInput::Custom(command.to_owned())
        } else {
            CallInput::Json(fill(shell, if in_sub { Fill::SubShell } else { Fill::Shell }))
        };
        return Some(Script::Call(shell.call(input)));
    }
    let sub = SUB_TOOLS.iter().find_map(|name| tools.find(name));
    if let Some(sub) = sub.filter(|_| spawn_mode) {
        if since == 1 {
            return Some(Script::Call(sub.call(CallInput::Json(fill(sub, Fill::Spawn)))));
        }
        let wait = WAIT_TOOLS.iter().find_map(|name| tools.find(name));
        if let Some(wait) = wait.filter(|_| since == 2 && sub.name == "spawn_agent") {
            return Some(Script::Call(
                wait.call(CallInput::Json(wait_arguments(wait, convo.last_result.as_ref()))),
            ));
        }
    }
    Some(done())
}

/// How a tool was declared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Called with JSON arguments.
    Function,
    /// Called with free-form text (a Responses `custom` tool).
    Custom,
    /// Another Responses tool type: its name is known, not its call shape.
    Other,
}

/// One tool the request declares. Borrowed from the request, except for
/// tools Codex carried as JSON text, which had to be parsed.
#[derive(Debug)]
struct Tool<'a> {
    name: Cow<'a, str>,
    namespace: Option<Cow<'a, str>>,
    kind: Kind,
    /// Its JSON schema (`Null` when it has none).
    schema: Cow<'a, Value>,
}

impl Tool<'_> {
    fn call(&self, input: CallInput) -> ToolCall {
        ToolCall {
            name: self.name.clone().into_owned(),
            namespace: self
                .namespace
                .as_deref()
                .filter(|ns| *ns != DEFAULT_NAMESPACE)
                .map(str::to_owned),
            input,
        }
    }

    fn properties(&self) -> Option<&Map<String, Value>> {
        self.schema.get("properties").and_then(Value::as_object)
    }
}

#[derive(Debug, Default)]
struct Tools<'a>(Vec<Tool<'a>>);

impl<'a> Tools<'a> {
    /// The tool named `name`; a later declaration wins, as a later member
    /// of a JSON object would.
    fn find(&self, name: &str) -> Option<&Tool<'a>> {
        self.0.iter().rev().find(|t| t.name == name)
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn push(&mut self, name: &'a Value, namespace: Option<&'a str>, kind: Kind, schema: Option<&'a Value>) {
        if let Some(name) = name.as_str() {
            self.0.push(Tool {
                name: Cow::Borrowed(name),
                namespace: namespace.map(Cow::Borrowed),
                kind,
                schema: Cow::Borrowed(schema.unwrap_or(&Value::Null)),
            });
        }
    }

    /// A Responses tool entry: a namespace of tools, or one tool.
    fn push_responses(&mut self, entry: &'a Value, namespace: Option<&'a str>) {
        let kind = match entry.get("type").and_then(Value::as_str) {
            Some("namespace") => {
                let ns = entry.get("name").and_then(Value::as_str);
                for inner in entry.get("tools").and_then(Value::as_array).into_iter().flatten() {
                    // One level, as the capture server read: an inner
                    // namespace is skipped, which also bounds the recursion.
                    if inner.get("type").and_then(Value::as_str) != Some("namespace") {
                        self.push_responses(inner, ns);
                    }
                }
                return;
            }
            Some("function") | None => Kind::Function,
            Some("custom") => Kind::Custom,
            Some(_) => Kind::Other,
        };
        self.push(
            entry.get("name").unwrap_or(&Value::Null),
            namespace,
            kind,
            entry.get("parameters"),
        );
    }

    /// Tools carried as the JSON text `{"additional_tools": [...]}` of a
    /// message's content: the capture server read them there too, should a
    /// Codex send its tools inside a developer message.
    fn push_text_carried(&mut self, message: &'a Value) {
        for block in message.get("content").and_then(Value::as_array).into_iter().flatten() {
            let Some(text) = block.get("text").and_then(Value::as_str) else {
                continue;
            };
            if text.len() > MAX_PARSED_BYTES
                || !text.trim_start().starts_with('{')
                || !text.contains("additional_tools")
            {
                continue;
            }
            let Ok(Value::Object(mut parsed)) = serde_json::from_str::<Value>(text) else {
                continue;
            };
            let Some(Value::Array(entries)) = parsed.remove("additional_tools") else {
                continue;
            };
            for mut entry in entries {
                if let Some(Value::String(name)) = entry.get_mut("name").map(Value::take) {
                    let schema = entry.get_mut("parameters").map_or(Value::Null, Value::take);
                    self.0.push(Tool {
                        name: Cow::Owned(name),
                        namespace: None,
                        kind: Kind::Function,
                        schema: Cow::Owned(schema),
                    });
                }
            }
        }
    }
}

/// Every tool the request declares: `tools`, and for Responses also the
/// tools Codex sends in input items (`additional_tools`, or the JSON text
/// of a developer message).
fn declared_tools(api: Api, body: &Value) -> Tools<'_> {
    let mut tools = Tools::default();
    let null = &Value::Null;
    for entry in body.get("tools").and_then(Value::as_array).into_iter().flatten() {
        match api {
            Api::Chat => {
                let function = entry.get("function").unwrap_or(null);
                tools.push(
                    function.get("name").unwrap_or(null),
                    None,
                    Kind::Function,
                    function.get("parameters"),
                );
            }
            Api::Messages => tools.push(
                entry.get("name").unwrap_or(null),
                None,
                Kind::Function,
                entry.get("input_schema"),
            ),
            Api::Responses => tools.push_responses(entry, None),
            Api::Completions => {}
        }
    }
    if api == Api::Responses {
        for item in body.get("input").and_then(Value::as_array).into_iter().flatten() {
            for key in ["additional_tools", "tools"] {
                for entry in item.get(key).and_then(Value::as_array).into_iter().flatten() {
                    tools.push_responses(entry, None);
                }
            }
            if item.get("type").and_then(Value::as_str) == Some("message") {
                tools.push_text_carried(item);
            }
        }
    }
    tools
}

/// The conversation as far as the script needs it.
#[derive(Debug, Default)]
struct Convo<'a> {
    /// The first user text, and the last (each bounded).
    first: String,
    last: String,
    /// Tool results since the last user text: how far the turn has got.
    results_since_user: usize,
    /// The last of those results (a subagent id is read from it).
    last_result: Option<Cow<'a, Value>>,
    /// Whether any user text asked for a subagent.
    spawn_asked: bool,
    seen_user: bool,
}

impl<'a> Convo<'a> {
    fn read(api: Api, body: &'a Value) -> Self {
        let mut convo = Self::default();
        let null = &Value::Null;
        let list = |key: &str| body.get(key).and_then(Value::as_array).into_iter().flatten();
        match api {
            Api::Messages => {
                for message in list("messages") {
                    if message.get("role").and_then(Value::as_str) != Some("user") {
                        continue;
                    }
                    let content = message.get("content").unwrap_or(null);
                    // A user message carrying tool results is the harness
                    // answering calls, not the user speaking.
                    let results = content
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter(|b| b.get("type").and_then(Value::as_str) == Some("tool_result"));
                    let mut any = false;
                    for result in results {
                        any = true;
                        convo.result(Cow::Borrowed(result.get("content").unwrap_or(null)));
                    }
                    if !any {
                        convo.user(text_of(content));
                    }
                }
            }
            Api::Chat => {
                for message in list("messages") {
                    let content = message.get("content").unwrap_or(null);
                    match message.get("role").and_then(Value::as_str) {
                        Some("tool") => convo.result(Cow::Owned(Value::String(text_of(content)))),
                        Some("user") => convo.user(text_of(content)),
                        _ => {}
                    }
                }
            }
            Api::Responses => match body.get("input") {
                Some(Value::String(text)) => convo.user(bounded(text).to_owned()),
                Some(Value::Array(items)) => {
                    for item in items {
                        let content = item.get("content").unwrap_or(null);
                        match item.get("type").and_then(Value::as_str) {
                            Some("function_call_output" | "custom_tool_call_output" | "local_shell_call_output") => {
                                convo.result(Cow::Borrowed(item.get("output").unwrap_or(null)));
                            }
                            Some("message") | None if item.get("role").and_then(Value::as_str) == Some("user") => {
                                convo.user(text_of(content));
                            }
                            // Codex's agents talk in agent messages; only a
                            // new task starts a turn (a spawned subagent's).
                            // The task itself travels as encrypted content.
                            Some("agent_message") => {
                                let mut text = text_of(content);
                                for block in content.as_array().into_iter().flatten() {
                                    if let Some(secret) = block.get("encrypted_content").and_then(Value::as_str) {
                                        push_bounded(&mut text, " ");
                                        push_bounded(&mut text, secret);
                                    }
                                }
                                if text.contains(CODEX_NEW_TASK) {
                                    convo.user(text);
                                }
                            }
                            _ => {}
                        }
                    }
                }
                _ => {}
            },
            Api::Completions => {}
        }
        convo
    }

    fn user(&mut self, text: String) {
        if text.trim_start().starts_with(OPENCLAW_INTERNAL) {
            return;
        }
        if !self.seen_user {
            self.seen_user = true;
            self.first.clone_from(&text);
        }
        self.spawn_asked |= text.contains(SPAWN_MARKER);
        self.last = text;
        self.results_since_user = 0;
        self.last_result = None;
    }

    fn result(&mut self, result: Cow<'a, Value>) {
        self.results_since_user += 1;
        self.last_result = Some(result);
    }
}

/// The text of a message content: a string, or its text blocks joined by
/// newlines; at most `MAX_TEXT_BYTES` of it.
fn text_of(content: &Value) -> String {
    match content {
        Value::String(text) => bounded(text).to_owned(),
        Value::Array(blocks) => {
            let mut out = String::new();
            let mut joined = 0;
            for block in blocks {
                let text = match block {
                    Value::String(text) => text.as_str(),
                    Value::Object(_)
                        if matches!(
                            block.get("type").and_then(Value::as_str),
                            Some("text" | "input_text" | "output_text")
                        ) =>
                    {
                        block.get("text").and_then(Value::as_str).unwrap_or("")
                    }
                    _ => continue,
                };
                if joined > 0 {
                    push_bounded(&mut out, "\n");
                }
                joined += 1;
                push_bounded(&mut out, text);
                if out.len() >= MAX_TEXT_BYTES {
                    break;
                }
            }
            out
        }
        _ => String::new(),
    }
}

/// The first `MAX_TEXT_BYTES` of `text`, cut at a character boundary.
fn bounded(text: &str) -> &str {
    &text[..text.floor_char_boundary(MAX_TEXT_BYTES)]
}

/// Appends as much of `text` as keeps `out` within `MAX_TEXT_BYTES`.
fn push_bounded(out: &mut String, text: &str) {
    let room = MAX_TEXT_BYTES.saturating_sub(out.len());
    out.push_str(&text[..text.floor_char_boundary(room)]);
}

/// What the arguments built from a tool's schema are for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fill {
    Shell,
    /// The shell, in a subagent.
    SubShell,
    Spawn,
    Wait,
}

/// Enum values preferred when a required argument has an enum (the general
/// agent type of each harness).
const PREFERRED_ENUM: [&str; 4] = ["general-purpose", "general", "default", "worker"];

/// Arguments for `tool` built from its schema: every required property
/// gets a value by its name or type, and the command or the subagent's task
/// is set even where optional.
fn fill(tool: &Tool<'_>, kind: Fill) -> Value {
    let empty = Map::new();
    let props = tool.properties().unwrap_or(&empty);
    let required = tool.schema.get("required").and_then(Value::as_array);
    let shell = matches!(kind, Fill::Shell | Fill::SubShell);
    let command = |ty: Option<&str>| {
        let command = if kind == Fill::SubShell { "echo sub" } else { "echo hi" };
        if ty == Some("array") {
            json!(["bash", "-lc", command])
        } else {
            json!(command)
        }
    };
    let agent_type = if matches!(&*tool.name, "Task" | "Agent") {
        "general-purpose"
    } else {
        "general"
    };
    let mut args = Map::new();
    for key in required
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .take(MAX_REQUIRED)
    {
        let prop = props.get(key).unwrap_or(&Value::Null);
        let ty = prop.get("type").and_then(Value::as_str);
        let enumerated = prop.get("enum").and_then(Value::as_array).filter(|e| !e.is_empty());
        let value = if let Some(values) = enumerated {
            values
                .iter()
                .find(|v| v.as_str().is_some_and(|s| PREFERRED_ENUM.contains(&s)))
                .or(values.first())
                .cloned()
                .unwrap_or(Value::Null)
        } else {
            match key.to_ascii_lowercase().as_str() {
                "command" | "cmd" => command(ty),
                "prompt" | "message" | "task" | "instructions" | "input" => json!(SUB_PROMPT),
                "description" => json!(if shell {
                    "Print a greeting"
                } else {
                    "Echo in a subagent"
                }),
                "subagent_type" | "agent_type" => json!(agent_type),
                _ => match ty {
                    Some("array") => json!([]),
                    Some("integer" | "number") => json!(10000),
                    Some("boolean") => json!(false),
                    Some("object") => json!({}),
                    _ => json!("x"),
                },
            }
        };
        args.insert(key.to_owned(), value);
    }
    if shell {
        for key in ["command", "cmd"] {
            if let Some(prop) = props.get(key)
                && !args.contains_key(key)
            {
                args.insert(key.to_owned(), command(prop.get("type").and_then(Value::as_str)));
            }
        }
    }
    if kind == Fill::Spawn {
        if let Some(key) = ["prompt", "message", "task"]
            .into_iter()
            .find(|k| props.contains_key(*k) && !args.contains_key(*k))
        {
            args.insert(key.to_owned(), json!(SUB_PROMPT));
        }
        if matches!(&*tool.name, "Task" | "Agent" | "task") {
            for key in ["subagent_type", "agent_type"] {
                if props.contains_key(key) && !args.contains_key(key) {
                    args.insert(key.to_owned(), json!(agent_type));
                }
            }
        }
    }
    Value::Object(args)
}

/// Arguments for the wait tool: the spawned agent's id, read from the
/// spawn call's result ("x" when it has none), and a long timeout.
fn wait_arguments(wait: &Tool<'_>, last_result: Option<&Cow<'_, Value>>) -> Value {
    let id = last_result.and_then(|r| spawned_id(r)).unwrap_or_else(|| json!("x"));
    let mut args = fill(wait, Fill::Wait);
    if let (Some(args), Some(props)) = (args.as_object_mut(), wait.properties()) {
        for key in props.keys() {
            match key.as_str() {
                "ids" | "targets" | "agent_ids" => {
                    args.insert(key.clone(), json!([id.clone()]));
                }
                "id" | "target" | "agent_id" => {
                    args.insert(key.clone(), id.clone());
                }
                _ if key.contains("timeout") => {
                    args.insert(key.clone(), json!(30000));
                }
                _ => {}
            }
        }
    }
    args
}

/// The id in a spawn call's result: an object, or JSON text of one (perhaps
/// encoded twice), with `agent_id`, `id` or `task_name`.
fn spawned_id(result: &Value) -> Option<Value> {
    let mut value = Cow::Borrowed(result);
    for _ in 0..2 {
        let Value::String(text) = value.as_ref() else {
            break;
        };
        if text.len() > MAX_PARSED_BYTES {
            return None;
        }
        value = Cow::Owned(serde_json::from_str(text).ok()?);
    }
    let object = value.as_object()?;
    ["agent_id", "id", "task_name"]
        .into_iter()
        .filter_map(|k| object.get(k))
        .find(|v| truthy(v))
        .cloned()
}

/// JSON truthiness as the capture server's Python saw it.
fn truthy(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema(props: Value, required: &[&str]) -> Value {
        json!({"type": "object", "properties": props, "required": required})
    }

    fn call_of(script: Option<Script>) -> (String, Option<String>, Value) {
        match script {
            Some(Script::Call(ToolCall {
                name,
                namespace,
                input: CallInput::Json(args),
            })) => (name, namespace, args),
            other => panic!("not a function call: {other:?}"),
        }
    }

    fn text_of_script(script: Option<Script>) -> String {
        match script {
            Some(Script::Text(text)) => text,
            other => panic!("not text: {other:?}"),
        }
    }

    /// OpenCode over Chat: bash, then task, then the answer.
    #[test]
    fn chat_session_calls_the_shell_then_the_subagent_then_answers() {
        let tools = json!([
            {"type": "function", "function": {"name": "bash",
             "parameters": schema(json!({"command": {"type": "string"}, "timeout": {"type": "integer"}}), &["command"])}},
            {"type": "function", "function": {"name": "task", "parameters": schema(
                json!({"description": {"type": "string"}, "prompt": {"type": "string"}, "subagent_type": {"type": "string"}}),
                &["description", "prompt", "subagent_type"])}},
        ]);
        let mut messages = vec![
            json!({"role": "system", "content": "you are an agent"}),
            json!({"role": "user", "content": [{"type": "text", "text": "KVSPAWN: run echo hi, then a subagent"}]}),
        ];
        let body = |messages: &[Value]| json!({"messages": messages, "tools": tools});
        let (name, _, args) = call_of(decide(Api::Chat, &body(&messages)));
        assert_eq!((name.as_str(), args), ("bash", json!({"command": "echo hi"})));
        messages.push(json!({"role": "assistant", "tool_calls": [{"id": "c1"}]}));
        messages.push(json!({"role": "tool", "tool_call_id": "c1", "content": "hi"}));
        let (name, _, args) = call_of(decide(Api::Chat, &body(&messages)));
        assert_eq!(name, "task");
        assert_eq!(
            args,
            json!({"description": "Echo in a subagent", "prompt": SUB_PROMPT, "subagent_type": "general"})
        );
        messages.push(json!({"role": "tool", "tool_call_id": "c2", "content": "sub"}));
        assert_eq!(
            text_of_script(decide(Api::Chat, &body(&messages))),
            "Done: the shell printed hi."
        );
        // A new user message starts a new turn: the shell again, and without
        // KVSPAWN in it still a subagent (it was asked in the conversation).
        messages.push(json!({"role": "user", "content": "KV2: again"}));
        assert_eq!(call_of(decide(Api::Chat, &body(&messages))).0, "bash");
    }

    /// Codex without code mode: `shell` takes an argv; `spawn_agent`, then
    /// `wait_agent` on the id the spawn returned.
    #[test]
    fn responses_session_waits_for_the_agent_it_spawned() {
        let tools = json!([
            {"type": "function", "name": "shell",
             "parameters": schema(json!({"command": {"type": "array"}}), &["command"])},
            {"type": "namespace", "name": "collaboration", "tools": [
                {"type": "function", "name": "spawn_agent",
                 "parameters": schema(json!({"message": {"type": "string"}, "fork": {"type": "boolean"}}), &["message", "fork"])},
                {"type": "function", "name": "wait_agent",
                 "parameters": schema(json!({"ids": {"type": "array"}, "timeout_ms": {"type": "number"}}), &["ids"])}]},
        ]);
        let mut input = vec![json!({"type": "message", "role": "user",
                                    "content": [{"type": "input_text", "text": "KVSPAWN please"}]})];
        let body = |input: &[Value]| json!({"input": input, "tools": tools});
        let (name, ns, args) = call_of(decide(Api::Responses, &body(&input)));
        assert_eq!((name.as_str(), ns), ("shell", None));
        assert_eq!(args, json!({"command": ["bash", "-lc", "echo hi"]}));
        input.push(json!({"type": "function_call_output", "call_id": "a", "output": "hi"}));
        let (name, ns, args) = call_of(decide(Api::Responses, &body(&input)));
        assert_eq!((name.as_str(), ns.as_deref()), ("spawn_agent", Some("collaboration")));
        assert_eq!(args, json!({"message": SUB_PROMPT, "fork": false}));
        // The spawn's result is JSON text, encoded once more as a string.
        let result = json!({"agent_id": "agent-7"}).to_string();
        input.push(json!({"type": "function_call_output", "call_id": "b", "output": json!(result).to_string()}));
        let (name, ns, args) = call_of(decide(Api::Responses, &body(&input)));
        assert_eq!((name.as_str(), ns.as_deref()), ("wait_agent", Some("collaboration")));
        assert_eq!(args, json!({"ids": ["agent-7"], "timeout_ms": 30000}));
        input.push(json!({"type": "function_call_output", "call_id": "c", "output": "done"}));
        assert_eq!(
            text_of_script(decide(Api::Responses, &body(&input))),
            "Done: the shell printed hi."
        );
    }

    #[test]
    fn a_subagent_runs_echo_sub_and_spawns_nothing() {
        let tools = json!([{"name": "Bash", "input_schema": schema(json!({"command": {"type": "string"}}), &["command"])},
                           {"name": "Agent", "input_schema": schema(json!({"prompt": {"type": "string"}}), &["prompt"])}]);
        let mut messages = vec![json!({"role": "user", "content": SUB_PROMPT})];
        let body = |messages: &[Value]| json!({"messages": messages, "tools": tools});
        let (name, _, args) = call_of(decide(Api::Messages, &body(&messages)));
        assert_eq!((name.as_str(), args), ("Bash", json!({"command": "echo sub"})));
        messages.push(json!({"role": "user", "content": [{"type": "tool_result", "content": "sub"}]}));
        assert_eq!(
            text_of_script(decide(Api::Messages, &body(&messages))),
            "Subagent done: it printed sub."
        );
    }

    #[test]
    fn openclaw_internal_context_and_codex_agent_messages_are_not_user_turns() {
        let tools = json!([{"type": "function", "function": {"name": "exec", "parameters": {}}},
                           {"type": "function", "function": {"name": "tool_call", "parameters": {}}},
                           {"type": "function", "function": {"name": "sessions_yield", "parameters": {}}}]);
        let messages = json!([
            {"role": "user", "content": "KV1: run echo hi"},
            {"role": "assistant", "tool_calls": []},
            {"role": "tool", "content": "hi"},
            {"role": "user", "content": [{"type": "text", "text": "\n<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nnone"}]},
        ]);
        let body = json!({"messages": messages, "tools": tools});
        assert_eq!(text_of_script(decide(Api::Chat, &body)), "Done: the shell printed hi.");

        let tools = json!([{"type": "function", "name": "exec_command",
                            "parameters": schema(json!({"cmd": {"type": "string"}}), &["cmd"])}]);
        let input = json!([
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "KV1"}]},
            {"type": "function_call_output", "output": "hi"},
            {"type": "agent_message", "content": [{"type": "input_text", "text": "Message Type: RESULT"}]},
        ]);
        let body = json!({"input": input, "tools": tools});
        assert_eq!(
            text_of_script(decide(Api::Responses, &body)),
            "Done: the shell printed hi."
        );
        // A NEW_TASK agent message is a subagent's turn, its task encrypted.
        let input = json!([
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "KVSPAWN"}]},
            {"type": "function_call_output", "output": "hi"},
            {"type": "agent_message", "content": [{"type": "input_text", "text": "Message Type: NEW_TASK"},
                                                  {"type": "encrypted_content", "encrypted_content": SUB_PROMPT}]},
        ]);
        let body = json!({"input": input, "tools": tools});
        let (name, _, args) = call_of(decide(Api::Responses, &body));
        assert_eq!((name.as_str(), args), ("exec_command", json!({"cmd": "echo sub"})));
    }

    #[test]
    fn a_turn_that_keeps_calling_back_is_capped() {
        let tools = json!([{"type": "function", "function": {"name": "bash", "parameters": {}}}]);
        let mut messages = vec![json!({"role": "user", "content": "KVSPAWN"})];
        for _ in 0..MAX_RESULTS_PER_TURN {
            messages.push(json!({"role": "tool", "content": "x"}));
        }
        let body = json!({"messages": messages, "tools": tools});
        assert_eq!(text_of_script(decide(Api::Chat, &body)), "Done (cap).");
    }

    #[test]
    fn completions_are_not_scripted_and_required_enums_prefer_the_general_agent() {
        assert_eq!(decide(Api::Completions, &json!({"prompt": "hi"})), None);
        let tools = json!([{"name": "bash", "input_schema": schema(json!({
            "command": {"type": "string"}, "mode": {"enum": ["fast", "default"]}, "n": {"type": "integer"},
            "flag": {"type": "boolean"}, "opts": {"type": "object"}, "list": {"type": "array"}, "other": {}}),
            &["command", "mode", "n", "flag", "opts", "list", "other"])}]);
        let body = json!({"messages": [{"role": "user", "content": "go"}], "tools": tools});
        let (_, _, args) = call_of(decide(Api::Messages, &body));
        assert_eq!(
            args,
            json!({"command": "echo hi", "mode": "default", "n": 10000, "flag": false, "opts": {}, "list": [], "other": "x"})
        );
    }

    #[test]
    fn hostile_bodies_get_an_answer_not_a_panic() {
        let long = "é".repeat(MAX_TEXT_BYTES); // twice the bound, in 2-byte characters
        let bodies = [
            json!(null),
            json!(7),
            json!({"messages": 7, "input": {}, "tools": "x"}),
            json!({"messages": [null, 1, "x", {"role": 5}, {"role": "user", "content": {"a": 1}}],
                   "tools": [1, null, {"function": 5}, {"name": 3}, {"function": {"name": "bash", "parameters": 4}}]}),
            json!({"messages": [{"role": "user", "content": [null, 5, {"type": "text", "text": 9}, {"type": "tool_result"}]}],
                   "tools": [{"name": "Bash", "input_schema": {"properties": 1, "required": [1, null, "command"]}}]}),
            json!({"input": [null, {"type": "namespace", "tools": [{"type": "namespace", "name": "x", "tools": 4}]},
                             {"type": "additional_tools", "tools": [{"type": "namespace"}, 5]},
                             {"type": "message", "role": "developer", "content": [{"text": "{\"additional_tools\": [1, {\"name\": 2}, {\"name\": \"exec_command\"}]}"}]},
                             {"type": "agent_message", "content": 5},
                             {"type": "function_call_output"}],
                   "tools": [{"type": "custom", "name": "exec"}]}),
            json!({"input": long.clone(), "tools": [{"type": "function", "name": "Task"}]}),
            json!({"messages": [{"role": "user", "content": long}], "tools": [{"name": "spawn_agent"}, {"name": "wait"}]}),
        ];
        for body in &bodies {
            for api in [Api::Chat, Api::Responses, Api::Messages] {
                assert!(decide(api, body).is_some(), "{api:?} {body}");
            }
        }
        // Tools carried as text (older Codex) are found.
        let body = json!({"input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text",
             "text": "{\"additional_tools\": [1, {\"name\": 2}, {\"name\": \"exec_command\"}]}"}]},
            {"type": "message", "role": "user", "content": "KV1"}]});
        let (name, _, args) = call_of(decide(Api::Responses, &body));
        assert_eq!((name.as_str(), args), ("exec_command", json!({})));
    }

    #[test]
    fn texts_are_bounded_at_a_character_boundary() {
        let long = format!("a{}", "é".repeat(MAX_TEXT_BYTES));
        let text = text_of(&json!(long));
        assert!(
            text.len() <= MAX_TEXT_BYTES && text.len() > MAX_TEXT_BYTES - 2,
            "{}",
            text.len()
        );
        let blocks = json!([{"type": "text", "text": long}, {"type": "text", "text": "KVSPAWN"}]);
        assert!(text_of(&blocks).len() <= MAX_TEXT_BYTES);
        let joined = text_of(&json!([{"type": "input_text", "text": "a"}, {"type": "image"}, "b"]));
        assert_eq!(joined, "a\nb");
    }
}
