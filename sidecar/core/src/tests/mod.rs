mod decisions;
mod engine_capacity;
mod engine_events;
mod host_tier;
mod index_model;
mod insight_ledger;
mod retention;
mod wire_numbers;
