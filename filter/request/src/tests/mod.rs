mod chunked;
mod scan;
mod understand;
mod usage;
