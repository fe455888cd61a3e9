mod decisions;
mod engine_capacity;
mod index_model;
mod wire_numbers;
