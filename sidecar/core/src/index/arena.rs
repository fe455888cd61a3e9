//! `Arena`: fixed-size records in chunks of `2^CHUNK_BITS`, addressed by
//! `u32` ids, with freed slots reused first: the index's nodes and its
//! holder sets.
//!
//! The arena grows a chunk at a time, never by doubling, so at tens of
//! millions of records it holds no more than one partly used chunk (a
//! doubling vector holds up to twice what it needs). A chunk is filled by
//! pushes, so its pages are touched as records arrive (a chunk of nodes
//! written whole when it is added, 1.8 MB, stalls the Pick that adds it by a
//! few hundred µs). Freed slots are a list threaded through the records
//! themselves ([`Slot`]): a slot freed by an eviction is the next one
//! allocated, and the free list costs no byte (it was a `Vec<u32>` of 4
//! bytes per freed node, grown by doubling: one more copy of millions of ids
//! inside some Pick).

/// The id no slot has: the end of the free list.
const NIL: u32 = u32::MAX;

/// A record that can sit on the free list.
pub(super) trait Slot: Copy {
    /// The record a freed slot holds, linking to the next free slot; it
    /// must never be taken for a live record.
    fn freed(next_free: u32) -> Self;

    /// The next free slot, read from a freed record.
    fn next_free(&self) -> u32;
}

#[derive(Debug, Clone)]
pub(super) struct Arena<T, const CHUNK_BITS: usize> {
    chunks: Vec<Vec<T>>,
    len: usize,
    free_head: u32,
    free_len: usize,
}

impl<T: Slot, const CHUNK_BITS: usize> Arena<T, CHUNK_BITS> {
    /// Records in a chunk.
    pub(super) const CHUNK: usize = 1 << CHUNK_BITS;

    pub(super) fn new() -> Self {
        Self {
            chunks: Vec::new(),
            len: 0,
            free_head: NIL,
            free_len: 0,
        }
    }

    /// Records in use.
    pub(super) fn live(&self) -> usize {
        self.len - self.free_len
    }

    /// The record at `index`, if there is a slot there (two bounds checks,
    /// as indexing does: the chunks are filled by pushes, so a chunk holds
    /// no slot past `len`). A freed slot's record is returned as it is.
    pub(super) fn get(&self, index: usize) -> Option<&T> {
        self.chunks.get(index >> CHUNK_BITS)?.get(index & (Self::CHUNK - 1))
    }

    pub(super) fn get_mut(&mut self, index: usize) -> Option<&mut T> {
        (index < self.len).then(|| &mut self[index])
    }

    /// Stores `record`, in a freed slot if there is one.
    pub(super) fn alloc(&mut self, record: T) -> u32 {
        if self.free_head != NIL {
            let slot = self.free_head;
            self.free_head = self[slot as usize].next_free();
            self.free_len -= 1;
            self[slot as usize] = record;
            return slot;
        }
        if self.len.is_multiple_of(Self::CHUNK) {
            self.chunks.push(Vec::with_capacity(Self::CHUNK));
        }
        let slot = self.len;
        if let Some(chunk) = self.chunks.last_mut() {
            chunk.push(record);
            self.len += 1;
        }
        slot as u32
    }

    /// Returns `index` to the free list.
    pub(super) fn free(&mut self, index: u32) {
        let next = self.free_head;
        self[index as usize] = T::freed(next);
        self.free_head = index;
        self.free_len += 1;
    }

    pub(super) fn allocated_bytes(&self) -> usize {
        self.chunks.iter().map(|c| c.capacity() * size_of::<T>()).sum::<usize>()
            + self.chunks.capacity() * size_of::<Vec<T>>()
    }
}

impl<T, const CHUNK_BITS: usize> std::ops::Index<usize> for Arena<T, CHUNK_BITS> {
    type Output = T;

    fn index(&self, index: usize) -> &T {
        &self.chunks[index >> CHUNK_BITS][index & ((1 << CHUNK_BITS) - 1)]
    }
}

impl<T, const CHUNK_BITS: usize> std::ops::IndexMut<usize> for Arena<T, CHUNK_BITS> {
    fn index_mut(&mut self, index: usize) -> &mut T {
        &mut self.chunks[index >> CHUNK_BITS][index & ((1 << CHUNK_BITS) - 1)]
    }
}
