//! The router has one owner: `src/state.rs` alone takes its lock, and
//! every edge goes through the narrow methods of `Shared` (issue 26). Read
//! from the source: a line anywhere else under `src/` that names the
//! router's guard accessor, its mutex or locks it fails, and so does a
//! guard accessor the owner would hand out again.

mod source_tree;

use std::path::{Path, PathBuf};

/// What only the owner may write: the guard accessor, the mutex's type and
/// a lock of it.
const LOCKING: &[&str] = &[".router()", "Mutex<Router>", "router.lock("];

/// The files that form the owner: `state.rs` and its own submodules.
fn is_owner(relative: &Path) -> bool {
    relative == Path::new("state.rs") || relative.starts_with("state")
}

fn sidecar_sources() -> Vec<(PathBuf, String)> {
    source_tree::rust_sources(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"))
}

/// Every line that breaks the rule, as `file:line: text`.
fn violations(sources: &[(PathBuf, String)]) -> Vec<String> {
    let mut found = Vec::new();
    for (path, text) in sources {
        for (n, line) in text.lines().enumerate() {
            let at = format!("src/{}:{}: {}", path.display(), n + 1, line.trim());
            if is_owner(path) {
                // The owner keeps its accessor private: a visible one would
                // let the edges lock the router again.
                let visible = line.find("fn router(").is_some_and(|i| line[..i].contains("pub"));
                if visible {
                    found.push(format!("{at} (the owner hands out the router's guard)"));
                }
            } else if LOCKING.iter().any(|needle| line.contains(needle)) {
                found.push(format!("{at} (only src/state.rs may lock the router)"));
            }
        }
    }
    found
}

#[test]
fn only_state_locks_the_router() {
    let sources = sidecar_sources();
    // Read for real: the owner and the edges that once locked it are there.
    for known in [
        "state.rs",
        "admin.rs",
        "watcher.rs",
        "store.rs",
        "kv_subscriber.rs",
        "service.rs",
    ] {
        assert!(
            sources
                .iter()
                .any(|(path, text)| path == Path::new(known) && !text.is_empty()),
            "src/{known} was not read"
        );
    }
    let found = violations(&sources);
    assert!(
        found.is_empty(),
        "the router locked outside its owner:\n  {}",
        found.join("\n  ")
    );
}

#[test]
fn an_edge_locking_the_router_is_caught() {
    let mut sources = sidecar_sources();
    let Some((_, admin)) = sources.iter_mut().find(|(path, _)| path == Path::new("admin.rs")) else {
        panic!("src/admin.rs was not read");
    };
    admin.push_str("\nfn locks(shared: &Shared) -> usize { shared.router().workers().len() }\n");
    let found = violations(&sources);
    assert!(
        found.len() == 1 && found[0].starts_with("src/admin.rs:") && found[0].contains(".router()"),
        "{found:?}"
    );
}

#[test]
fn a_visible_guard_accessor_is_caught() {
    let mut sources = sidecar_sources();
    let Some((_, state)) = sources.iter_mut().find(|(path, _)| path == Path::new("state.rs")) else {
        panic!("src/state.rs was not read");
    };
    *state = state.replace("    fn router(&self)", "    pub(crate) fn router(&self)");
    let found = violations(&sources);
    assert!(found.len() == 1 && found[0].starts_with("src/state.rs:"), "{found:?}");
}
