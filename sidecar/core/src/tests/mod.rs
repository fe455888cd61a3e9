mod decisions;
mod index_model;
mod wire_numbers;
