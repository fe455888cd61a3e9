//! The snapshot codec: the router's [`Snapshot`] and the Redis stream id it
//! covers, as the bytes the store keeps under `kvmesh:v1:<cluster>:snapshot`.
//!
//! Pure (no I/O): the store reads and writes the bytes. The bytes come from
//! outside the process (any client of that Redis can write them), so
//! decoding refuses anything malformed instead of panicking or allocating
//! what a length field claims.

use kvmesh_core::Snapshot;

const MAGIC: &[u8; 6] = b"KVMS1\n";

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&u32::try_from(s.len()).unwrap_or(0).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// `MAGIC`, the stream id, then per worker its address and blocks (oldest
/// first), then the sessions; lengths are little-endian u32.
pub fn encode_snapshot(stream_id: &str, snapshot: &Snapshot) -> Vec<u8> {
    let mut out = Vec::from(&MAGIC[..]);
    put_str(&mut out, stream_id);
    out.extend_from_slice(&u32::try_from(snapshot.workers.len()).unwrap_or(0).to_le_bytes());
    for (address, blocks) in &snapshot.workers {
        put_str(&mut out, address);
        out.extend_from_slice(&u32::try_from(blocks.len()).unwrap_or(0).to_le_bytes());
        for b in blocks {
            out.extend_from_slice(&b.to_le_bytes());
        }
    }
    out.extend_from_slice(&u32::try_from(snapshot.sessions.len()).unwrap_or(0).to_le_bytes());
    for (session, home, seen) in &snapshot.sessions {
        put_str(&mut out, session);
        put_str(&mut out, home);
        out.extend_from_slice(&seen.to_le_bytes());
    }
    out
}

/// Reads a snapshot back; `None` for anything malformed (never a panic:
/// the bytes come from outside the process).
pub fn decode_snapshot(bytes: &[u8]) -> Option<(String, Snapshot)> {
    struct Reader<'a>(&'a [u8]);
    impl Reader<'_> {
        fn take(&mut self, n: usize) -> Option<&[u8]> {
            if self.0.len() < n {
                return None;
            }
            let (head, rest) = self.0.split_at(n);
            self.0 = rest;
            Some(head)
        }
        fn u32(&mut self) -> Option<usize> {
            Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?) as usize)
        }
        fn u64(&mut self) -> Option<u64> {
            Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
        }
        fn string(&mut self) -> Option<String> {
            let n = self.u32()?;
            String::from_utf8(self.take(n)?.to_vec()).ok()
        }
    }
    let mut r = Reader(bytes);
    if r.take(MAGIC.len())? != MAGIC {
        return None;
    }
    let id = r.string()?;
    let mut snapshot = Snapshot::default();
    for _ in 0..r.u32()? {
        let address = r.string()?;
        let n = r.u32()?;
        // A count larger than the bytes left is malformed, not an allocation.
        if n.checked_mul(8)? > r.0.len() {
            return None;
        }
        let blocks = (0..n).map(|_| r.u64()).collect::<Option<Vec<u64>>>()?;
        snapshot.workers.push((address, blocks));
    }
    for _ in 0..r.u32()? {
        let session = r.string()?;
        let home = r.string()?;
        snapshot.sessions.push((session, home, r.u64()?));
    }
    Some((id, snapshot))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshots_round_trip_and_garbage_is_refused() {
        let snapshot = Snapshot {
            workers: vec![
                ("10.0.0.1:8000".into(), vec![1, 2, u64::MAX]),
                ("10.0.0.2:8000".into(), vec![]),
            ],
            sessions: vec![("s".into(), "10.0.0.1:8000".into(), 77)],
        };
        let bytes = encode_snapshot("123-4", &snapshot);
        assert_eq!(decode_snapshot(&bytes), Some(("123-4".to_owned(), snapshot)));
        for cut in 0..bytes.len() {
            assert_eq!(decode_snapshot(&bytes[..cut]), None);
        }
        let mut huge = Vec::from(&MAGIC[..]);
        put_str(&mut huge, "0-0");
        huge.extend_from_slice(&1u32.to_le_bytes());
        put_str(&mut huge, "w");
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode_snapshot(&huge), None);
    }
}
