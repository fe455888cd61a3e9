mod chunked;
mod identity;
mod lane;
mod priority;
mod retention;
mod scan;
mod understand;
mod usage;
