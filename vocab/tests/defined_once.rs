//! Each word of the shared vocabulary is defined once in the workspace: no
//! crate spells its own `SectionKind`, `PromptSection` or `Harness` (or the
//! harness names as a list of strings) beside `kvmesh-vocab`. The wire's `SectionKind`, which
//! prost generates from the proto under `proto/src/gen`, is the one other
//! spelling, and it converts only in `proto/src/vocab.rs`.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if path.is_dir() {
            if !matches!(
                name.as_ref(),
                "target" | ".git" | ".tools" | "gen" | "corpus" | "artifacts"
            ) {
                rust_files(&path, out);
            }
        } else if name.ends_with(".rs") && !path.ends_with("vocab/tests/defined_once.rs") {
            out.push(path);
        }
    }
}

/// Where `needle` occurs in the workspace's own Rust sources.
fn occurrences(needle: &str) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    let mut found = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        for (n, line) in text.lines().enumerate() {
            if line.contains(needle) && !line.trim_start().starts_with("//") {
                let shown = file.strip_prefix(&root).unwrap_or(&file).display().to_string();
                found.push(format!("{shown}:{}", n + 1));
            }
        }
    }
    found
}

#[test]
fn section_kind_and_harness_are_defined_once() {
    for needle in ["enum SectionKind", "enum Harness", "struct PromptSection"] {
        let found = occurrences(needle);
        assert!(
            found.len() == 1 && found[0].starts_with("vocab/src/lib.rs:"),
            "{needle} defined elsewhere too: {found:?}"
        );
    }
}

/// A prompt section is converted to and from the wire in one place: no
/// crate builds the wire's section from its fields but `proto/src/vocab.rs`.
#[test]
fn prompt_sections_convert_to_the_wire_in_one_module() {
    let found = occurrences_outside_the_wire_module("start_byte:");
    assert!(found.is_empty(), "a section conversion outside it: {found:?}");
}

#[test]
fn the_harness_names_are_listed_once() {
    // The names as a list (an array of the five strings) live only in
    // `Harness::name`; anywhere else they must come from it.
    let found = occurrences("\"claude_code\", \"codex\"");
    assert!(found.is_empty(), "harness names spelled as a list: {found:?}");
}

#[test]
fn section_kinds_convert_to_the_wire_in_one_module() {
    let found = occurrences_outside_the_wire_module("v1::SectionKind::Tools");
    assert!(found.is_empty(), "a kind conversion outside it: {found:?}");
}

/// Where `needle` occurs outside `proto/src/vocab.rs`, the one module that
/// converts the vocabulary to and from the wire.
fn occurrences_outside_the_wire_module(needle: &str) -> Vec<String> {
    occurrences(needle)
        .into_iter()
        .filter(|at| !at.starts_with("proto/src/vocab.rs"))
        .collect()
}
