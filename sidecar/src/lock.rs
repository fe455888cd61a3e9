//! Locking that survives a panic elsewhere. Below `state` and `metrics`,
//! which both lock the insight ledger, so neither imports the other for it.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// The core never panics while holding a lock, but if it ever did, the
/// state is still the best picture there is: keep routing with it rather
/// than turn every later Pick into a panic.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
