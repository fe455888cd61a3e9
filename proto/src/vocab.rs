//! The one place where kvmesh's shared vocabulary (`kvmesh-vocab`) meets its
//! wire form: every crate that sends or reads a Pick converts through these.

use kvmesh_vocab::{Harness, Lane, PromptSection, SectionKind};

use crate::v1;

impl From<SectionKind> for v1::SectionKind {
    fn from(kind: SectionKind) -> Self {
        match kind {
            SectionKind::Tools => Self::Tools,
            SectionKind::System => Self::System,
            SectionKind::Message => Self::Message,
            SectionKind::Other => Self::Other,
        }
    }
}

impl From<v1::SectionKind> for SectionKind {
    /// `UNSPECIFIED` (a sender that set nothing) reads as `Other`.
    fn from(kind: v1::SectionKind) -> Self {
        match kind {
            v1::SectionKind::Tools => Self::Tools,
            v1::SectionKind::System => Self::System,
            v1::SectionKind::Message => Self::Message,
            v1::SectionKind::Other | v1::SectionKind::Unspecified => Self::Other,
        }
    }
}

impl From<&PromptSection> for v1::PromptSection {
    fn from(section: &PromptSection) -> Self {
        Self {
            kind: v1::SectionKind::from(section.kind).into(),
            index: section.index,
            start_byte: section.start,
            digest: section.digest,
        }
    }
}

impl From<&v1::PromptSection> for PromptSection {
    /// A kind this reader does not know (a newer sender's) reads as `Other`
    /// rather than refusing the request.
    fn from(section: &v1::PromptSection) -> Self {
        Self {
            kind: section.section_kind(),
            index: section.index,
            start: section.start_byte,
            digest: section.digest,
        }
    }
}

impl v1::PromptSection {
    /// The section's kind; a value no version of the proto defines reads as
    /// `Other`.
    pub fn section_kind(&self) -> SectionKind {
        v1::SectionKind::try_from(self.kind).map_or(SectionKind::Other, SectionKind::from)
    }

    /// Sets the section's kind.
    pub fn set_section_kind(&mut self, kind: SectionKind) {
        self.kind = v1::SectionKind::from(kind).into();
    }
}

impl v1::PickRequest {
    /// The harness the filter detected (`harness` travels as its name; any
    /// other value is `Other`).
    pub fn harness(&self) -> Harness {
        Harness::from_name(&self.harness)
    }

    /// The lane of its session the request is (`lane` travels as its name;
    /// empty or any other value is `Main`).
    pub fn lane(&self) -> Lane {
        Lane::from_name(&self.lane)
    }
}
