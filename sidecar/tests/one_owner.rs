//! The router has one owner (issue 26): one thread in `src/owner.rs` holds
//! it and applies commands from a channel in order, and `src/state.rs`
//! alone sends them, so every edge goes through the narrow methods of
//! `Shared`. Read from the source, with `//` comments cut:
//!
//! - a line outside `state.rs` and `owner.rs` that names the owner's
//!   handle, sends it a command, or names the router's old guard accessor,
//!   mutex or a lock of it fails;
//! - a line anywhere but `owner.rs` that puts the router behind a lock
//!   (`Mutex<Router>`, `RwLock<Router>`) fails: that would be a second way
//!   to the router, around the owner's command loop;
//! - a router accessor `state.rs` or `owner.rs` would hand out (a visible
//!   `fn router(`) fails.

mod source_tree;

use std::path::{Path, PathBuf};

use source_tree::code_of;

/// What only the owner's files may write: its handle, a command sent to
/// it, and the old guard accessor, mutex and lock.
const OWNING: &[&str] = &[
    "RouterOwner",
    "owner.run(",
    "owner.run_and_publish(",
    ".router()",
    "Mutex<Router>",
    "router.lock(",
];

/// What no file but `owner.rs` may write: the router kept behind a lock,
/// reachable without a command.
const BYPASSING: &[&str] = &["Mutex<Router>", "RwLock<Router>"];

/// The files that form the owner: `state.rs` (which sends the commands),
/// `owner.rs` (the thread that applies them) and their own submodules.
fn is_owner(relative: &Path) -> bool {
    relative == Path::new("state.rs")
        || relative.starts_with("state")
        || relative == Path::new("owner.rs")
        || relative.starts_with("owner")
}

fn is_thread(relative: &Path) -> bool {
    relative == Path::new("owner.rs") || relative.starts_with("owner")
}

fn sidecar_sources() -> Vec<(PathBuf, String)> {
    source_tree::rust_sources(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"))
}

/// Every line that breaks a rule, as `file:line: text (why)`.
fn violations(sources: &[(PathBuf, String)]) -> Vec<String> {
    let mut found = Vec::new();
    for (path, text) in sources {
        for (n, line) in text.lines().enumerate() {
            let code = code_of(line);
            let at = format!("src/{}:{}: {}", path.display(), n + 1, line.trim());
            if is_owner(path) {
                // The owner keeps any accessor private: a visible one would
                // let the edges reach the router around the commands.
                let visible = code.find("fn router(").is_some_and(|i| code[..i].contains("pub"));
                if visible {
                    found.push(format!("{at} (the owner hands out the router)"));
                }
            } else if OWNING.iter().any(|needle| code.contains(needle)) {
                found.push(format!("{at} (only src/state.rs may send the router commands)"));
                continue;
            }
            if !is_thread(path) && BYPASSING.iter().any(|needle| code.contains(needle)) {
                found.push(format!(
                    "{at} (the router behind a lock, around src/owner.rs's command loop)"
                ));
            }
        }
    }
    found
}

/// The rules' findings with `edit` applied to `file`'s text.
fn with_injected(file: &str, edit: impl FnOnce(&mut String)) -> Vec<String> {
    let mut sources = sidecar_sources();
    let at = sources.iter().position(|(path, _)| path == Path::new(file));
    assert!(at.is_some(), "src/{file} was not read");
    if let Some(at) = at {
        edit(&mut sources[at].1);
    }
    violations(&sources)
}

#[test]
fn only_state_commands_the_router() {
    let sources = sidecar_sources();
    // Read for real: the owner and the edges that once locked it are there.
    for known in [
        "state.rs",
        "owner.rs",
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
    // And the owner is what it claims: state.rs holds the handle, owner.rs
    // runs the one thread.
    let text_of = |file: &str| {
        sources
            .iter()
            .find(|(path, _)| path == Path::new(file))
            .map(|(_, text)| text.as_str())
            .unwrap_or_default()
    };
    assert!(
        text_of("state.rs").contains("owner: RouterOwner"),
        "Shared holds no RouterOwner"
    );
    assert!(
        text_of("owner.rs").contains("thread::Builder::new()"),
        "src/owner.rs starts no thread"
    );
    let found = violations(&sources);
    assert!(
        found.is_empty(),
        "the router reached outside its owner:\n  {}",
        found.join("\n  ")
    );
}

#[test]
fn an_edge_locking_the_router_is_caught() {
    let found = with_injected("admin.rs", |admin| {
        admin.push_str("\nfn locks(shared: &Shared) -> usize { shared.router().workers().len() }\n");
    });
    assert!(
        found.len() == 1 && found[0].starts_with("src/admin.rs:") && found[0].contains(".router()"),
        "{found:?}"
    );
}

#[test]
fn an_edge_sending_a_command_is_caught() {
    let found = with_injected("watcher.rs", |watcher| {
        watcher.push_str(
            "\nfn sends(shared: &Shared) -> Option<usize> { shared.owner.run(|r| r.workers().len()).ok() }\n",
        );
    });
    assert!(
        found.len() == 1 && found[0].starts_with("src/watcher.rs:") && found[0].contains("owner.run("),
        "{found:?}"
    );
}

#[test]
fn a_router_behind_a_lock_in_state_is_caught() {
    // The old shape: state.rs keeping the router in a mutex beside the
    // owner's thread.
    let found = with_injected("state.rs", |state| {
        state.push_str("\nstruct Bypass { router: std::sync::Arc<std::sync::RwLock<Router>> }\n");
    });
    assert!(
        found.len() == 1 && found[0].starts_with("src/state.rs:") && found[0].contains("RwLock<Router>"),
        "{found:?}"
    );
}

#[test]
fn a_visible_router_accessor_is_caught() {
    let found = with_injected("state.rs", |state| {
        state.push_str("\nimpl Shared {\n    pub(crate) fn router(&self) -> &RouterOwner { &self.owner }\n}\n");
    });
    assert!(found.len() == 1 && found[0].starts_with("src/state.rs:"), "{found:?}");
}

#[test]
fn a_comment_naming_the_owner_is_no_violation() {
    let found = with_injected("admin.rs", |admin| {
        admin.push_str("\n// The router is owned by RouterOwner; see shared.owner.run( in state.rs.\n");
    });
    assert!(found.is_empty(), "{found:?}");
}
