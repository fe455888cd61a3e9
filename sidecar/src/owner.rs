//! The router's owner: one OS thread, `kvmesh-router`, holds the
//! [`Router`] and applies the commands sent to it over a channel, one at a
//! time and in the order they arrive. Nothing else ever touches the router,
//! so no lock guards it: a Pick, a scrape's update and a page's read each
//! wait their turn in the channel instead of on a mutex that is not fair.
//!
//! The thread also publishes a [`RouterView`], a copy of what readiness,
//! the engine watcher's scrape list and metrics read, so
//! those reads send no command and never wait behind a Pick.
//!
//! Below `state` (its only user): std and the routing core, no tokio, no
//! logging. What a lost reply means is for the caller to decide.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant};

use kvmesh_core::{Router, WorkerView};

/// One change to, or read of, the router, run on its thread.
pub(crate) type Command = Box<dyn FnOnce(&mut Router) + Send>;

/// The view is published at most this long after a command changed the
/// router (and at once after a command that asks for it).
pub(crate) const PUBLISH_EVERY: Duration = Duration::from_millis(100);

/// What the owner's thread last published: the figures read without a
/// command, at most about [`PUBLISH_EVERY`] old.
#[derive(Debug, Clone, Default)]
pub(crate) struct RouterView {
    /// As `Router::workers` (prefill queues as of the last Pick).
    pub(crate) workers: Vec<WorkerView>,
    /// Sessions the router follows.
    pub(crate) sessions: usize,
    /// The prefix index's entries and memory.
    pub(crate) index_entries: usize,
    pub(crate) index_bytes: usize,
    /// Models whose bytes per token the router has learned.
    pub(crate) models: usize,
    /// Trace ids remembered to resolve parents named by trace.
    pub(crate) trace_carriers: usize,
}

impl RouterView {
    fn of(router: &Router) -> Self {
        let index = router.index();
        Self {
            workers: router.workers(),
            sessions: router.sessions().len(),
            index_entries: index.entries(),
            index_bytes: index.memory_bytes(),
            models: router.models(),
            trace_carriers: router.sessions().traces(),
        }
    }
}

/// The owner's thread is gone or dropped the reply: the command panicked
/// (the panic hook has printed why), or the thread ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OwnerGone;

/// A command as it travels: publish the view right after it when
/// `publish` (a command that changes the worker set, so the watcher never
/// scrapes a stale list).
struct Queued {
    command: Command,
    publish: bool,
}

/// The handle every edge's `Shared` holds: cloning it clones the sender.
/// The thread ends once every handle is dropped.
#[derive(Clone)]
pub(crate) struct RouterOwner {
    commands: Sender<Queued>,
    /// Swapped by the owner's thread under the write lock, which is held
    /// only for the pointer swap; readers clone the `Arc` under the read
    /// lock and read it with no lock held.
    view: Arc<RwLock<Arc<RouterView>>>,
}

impl std::fmt::Debug for RouterOwner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The view's worker list would flood a `{:?}` of `Shared`.
        f.debug_struct("RouterOwner").finish_non_exhaustive()
    }
}

impl RouterOwner {
    /// Moves `router` onto its own thread, with its view published once.
    /// Fails only when the OS refuses the thread.
    pub(crate) fn start(router: Router) -> std::io::Result<Self> {
        let view = Arc::new(RwLock::new(Arc::new(RouterView::of(&router))));
        let (commands, received) = mpsc::channel();
        let published = view.clone();
        std::thread::Builder::new()
            .name("kvmesh-router".into())
            .spawn(move || serve(router, &received, &published))?;
        Ok(Self { commands, view })
    }

    /// Runs `f` on the router, after every command sent before it, and
    /// returns its result.
    pub(crate) fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Router) -> T + Send + 'static,
    ) -> Result<T, OwnerGone> {
        self.send(f, false)
    }

    /// As [`RouterOwner::run`], then publishes the view before the next
    /// command: for a command that changes the worker set or its health.
    pub(crate) fn run_and_publish<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Router) -> T + Send + 'static,
    ) -> Result<T, OwnerGone> {
        self.send(f, true)
    }

    /// Publishes the view now (it shows every command sent before). The
    /// sidecar's commands that need it publish themselves
    /// ([`RouterOwner::run_and_publish`]); a test cannot wait on a timer.
    #[cfg(test)]
    pub(crate) fn publish_now(&self) -> Result<(), OwnerGone> {
        self.run_and_publish(|_| ())
    }

    /// The last published view: at most about [`PUBLISH_EVERY`] old, and
    /// current as to the worker set.
    pub(crate) fn view(&self) -> Arc<RouterView> {
        self.view.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    fn send<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Router) -> T + Send + 'static,
        publish: bool,
    ) -> Result<T, OwnerGone> {
        let (reply, answer) = mpsc::sync_channel(1);
        let view = publish.then(|| self.view.clone());
        let command: Command = Box::new(move |router: &mut Router| {
            let value = f(router);
            // Before the reply: once `run_and_publish` returns, the view
            // shows what its command did.
            if let Some(view) = view {
                publish_view(router, &view);
            }
            // The caller may have stopped waiting: nothing to do then.
            let _ = reply.send(value);
        });
        self.commands.send(Queued { command, publish }).map_err(|_| OwnerGone)?;
        // A command that panicked dropped `reply` unsent: `recv` fails.
        answer.recv().map_err(|_| OwnerGone)
    }
}

