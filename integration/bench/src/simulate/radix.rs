//! A character (byte) radix tree shared by all workers, as the SGLang model
//! gateway keeps one (`sgl-router` `tree.rs`): each node records which
//! workers hold its text and when they last used it; a worker's share of
//! the tree is bounded, and its least recently used leaves go first.

use std::collections::HashMap;

#[derive(Debug, Default)]
struct Node {
    /// The edge's text, from the parent to this node.
    text: Vec<u8>,
    children: HashMap<u8, usize>,
    parent: usize,
    /// Worker → last access (a logical clock).
    workers: HashMap<usize, u64>,
}

/// The tree; node 0 is the root.
#[derive(Debug)]
pub(crate) struct RadixTree {
    nodes: Vec<Node>,
    free: Vec<usize>,
    /// Characters each worker holds.
    size: Vec<usize>,
    max_size: usize,
    clock: u64,
}

impl RadixTree {
    pub(crate) fn new(workers: usize, max_size: usize) -> Self {
        Self {
            nodes: vec![Node::default()],
            free: Vec::new(),
            size: vec![0; workers],
            max_size,
            clock: 0,
        }
    }

    #[cfg(test)]
    pub(crate) fn size(&self, worker: usize) -> usize {
        self.size[worker]
    }

    /// Characters of `text` each worker holds as a prefix.
    pub(crate) fn matched(&self, text: &[u8]) -> Vec<usize> {
        let mut out = vec![0; self.size.len()];
        let mut node = 0;
        let mut at = 0;
        let mut alive: Vec<usize> = (0..self.size.len()).collect();
        while at < text.len() {
            let Some(&child) = self.nodes[node].children.get(&text[at]) else {
                break;
            };
            let edge = &self.nodes[child].text;
            let common = edge.iter().zip(&text[at..]).take_while(|(a, b)| a == b).count();
            alive.retain(|w| self.nodes[child].workers.contains_key(w));
            if alive.is_empty() {
                break;
            }
            for &w in &alive {
                out[w] = at + common;
            }
            if common < edge.len() {
                break;
            }
            at += common;
            node = child;
        }
        out
    }

    fn alloc(&mut self, node: Node) -> usize {
        if let Some(i) = self.free.pop() {
            self.nodes[i] = node;
            i
        } else {
            self.nodes.push(node);
            self.nodes.len() - 1
        }
    }

    /// Records that `worker` holds `text`, then evicts its least recently
    /// used leaves while it holds more than the bound.
    pub(crate) fn insert(&mut self, text: &[u8], worker: usize) {
        self.clock += 1;
        let now = self.clock;
        let mut node = 0;
        let mut at = 0;
        while at < text.len() {
            let first = text[at];
            let child = match self.nodes[node].children.get(&first) {
                Some(&c) => c,
                None => {
                    let leaf = self.alloc(Node {
                        text: text[at..].to_vec(),
                        children: HashMap::new(),
                        parent: node,
                        workers: HashMap::new(),
                    });
                    self.nodes[node].children.insert(first, leaf);
                    leaf
                }
            };
            let common = self.nodes[child]
                .text
                .iter()
                .zip(&text[at..])
                .take_while(|(a, b)| a == b)
                .count();
            let child = if common < self.nodes[child].text.len() {
                // Split the edge: a new node takes the common part.
                let rest = self.nodes[child].text.split_off(common);
                let head = std::mem::replace(&mut self.nodes[child].text, rest);
                let workers = self.nodes[child].workers.clone();
                let mid = self.alloc(Node {
                    text: head,
                    children: HashMap::from([(self.nodes[child].text[0], child)]),
                    parent: node,
                    workers,
                });
                self.nodes[child].parent = mid;
                self.nodes[node].children.insert(first, mid);
                mid
            } else {
                child
            };
            let len = self.nodes[child].text.len();
            if self.nodes[child].workers.insert(worker, now).is_none() {
                self.size[worker] += len;
            }
            at += len;
            node = child;
        }
        self.evict(worker);
    }

    fn evict(&mut self, worker: usize) {
        while self.size[worker] > self.max_size {
            // The worker's least recently used leaf (no child it holds).
            let victim = (1..self.nodes.len())
                .filter(|&i| {
                    self.nodes[i].workers.contains_key(&worker)
                        && !self.nodes[i]
                            .children
                            .values()
                            .any(|c| self.nodes[*c].workers.contains_key(&worker))
                })
                .min_by_key(|&i| self.nodes[i].workers[&worker]);
            let Some(victim) = victim else { break };
            self.nodes[victim].workers.remove(&worker);
            self.size[worker] -= self.nodes[victim].text.len();
            if self.nodes[victim].workers.is_empty() && self.nodes[victim].children.is_empty() {
                let parent = self.nodes[victim].parent;
                let first = self.nodes[victim].text[0];
                self.nodes[parent].children.remove(&first);
                self.nodes[victim] = Node::default();
                self.free.push(victim);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_are_matched_per_worker_through_splits() {
        let mut t = RadixTree::new(2, 1000);
        t.insert(b"hello world", 0);
        t.insert(b"hello there", 1);
        assert_eq!(t.matched(b"hello world!"), [11, 6]);
        assert_eq!(t.matched(b"help"), [3, 3]);
        assert_eq!(t.matched(b"x"), [0, 0]);
        assert_eq!((t.size(0), t.size(1)), (11, 11));
    }

    #[test]
    fn a_worker_over_its_bound_loses_its_least_recently_used_leaves() {
        let mut t = RadixTree::new(1, 20);
        t.insert(b"aaaaaaaaaa", 0);
        t.insert(b"bbbbbbbbbb", 0);
        t.insert(b"cccccccccc", 0);
        assert!(t.size(0) <= 20);
        assert_eq!(t.matched(b"aaaaaaaaaa"), [0]);
        assert_eq!(t.matched(b"cccccccccc"), [10]);
    }
}
