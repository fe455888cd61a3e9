mod decisions;
mod engine_capacity;
mod engine_events;
mod host_tier;
mod index_memory;
mod index_model;
mod insight_ledger;
mod lanes;
mod lineage;
mod retention;
mod session_memory;
mod tick_steps;
mod wire_numbers;

/// One table's size: live entries, the bytes of its hash table, and those
/// of its touch queue (0 for a table without one); not the keys' own heap,
/// which goes with the entries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Footprint {
    pub(crate) len: usize,
    pub(crate) table_bytes: usize,
    pub(crate) queue_bytes: usize,
}

/// Each named table's [`Footprint`].
pub(crate) type Footprints = Vec<(&'static str, Footprint)>;
