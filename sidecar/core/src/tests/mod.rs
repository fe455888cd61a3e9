mod decisions;
mod engine_capacity;
mod engine_events;
mod index_model;
mod insight_ledger;
mod retention;
mod wire_numbers;
