mod decisions;
mod index_model;
mod insight_ledger;
mod wire_numbers;
