//! A session's routing state has one home: its record in the core's
//! `SessionStore` (`core/src/sessions.rs`), issue 26. Read from the source:
//! a field anywhere else in the core whose collection is keyed by, or
//! holds, a session (a `SessionId`, or a name as `String`, `Box<str>` or
//! `Arc<str>`) fails, unless it is listed below with why it is not a
//! second session table. A listed field that is gone fails too, so the list
//! cannot outlive what it excuses.

mod source_tree;

use std::path::{Path, PathBuf};

/// The store: its records, and the indexes that point into them.
const OWNER: &str = "sessions.rs";

/// The tables a field could keep sessions in: maps and sets (a `Vec` of
/// names is a page or a report, built and handed out, not kept).
const COLLECTIONS: &[&str] = &["HashMap<", "HashSet<", "BTreeMap<", "BTreeSet<", "LruMap<", "Lru<"];

/// What names a session in a collection's parameters.
const SESSION_TYPES: &[&str] = &["SessionId", "String", "Box<str>", "Arc<str>"];

/// (file, field, why it is no second session table).
const NOT_SESSION_TABLES: &[(&str, &str, &str)] = &[
    ("router/mod.rs", "by_address", "worker addresses"),
    ("models.rs", "rates", "model names"),
    ("insight/mod.rs", "tenant_ids", "tenant labels"),
    (
        "lineage.rs",
        "sessions",
        "`TraceCarriers`, the store's own index of trace ids (a field of `SessionStore`)",
    ),
    (
        "retention.rs",
        "residents",
        "each worker's cache by the session whose calls filled it: the engine's state, which \
         outlives the session's record (the engine evicts it, not the TTL)",
    ),
    (
        "insight/mod.rs",
        "traces",
        "the ledger, downstream of routing: each session's last call per model (its blocks and \
         sections), fed the engines' truth in the benchmark, run outside the router's lock",
    ),
    (
        "insight/lanes.rs",
        "tallies",
        "the ledger's per-session lane counts (see `traces`)",
    ),
];

fn core_sources() -> Vec<(PathBuf, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("core/src");
    source_tree::rust_sources(&root)
        .into_iter()
        // The core's own tests keep what they like.
        .filter(|(path, _)| !path.starts_with("tests"))
        .collect()
}

/// A struct field's (name, type) on this line, if it declares one: `name:
/// Type,` alone on its line, perhaps `pub`. (A parameter on a line of its
/// own reads the same, and is held to the same rule.)
fn field(line: &str) -> Option<(&str, &str)> {
    let line = source_tree::code_of(line).trim();
    let line = ["pub(crate) ", "pub(super) ", "pub "]
        .iter()
        .find_map(|vis| line.strip_prefix(vis))
        .unwrap_or(line);
    let (name, ty) = line.split_once(':')?;
    let ty = ty.trim().strip_suffix(',')?;
    let is_name = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    (is_name && !ty.starts_with(':')).then_some((name, ty))
}

/// Whether a field of this type keeps sessions in a collection.
fn holds_sessions(ty: &str) -> bool {
    COLLECTIONS.iter().any(|collection| {
        ty.match_indices(collection).any(|(at, _)| {
            let params = &ty[at + collection.len()..];
            SESSION_TYPES.iter().any(|session| params.contains(session))
        })
    })
}

/// Every field that breaks the rule as `file:line: text`, and every listed
/// exception that names no field.
fn violations(sources: &[(PathBuf, String)]) -> Vec<String> {
    let mut found = Vec::new();
    let mut excused = vec![false; NOT_SESSION_TABLES.len()];
    for (path, text) in sources {
        if path == Path::new(OWNER) {
            continue;
        }
        for (n, line) in text.lines().enumerate() {
            let Some((name, ty)) = field(line) else { continue };
            if !holds_sessions(ty) {
                continue;
            }
            let listed = NOT_SESSION_TABLES
                .iter()
                .position(|(file, field, _)| path == Path::new(file) && *field == name);
            match listed {
                Some(i) => excused[i] = true,
                None => found.push(format!(
                    "core/src/{}:{}: {} (a session's state belongs in its record, core/src/{OWNER})",
                    path.display(),
                    n + 1,
                    line.trim()
                )),
            }
        }
    }
    for ((file, field, _), seen) in NOT_SESSION_TABLES.iter().zip(excused) {
        if !seen {
            found.push(format!(
                "core/src/{file}: no field `{field}` (drop it from NOT_SESSION_TABLES)"
            ));
        }
    }
    found
}

#[test]
fn a_sessions_state_is_kept_in_its_record_alone() {
    let sources = core_sources();
    for known in [OWNER, "router/mod.rs", "router/fleet.rs", "retention.rs", "lineage.rs"] {
        assert!(
            sources
                .iter()
                .any(|(path, text)| path == Path::new(known) && !text.is_empty()),
            "core/src/{known} was not read"
        );
    }
    let found = violations(&sources);
    assert!(
        found.is_empty(),
        "session state outside its record:\n  {}",
        found.join("\n  ")
    );
}

/// The tables the store replaced, put back one at a time, are each caught
/// where they stand.
#[test]
fn a_second_session_table_is_caught() {
    for (file, anchor, table) in [
        (
            "router/mod.rs",
            "    next_pick_id: u64,\n",
            "    last_pick: HashMap<String, u64>,\n",
        ),
        (
            "retention.rs",
            "    session_ttl_ms: u64,\n",
            "    live: LruMap<SessionId, Follow>,\n",
        ),
        (
            "retention.rs",
            "    session_ttl_ms: u64,\n",
            "    pub(crate) deadlines: BTreeSet<(u64, String)>,\n",
        ),
        (
            "router/fleet.rs",
            "    pub(super) at_ms: u64,\n",
            "    pub(super) sessions: HashSet<Box<str>>,\n",
        ),
    ] {
        let mut sources = core_sources();
        let Some((_, text)) = sources.iter_mut().find(|(path, _)| path == Path::new(file)) else {
            panic!("core/src/{file} was not read");
        };
        assert!(text.contains(anchor), "core/src/{file} has no `{}`", anchor.trim());
        *text = text.replacen(anchor, &format!("{anchor}{table}"), 1);
        let found = violations(&sources);
        assert!(
            found.len() == 1 && found[0].starts_with(&format!("core/src/{file}:")) && found[0].contains(table.trim()),
            "{table:?} in {file}: {found:?}"
        );
    }
}

/// An exception whose field is gone is caught.
#[test]
fn a_stale_exception_is_caught() {
    let mut sources = core_sources();
    let Some((_, models)) = sources.iter_mut().find(|(path, _)| path == Path::new("models.rs")) else {
        panic!("core/src/models.rs was not read");
    };
    let table = "rates: HashMap<String, (f64, u64)>,";
    assert!(models.contains(table), "core/src/models.rs has no `{table}`");
    *models = models.replace(table, "rates: Vec<(f64, u64)>,");
    let found = violations(&sources);
    assert!(found.len() == 1 && found[0].contains("no field `rates`"), "{found:?}");
}
