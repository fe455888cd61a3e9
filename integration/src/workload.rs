//! Request bodies shaped like a coding agent's: a large system prompt and tool
//! list, then turns that each append an assistant tool call and its result.
//! The shape follows the OpenAI chat form harnesses send (see HARNESSES.md).

use serde_json::{Value, json};

/// A coding agent's conversation, one call per turn.
#[derive(Debug, Clone)]
pub struct AgentSession {
    /// Distinguishes the system prompt and repository context, so different
    /// sessions have different prefixes.
    pub repo: String,
    pub model: String,
}

impl AgentSession {
    pub fn new(repo: &str) -> Self {
        Self {
            repo: repo.to_owned(),
            model: "qwen3-coder-30b".to_owned(),
        }
    }

    fn system_prompt(&self) -> String {
        let mut text = format!(
            "You are a coding agent working in the repository {repo}. Follow the user's instructions, \
             use the tools to read and edit files, and run the tests before you finish.\n",
            repo = self.repo
        );
        for rule in 0..40 {
            text.push_str(&format!(
                "Rule {rule}: keep changes small, explain why, never invent APIs of {}.\n",
                self.repo
            ));
        }
        text
    }

    fn tools() -> Value {
        json!([
            {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository",
              "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
            {"type": "function", "function": {"name": "run_tests", "description": "Run the test suite",
              "parameters": {"type": "object", "properties": {}}}}
        ])
    }

    /// The request body of call `turn` (0-based): every earlier turn's
    /// messages, unchanged, plus one more tool round trip.
    pub fn call(&self, turn: usize) -> Value {
        let mut messages = vec![
            json!({"role": "system", "content": self.system_prompt()}),
            json!({"role": "user", "content": format!("Fix the failing test in {}.", self.repo)}),
        ];
        for t in 0..turn {
            let id = format!("call_{t}");
            messages.push(json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": id, "type": "function", "function": {"name": "read_file",
                 "arguments": format!("{{\"path\":\"src/module_{t}.rs\"}}")}}]}));
            messages.push(json!({"role": "tool", "tool_call_id": id,
                "content": format!("// src/module_{t}.rs of {}\n{}", self.repo, "fn helper() -> u32 { 42 }\n".repeat(12))}));
        }
        json!({
            "model": self.model,
            "messages": messages,
            "tools": Self::tools(),
            "max_tokens": 64,
            "stream": false,
        })
    }

    /// [`AgentSession::call`] streamed, as agents call: SSE, with the usage
    /// chunk at the end (`stream_options.include_usage`).
    pub fn streamed_call(&self, turn: usize) -> Value {
        let mut body = self.call(turn);
        body["stream"] = Value::Bool(true);
        body["stream_options"] = json!({"include_usage": true});
        body
    }
}

/// The system prompt of the tool-loop session the API tests send in
/// `repo`: about 700 tokens, the same on every call.
pub fn tool_loop_system_prompt(repo: &str) -> String {
    format!("You are a coding agent in {repo}. Read files, run tests, keep changes small.\n").repeat(30)
}

/// The result of the tool-loop session's `turn`-th tool call: about 130
/// tokens more per turn.
pub fn tool_loop_tool_result(turn: usize) -> String {
    format!("// src/module_{turn}.rs\n{}", "fn helper() -> u32 { 42 }\n".repeat(12))
}

/// The chat messages of call `turn` of the tool-loop session in `repo`:
/// the system prompt, the task, then one assistant tool call and its result
/// per earlier turn (each call resends the whole conversation).
pub fn tool_loop_chat_messages(repo: &str, turn: usize) -> Vec<Value> {
    let mut messages = vec![
        json!({"role": "system", "content": tool_loop_system_prompt(repo)}),
        json!({"role": "user", "content": "Fix the failing test."}),
    ];
    for t in 0..turn {
        messages.push(
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": format!("c{t}"),
            "type": "function", "function": {"name": "read", "arguments": format!("{{\"n\":{t}}}")}}]}),
        );
        messages.push(json!({"role": "tool", "tool_call_id": format!("c{t}"), "content": tool_loop_tool_result(t)}));
    }
    messages
}
