mod decisions;
mod index_model;
