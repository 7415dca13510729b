//! Byte-level BPE (GPT-2 style), as llama.cpp's `llm_tokenizer_bpe`: pre-tokenise, map each
//! word's bytes to the GPT-2 alphabet, then merge adjacent pairs by merge rank.

use crate::byte_level;
use crate::pretokenize::PreTokenizer;
use crate::vocab::{TokenType, Vocab};
use kiln_core::{Error, Result};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

pub struct ByteBpe {
    pub vocab: Vocab,
    /// (left id, right id) → (rank, merged id).
    merges: HashMap<(u32, u32), (u32, u32)>,
    pre: PreTokenizer,
}

impl ByteBpe {
    /// `merges` are "left right" strings, rank = position (the first of duplicates wins,
    /// as in llama.cpp).
    pub fn new(vocab: Vocab, merges: &[String], pre: PreTokenizer) -> Result<ByteBpe> {
        let mut map = HashMap::with_capacity(merges.len());
        for (rank, m) in merges.iter().enumerate() {
            // llama.cpp splits at the first space after the first character, so a left
            // part may itself start with a space.
            let split = m
                .char_indices()
                .skip(1)
                .find(|&(_, c)| c == ' ')
                .map(|(i, _)| i)
                .ok_or_else(|| {
                    Error::format(format!(
                        "merge {rank} {m:?} is not two tokens separated by a space"
                    ))
                })?;
            let (l, r) = (&m[..split], &m[split + 1..]);
            let id = |part: &str| {
                vocab.id(part).ok_or_else(|| {
                    Error::format(format!(
                        "merge {rank} {m:?} references {part:?}, which is not in the vocabulary"
                    ))
                })
            };
            let (lid, rid, merged) = (id(l)?, id(r)?, id(&format!("{l}{r}"))?);
            map.entry((lid, rid)).or_insert((rank as u32, merged));
        }
        Ok(ByteBpe {
            vocab,
            merges: map,
            pre,
        })
    }

    pub fn encode(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        for word in self.pre.split(text)? {
            let mapped = byte_level::encode(word.as_bytes());
            if self.pre.ignore_merges {
                if let Some(id) = self.vocab.id(&mapped) {
                    out.push(id);
                    continue;
                }
            }
            self.encode_word(&mapped, out);
        }
        Ok(())
    }

    fn encode_word(&self, word: &str, out: &mut Vec<u32>) {
        let mut buf = [0u8; 4];
        // Characters outside the vocabulary stay `None`, never merge and are dropped, as
        // llama.cpp drops symbols it cannot look up (the byte alphabet is normally all
        // present).
        let mut ids: Vec<Option<u32>> = word
            .chars()
            .map(|c| self.vocab.id(c.encode_utf8(&mut buf)))
            .collect();
        let n = ids.len();
        let mut next: Vec<Option<usize>> = (1..=n).map(|i| (i < n).then_some(i)).collect();
        let mut prev: Vec<Option<usize>> = (0..n).map(|i| i.checked_sub(1)).collect();
        // A heap keeps long words (a run of digits, of spaces) O(n log n).
        let mut queue = BinaryHeap::new();
        let push = |queue: &mut BinaryHeap<Reverse<(u32, usize, u32, u32)>>,
                    ids: &[Option<u32>],
                    left: usize,
                    right: usize| {
            if let (Some(l), Some(r)) = (ids[left], ids[right]) {
                if let Some(&(rank, _)) = self.merges.get(&(l, r)) {
                    // Lowest rank first, then leftmost.
                    queue.push(Reverse((rank, left, l, r)));
                }
            }
        };
        for i in 1..n {
            push(&mut queue, &ids, i - 1, i);
        }
        while let Some(Reverse((_, left, l, r))) = queue.pop() {
            // Stale entry: either side changed or was merged away since it was queued.
            let Some(right) = next[left] else { continue };
            if ids[left] != Some(l) || ids[right] != Some(r) {
                continue;
            }
            let Some(&(_, merged)) = self.merges.get(&(l, r)) else {
                continue;
            };
            ids[left] = Some(merged);
            ids[right] = None;
            next[left] = next[right];
            if let Some(nn) = next[right] {
                prev[nn] = Some(left);
            }
            next[right] = None;
            if let Some(p) = prev[left] {
                push(&mut queue, &ids, p, left);
            }
            if let Some(nn) = next[left] {
                push(&mut queue, &ids, left, nn);
            }
        }
        let mut at = (n > 0).then_some(0);
        while let Some(i) = at {
            out.extend(ids[i]);
            at = next[i];
        }
    }

    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(text) = self.vocab.text(id) else {
            return Vec::new();
        };
        match self.vocab.token_type(id) {
            // Added tokens are stored as plain text, not in the byte alphabet.
            Some(TokenType::Control | TokenType::UserDefined) => text.as_bytes().to_vec(),
            _ => {
                let mut out = Vec::with_capacity(text.len());
                byte_level::decode_into(text, &mut out);
                out
            }
        }
    }
}
