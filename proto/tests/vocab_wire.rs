//! Every section kind and every harness survives the wire: through the
//! conversions of `kvmesh_proto`, and through an encoded and decoded Pick.
#![allow(clippy::unwrap_used)]

use kvmesh_proto::v1;
use kvmesh_vocab::{Harness, SectionKind};
use proptest::prelude::*;
use prost::Message;

#[test]
fn every_kind_converts_to_the_wire_and_back() {
    for kind in SectionKind::ALL {
        assert_eq!(SectionKind::from(v1::SectionKind::from(kind)), kind);
    }
    // A sender that set nothing, or a kind this version does not know.
    let mut section = v1::PromptSection::default();
    assert_eq!(section.section_kind(), SectionKind::Other);
    section.kind = 99;
    assert_eq!(section.section_kind(), SectionKind::Other);
}

proptest! {
    #[test]
    fn sections_and_harness_round_trip_through_an_encoded_pick(
        kinds in proptest::collection::vec(0..SectionKind::ALL.len(), 0..64),
        harness in 0..Harness::ALL.len(),
    ) {
        let kinds: Vec<SectionKind> = kinds.into_iter().map(|i| SectionKind::ALL[i]).collect();
        let harness = Harness::ALL[harness];
        let pick = v1::PickRequest {
            harness: harness.name().to_owned(),
            sections: kinds
                .iter()
                .enumerate()
                .map(|(i, kind)| {
                    let mut section = v1::PromptSection { index: i as u32, ..Default::default() };
                    section.set_section_kind(*kind);
                    section
                })
                .collect(),
            ..Default::default()
        };
        let decoded = v1::PickRequest::decode(pick.encode_to_vec().as_slice()).unwrap();
        prop_assert_eq!(decoded.harness(), harness);
        let back: Vec<SectionKind> = decoded.sections.iter().map(v1::PromptSection::section_kind).collect();
        prop_assert_eq!(back, kinds);
    }
}
