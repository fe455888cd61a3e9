mod scan;
mod understand;
mod usage;
