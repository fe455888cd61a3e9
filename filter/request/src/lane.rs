//! Which lane of its session a request is: the conversation itself, a side
//! call beside it (a title, a summary, a small model's call), or a call that
//! compacts it. Read from what each harness sends (docs/harnesses/).

use kvmesh_vocab::Lane;

use crate::canonical::Envelope;
use crate::identity::{Headers, Identity};

/// The lane of one request.
pub(crate) fn classify(_headers: &impl Headers, _envelope: &Envelope<'_>, _identity: &Identity) -> Lane {
    Lane::Main
}
