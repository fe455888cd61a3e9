//! The source tree as tests of its shape read it: every `.rs` file under a
//! directory, and code with its `//` comments cut.

#![allow(dead_code)] // each test file uses its part

use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`, as (path relative to `dir`, text), in
/// path order.
pub(crate) fn rust_sources(dir: &Path) -> Vec<(PathBuf, String)> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<(PathBuf, String)>) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(root, &path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let relative = path.strip_prefix(root).unwrap_or(&path).to_path_buf();
                out.push((relative, std::fs::read_to_string(&path).unwrap_or_default()));
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// The line with its `//` comment cut. A `//` inside a string literal cuts
/// the rest of its line too, which can only hide code, never invent it.
pub(crate) fn code_of(line: &str) -> &str {
    line.find("//").map_or(line, |at| &line[..at])
}
