//! The sidecar's module layering, read from its source: the modules'
//! `crate::` references form no cycle, no edge imports another edge, and
//! the pure modules import only pure modules and do no I/O. `lib.rs` is the
//! composition root that wires the edges together and is left out; a module
//! that reaches a re-export through the root (`crate::Settings`) counts as
//! importing `lib`, which closes a cycle.
//!
//! Every module must be listed in exactly one layer below, so a new one is
//! placed on purpose.
#![allow(clippy::unwrap_used)] // reading its own source tree: failing loudly is the point

mod source_tree;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Each at one kind of I/O; none may import another.
const EDGES: &[&str] = &["admin", "service", "shutdown", "store", "watcher", "kv_subscriber"];
/// Below every edge; may import each other (acyclically) and pure modules.
const SHARED: &[&str] = &[
    "auth",
    "clock",
    "config",
    "lock",
    "metrics",
    "report",
    "retention_report",
    "state",
];
/// No I/O, no tokio: import only each other.
const PURE: &[&str] = &["bounds", "engine_metrics", "kv_events", "snapshot", "wire"];
/// Crates and std modules that a pure module must not name.
const IO: &[&str] = &[
    "tokio",
    "tonic",
    "axum",
    "redis",
    "reqwest",
    "hyper",
    "std::net",
    "std::fs",
    "std::process",
    "std::io",
];

type Graph = BTreeMap<String, BTreeSet<String>>;

/// Source with `//` comments removed (a doc line naming `crate::x` is no
/// import; see `source_tree::code_of`).
fn code(source: &str) -> String {
    source.lines().map(source_tree::code_of).collect::<Vec<_>>().join("\n")
}

fn ident(text: &str) -> &str {
    let end = text
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    &text[..end]
}

/// The first path segment after every `crate::`, including each top-level
/// name of a `crate::{a, b::c}` group.
fn references(source: &str) -> BTreeSet<String> {
    let code = code(source);
    let mut found = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        // `kvmesh_crate::` or similar is not this crate.
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        let rest = code[at + "crate::".len()..].trim_start();
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 0usize;
            let mut start = true;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => start = true,
                    c if start && !c.is_whitespace() => {
                        start = false;
                        let name = ident(&group[i..]);
                        if !name.is_empty() {
                            found.insert(name.to_owned());
                        }
                    }
                    _ => {}
                }
            }
        } else {
            let name = ident(rest);
            if !name.is_empty() {
                found.insert(name.to_owned());
            }
        }
    }
    found
}

/// Module → the modules it references (`lib` for anything that is not a
/// module: a re-export or an item of the root).
fn graph(sources: &BTreeMap<String, String>) -> Graph {
    sources
        .iter()
        .filter(|(name, _)| name.as_str() != "lib")
        .map(|(name, source)| {
            let targets = references(source)
                .into_iter()
                .map(|target| {
                    if sources.contains_key(&target) {
                        target
                    } else {
                        "lib".to_owned()
                    }
                })
                .filter(|target| target != name)
                .collect();
            (name.clone(), targets)
        })
        .collect()
}

/// A cycle, as the modules along it, if there is one.
fn cycle(graph: &Graph) -> Option<Vec<String>> {
    fn visit(node: &str, graph: &Graph, done: &mut BTreeSet<String>, path: &mut Vec<String>) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, done, path) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut done, &mut Vec::new()))
}

/// Every broken layering rule, as a sentence.
fn violations(sources: &BTreeMap<String, String>) -> Vec<String> {
    let graph = graph(sources);
    let mut problems = Vec::new();
    for name in sources.keys().filter(|n| n.as_str() != "lib" && n.as_str() != "main") {
        let layers = [EDGES, SHARED, PURE]
            .iter()
            .filter(|l| l.contains(&name.as_str()))
            .count();
        if layers != 1 {
            problems.push(format!(
                "{name}.rs is in {layers} layers of tests/module_graph.rs, not one"
            ));
        }
    }
    for (from, targets) in &graph {
        for to in targets {
            if EDGES.contains(&from.as_str()) && EDGES.contains(&to.as_str()) {
                problems.push(format!("edge {from} imports edge {to}"));
            }
            if PURE.contains(&from.as_str()) && !PURE.contains(&to.as_str()) {
                problems.push(format!("pure module {from} imports {to}"));
            }
            if SHARED.contains(&from.as_str()) && EDGES.contains(&to.as_str()) {
                problems.push(format!("{from} (below the edges) imports edge {to}"));
            }
        }
    }
    for name in PURE {
        if let Some(source) = sources.get(*name) {
            let code = code(source);
            for io in IO {
                if code.contains(&format!("{io}::")) || code.contains(&format!("use {io};")) {
                    problems.push(format!("pure module {name} names {io}"));
                }
            }
        }
    }
    if let Some(cycle) = cycle(&graph) {
        problems.push(format!("import cycle: {}", cycle.join(" -> ")));
    }
    problems
}

fn sources(dir: &Path) -> BTreeMap<String, String> {
    let mut sources = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "rs") {
            let name = path.file_stem().unwrap().to_string_lossy().into_owned();
            sources.insert(name, std::fs::read_to_string(&path).unwrap());
        }
    }
    sources
}

#[test]
fn modules_are_layered_without_cycles() {
    let sources = sources(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    assert!(sources.contains_key("state") && sources.contains_key("service"));
    let problems = violations(&sources);
    assert!(
        problems.is_empty(),
        "sidecar/src layering:\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn an_edge_importing_an_edge_is_caught() {
    let mut sources = sources(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let store = sources.get_mut("store").unwrap();
    store.insert_str(0, "use crate::service::RouterService;\n");
    let problems = violations(&sources);
    assert!(
        problems.contains(&"edge store imports edge service".to_owned()),
        "{problems:?}"
    );
}

#[test]
fn a_cycle_is_caught() {
    let mut sources = sources(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let metrics = sources.get_mut("metrics").unwrap();
    metrics.push_str("\nfn shared(_: &crate::state::Shared) {}\n");
    let problems = violations(&sources);
    assert!(
        problems
            .iter()
            .any(|p| p.starts_with("import cycle:") && p.contains("metrics") && p.contains("state")),
        "{problems:?}"
    );
}

#[test]
fn references_read_every_form() {
    let source = "use crate::a::B;\nuse crate::{c, d::{E, F}, g};\nfn x() { crate::h::i(); }\n\
                  // crate::commented\nuse kvmesh_crate::not_ours;\n";
    let found: Vec<String> = references(source).into_iter().collect();
    assert_eq!(found, ["a", "c", "d", "g", "h"]);
}
