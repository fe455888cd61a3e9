mod chunked;
mod priority;
mod retention;
mod scan;
mod understand;
mod usage;
