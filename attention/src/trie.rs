//! A radix trie over token ids: the longest prefix a prompt shares with any stored context.
//!
//! The catalog persists every context's token ids (a child context's through its parent
//! link); the trie is derived from them when the DB opens and updated as contexts are stored
//! and deleted, so it never disagrees with what is committed.

use std::collections::HashMap;

/// A stored context a prompt can reuse: `tokens` of its first tokens match the prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixMatch {
    pub context: u32,
    pub tokens: usize,
    /// The context holds exactly the matched tokens (no filtering needed).
    pub whole: bool,
}

#[derive(Debug, Default)]
struct Node {
    /// The edge into this node.
    label: Vec<u32>,
    children: HashMap<u32, usize>,
    /// Contexts whose sequence passes through (or ends in) this node. Empty once all are
    /// removed; the node stays as a (harmless) dead branch until the trie is rebuilt.
    through: Vec<u32>,
    /// Contexts whose sequence ends exactly here.
    ends: Vec<u32>,
}

#[derive(Debug)]
pub struct PrefixTrie {
    nodes: Vec<Node>,
    lengths: HashMap<u32, usize>,
}

impl Default for PrefixTrie {
    fn default() -> Self {
        PrefixTrie { nodes: vec![Node::default()], lengths: HashMap::new() }
    }
}

impl PrefixTrie {
    pub fn insert(&mut self, context: u32, tokens: &[u32]) {
        self.lengths.insert(context, tokens.len());
        let mut at = 0;
        let mut rest = tokens;
        self.nodes[0].through.push(context);
        while let Some(&first) = rest.first() {
            let Some(&child) = self.nodes[at].children.get(&first) else {
                let leaf = self.push(rest.to_vec(), context);
                self.nodes[at].children.insert(first, leaf);
                at = leaf;
                break;
            };
            let common = common_len(&self.nodes[child].label, rest);
            if common < self.nodes[child].label.len() {
                self.split(child, common);
            }
            self.nodes[child].through.push(context);
            rest = &rest[common..];
            at = child;
        }
        self.nodes[at].ends.push(context);
    }

    pub fn remove(&mut self, context: u32) {
        if self.lengths.remove(&context).is_some() {
            for n in &mut self.nodes {
                n.through.retain(|&c| c != context);
                n.ends.retain(|&c| c != context);
            }
        }
    }

    /// The longest stored prefix of `tokens`; among contexts sharing it, one that ends there
    /// (reusable whole) is preferred.
    pub fn longest_prefix(&self, tokens: &[u32]) -> Option<PrefixMatch> {
        let mut at = 0;
        let mut depth = 0;
        let mut rest = tokens;
        while let Some(&child) = rest.first().and_then(|t| self.nodes[at].children.get(t)) {
            let node = &self.nodes[child];
            if node.through.is_empty() {
                break;
            }
            let common = common_len(&node.label, rest);
            depth += common;
            rest = &rest[common..];
            at = child;
            if common < node.label.len() {
                let c = node.through[0];
                return (depth > 0).then_some(PrefixMatch { context: c, tokens: depth, whole: false });
            }
        }
        if depth == 0 {
            return None;
        }
        let node = &self.nodes[at];
        match node.ends.first() {
            Some(&c) => Some(PrefixMatch { context: c, tokens: depth, whole: true }),
            None => Some(PrefixMatch { context: node.through[0], tokens: depth, whole: false }),
        }
    }

    fn push(&mut self, label: Vec<u32>, context: u32) -> usize {
        self.nodes.push(Node { label, children: HashMap::new(), through: vec![context], ends: Vec::new() });
        self.nodes.len() - 1
    }

    /// Splits `node`'s edge after `at` tokens: `node` keeps the head, a new child the tail.
    fn split(&mut self, node: usize, at: usize) {
        let tail = self.nodes[node].label.split_off(at);
        let moved = Node {
            label: tail,
            children: std::mem::take(&mut self.nodes[node].children),
            through: self.nodes[node].through.clone(),
            ends: std::mem::take(&mut self.nodes[node].ends),
        };
        let first = moved.label[0];
        self.nodes.push(moved);
        let id = self.nodes.len() - 1;
        self.nodes[node].children.insert(first, id);
    }
}

fn common_len(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_longest_shared_prefix_whole_or_partial() {
        let mut t = PrefixTrie::default();
        t.insert(1, &[1, 2, 3, 4, 5]);
        t.insert(2, &[1, 2, 3, 9]);
        t.insert(3, &[7, 8]);
        assert_eq!(t.longest_prefix(&[1, 2, 3, 4, 5, 6]), Some(PrefixMatch { context: 1, tokens: 5, whole: true }));
        assert_eq!(t.longest_prefix(&[1, 2, 3, 4, 0]), Some(PrefixMatch { context: 1, tokens: 4, whole: false }));
        let m = t.longest_prefix(&[1, 2, 3, 7]).unwrap();
        assert_eq!((m.tokens, m.whole), (3, false));
        assert!(m.context == 1 || m.context == 2);
        assert_eq!(t.longest_prefix(&[1, 2, 3, 9]), Some(PrefixMatch { context: 2, tokens: 4, whole: true }));
        assert_eq!(t.longest_prefix(&[7]), Some(PrefixMatch { context: 3, tokens: 1, whole: false }));
        assert_eq!(t.longest_prefix(&[5, 5]), None);
        assert_eq!(t.longest_prefix(&[]), None);
        t.remove(1);
        assert_eq!(t.longest_prefix(&[1, 2, 3, 4, 5]), Some(PrefixMatch { context: 2, tokens: 3, whole: false }));
        t.remove(2);
        assert_eq!(t.longest_prefix(&[1, 2, 3, 4, 5]), None);
    }

    #[test]
    fn agrees_with_brute_force_on_random_sequences() {
        let mut rng = ctxfs_vfs::SplitMix64::new(7);
        let seqs: Vec<Vec<u32>> = (0..40)
            .map(|_| {
                let n = 1 + rng.below(30) as usize;
                (0..n).map(|_| rng.below(3) as u32).collect()
            })
            .collect();
        let mut t = PrefixTrie::default();
        for (i, s) in seqs.iter().enumerate() {
            t.insert(i as u32, s);
        }
        for _ in 0..500 {
            let n = rng.below(35) as usize;
            let probe: Vec<u32> = (0..n).map(|_| rng.below(3) as u32).collect();
            let best = seqs.iter().map(|s| common_len(s, &probe)).max().unwrap_or(0);
            match t.longest_prefix(&probe) {
                None => assert_eq!(best, 0),
                Some(m) => {
                    assert_eq!(m.tokens, best);
                    let s = &seqs[m.context as usize];
                    assert!(common_len(s, &probe) >= m.tokens, "the match is really shared");
                    assert_eq!(m.whole, s.len() == m.tokens);
                    if !m.whole {
                        assert!(seqs.iter().all(|s| s.len() != best || common_len(s, &probe) < best));
                    }
                }
            }
        }
    }
}
