mod decisions;
mod engine_capacity;
mod index_model;
mod insight_ledger;
mod wire_numbers;