/// The owner's loop: applies each command in arrival order, publishes the
/// view when asked, when a command arrives [`PUBLISH_EVERY`] after the last
/// publication, or once that long has passed since a command with none
/// arriving (so an idle router's view is never older than that). Ends when
/// every sender is dropped.
fn serve(mut router: Router, commands: &Receiver<Queued>, view: &RwLock<Arc<RouterView>>) {
    let mut published = Instant::now();
    // A command ran since the last publication (any may have changed it).
    let mut unpublished = false;
    loop {
        let queued = if unpublished {
            match commands.recv_timeout(PUBLISH_EVERY.saturating_sub(published.elapsed())) {
                Ok(queued) => queued,
                Err(RecvTimeoutError::Timeout) => {
                    publish_view(&router, view);
                    published = Instant::now();
                    unpublished = false;
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => return,
            }
        } else {
            match commands.recv() {
                Ok(queued) => queued,
                Err(_) => return,
            }
        };
        // A panicking command loses its own reply, not the thread: the
        // router is still the best picture there is (as `lock` keeps a
        // poisoned mutex's state), and every later Pick needs it.
        let ran = catch_unwind(AssertUnwindSafe(|| (queued.command)(&mut router))).is_ok();
        if queued.publish && ran {
            // The command published the view itself, before its reply.
            published = Instant::now();
            unpublished = false;
        } else if published.elapsed() >= PUBLISH_EVERY {
            publish_view(&router, view);
            published = Instant::now();
            unpublished = false;
        } else {
            unpublished = true;
        }
    }
}

/// Copies the view out of the router, then swaps it in: the write lock is
/// held for the swap alone. A copy that panicked leaves the last view.
fn publish_view(router: &Router, view: &RwLock<Arc<RouterView>>) {
    if let Ok(fresh) = catch_unwind(AssertUnwindSafe(|| Arc::new(RouterView::of(router)))) {
        *view.write().unwrap_or_else(PoisonError::into_inner) = fresh;
    }
}

#[cfg(test)]
mod tests {
    use kvmesh_core::RouterConfig;

    use super::*;

    fn owner() -> RouterOwner {
        RouterOwner::start(Router::new(RouterConfig::default(), Vec::new())).unwrap()
    }

    #[test]
    fn each_senders_commands_apply_in_its_order() {
        let owner = owner();
        let senders: Vec<_> = ["a", "b"]
            .into_iter()
            .map(|name| {
                let owner = owner.clone();
                std::thread::spawn(move || {
                    for i in 0..200 {
                        let address = format!("{name}-{i:03}");
                        owner.run(move |router| router.add_worker(&address)).unwrap();
                    }
                })
            })
            .collect();
        for sender in senders {
            sender.join().unwrap();
        }
        let addresses: Vec<String> = owner
            .run(|router| router.workers().into_iter().map(|w| w.address).collect())
            .unwrap();
        assert_eq!(addresses.len(), 400);
        for name in ["a", "b"] {
            let mine: Vec<&String> = addresses.iter().filter(|a| a.starts_with(name)).collect();
            assert_eq!(mine.len(), 200);
            // Worker ids follow the order of `add_worker`: zero-padded
            // addresses sort in the order each thread sent them.
            assert!(mine.is_sorted(), "{name}: {mine:?}");
        }
    }

    #[test]
    fn a_panicking_command_loses_its_reply_not_the_owner() {
        let owner = owner();
        owner.run(|router| router.add_worker("w-0")).unwrap();
        let lost = owner.run(|_| -> usize { panic!("a bug in a command") });
        assert_eq!(lost, Err(OwnerGone));
        assert_eq!(owner.run(|router| router.workers().len()), Ok(1));
    }

    #[test]
    fn the_view_shows_a_worker_once_published() {
        let owner = owner();
        assert!(owner.view().workers.is_empty(), "published at start, empty");
        owner.run(|router| router.add_worker("w-0")).unwrap();
        owner.publish_now().unwrap();
        let view = owner.view();
        assert_eq!(view.workers.len(), 1);
        assert_eq!(view.workers[0].address, "w-0");
        // A command that asks for it publishes with no `publish_now`.
        owner.run_and_publish(|router| router.add_worker("w-1")).unwrap();
        assert_eq!(owner.view().workers.len(), 2);
    }

    #[test]
    fn the_thread_ends_with_the_last_handle() {
        let owner = owner();
        let view = owner.view.clone();
        drop(owner);
        // The thread held the only other reference to the view's lock.
        let deadline = Instant::now() + Duration::from_secs(10);
        while Arc::strong_count(&view) > 1 {
            assert!(Instant::now() < deadline, "the owner's thread outlived its handles");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
