//! SentencePiece unigram segmentation: the Viterbi path maximising the summed piece scores,
//! as sentencepiece's `unigram::Model::EncodeOptimized`.
//!
//! Like sentencepiece, the pieces that start at a position are found by one prefix search
//! (sentencepiece walks a trie; here a sorted list of the pieces is narrowed byte by byte),
//! not by looking up every substring, which costs O(L²) per position for pieces of L
//! bytes. And like sentencepiece's trainer, which makes no piece longer than 512
//! characters, pieces are refused past that length, so the lattice has O(n·512) edges at
//! most.

use crate::vocab::Vocab;
use kiln_core::{Error, Result};

/// sentencepiece's bound on `max_sentencepiece_length` (trainer_interface.cc).
pub const MAX_PIECE_CHARS: usize = 512;

/// The pieces the lattice may use, sorted by their bytes for prefix search.
#[derive(Default)]
pub struct PieceIndex {
    sorted: Vec<u32>,
}

impl PieceIndex {
    /// The non-empty pieces for which `usable` holds; one id per text (the one
    /// `Vocab::id` gives).
    pub fn new(vocab: &Vocab, usable: impl Fn(u32) -> bool) -> Result<PieceIndex> {
        let mut sorted = Vec::new();
        for (i, text) in vocab.tokens.iter().enumerate() {
            let id = i as u32;
            if text.is_empty() || !usable(id) || vocab.id(text) != Some(id) {
                continue;
            }
            let chars = text.chars().count();
            if chars > MAX_PIECE_CHARS {
                return Err(Error::format(format!(
                    "piece {id} is {chars} characters long; unigram pieces may have at most \
                     {MAX_PIECE_CHARS} (sentencepiece's limit)"
                )));
            }
            sorted.push(id);
        }
        sorted.sort_unstable_by(|&a, &b| vocab.tokens[a as usize].cmp(&vocab.tokens[b as usize]));
        Ok(PieceIndex { sorted })
    }

    /// Calls `found(end, id)` for each piece equal to `text[start..end]`.
    fn for_each_prefix(
        &self,
        vocab: &Vocab,
        text: &[u8],
        start: usize,
        mut found: impl FnMut(usize, u32),
    ) {
        let piece = |id: u32| vocab.tokens[id as usize].as_bytes();
        let rest = &text[start..];
        let (mut lo, mut hi) = (0, self.sorted.len());
        let mut depth = 0;
        // The pieces sorted[lo..hi] are those that start with rest[..depth].
        while lo < hi {
            let first = self.sorted[lo];
            if piece(first).len() == depth {
                // The piece equal to the prefix sorts before its extensions; texts are
                // unique, so there is at most one.
                found(start + depth, first);
                lo += 1;
                continue;
            }
            if hi - lo == 1 {
                if rest.starts_with(piece(first)) {
                    found(start + piece(first).len(), first);
                }
                return;
            }
            let Some(&b) = rest.get(depth) else { return };
            let range = &self.sorted[lo..hi];
            let below = gallop(range, |id| piece(id)[depth] < b);
            let not_above = range.len() - gallop_back(range, |id| piece(id)[depth] > b);
            hi = lo + not_above;
            lo += below;
            depth += 1;
        }
    }
}

/// `ids.partition_point(pred)`, probing from the front in doubling steps: narrowing by a
/// few entries costs a few probes, not log(range).
fn gallop(ids: &[u32], pred: impl Fn(u32) -> bool) -> usize {
    let mut known = 0; // pred holds for ids[..known]
    let mut step = 1;
    while known < ids.len() && pred(ids[known]) {
        let next = (known + step).min(ids.len());
        if next < ids.len() && pred(ids[next]) {
            known = next + 1;
            step *= 2;
        } else {
            return known + 1 + ids[known + 1..next].partition_point(|&id| pred(id));
        }
    }
    known
}

/// The number of entries at the end of `ids` for which `pred` holds (pred must hold for
/// a suffix), probing from the back.
fn gallop_back(ids: &[u32], pred: impl Fn(u32) -> bool) -> usize {
    let mut known = 0; // pred holds for the last `known`
    let mut step = 1;
    while known < ids.len() && pred(ids[ids.len() - 1 - known]) {
        let next = (known + step).min(ids.len());
        if next < ids.len() && pred(ids[ids.len() - 1 - next]) {
            known = next + 1;
            step *= 2;
        } else {
            let window = &ids[ids.len() - next..ids.len() - known - 1];
            return known + 1 + window.len() - window.partition_point(|&id| !pred(id));
        }
    }
    known
}

/// Segments `text`; unknown characters (no single-character piece) cost `unk_score` and come
/// back as `Err(range)`, consecutive ones merged into one range as sentencepiece does.
pub fn viterbi<F>(
    text: &str,
    pieces: &PieceIndex,
    vocab: &Vocab,
    unk_score: f32,
    score: F,
) -> Vec<Result<u32, std::ops::Range<usize>>>
where
    F: Fn(u32) -> f32,
{
    #[derive(Clone, Copy)]
    struct Best {
        score: f32,
        start: usize,
        id: Option<u32>,
    }
    let n = text.len();
    let mut best: Vec<Option<Best>> = vec![None; n + 1];
    best[0] = Some(Best {
        score: 0.0,
        start: 0,
        id: None,
    });
    let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
    for (k, &start) in bounds.iter().enumerate() {
        let Some(base) = best[start] else { continue };
        let char_end = bounds.get(k + 1).copied().unwrap_or(n);
        let mut has_single = false;
        // Pieces are whole UTF-8 strings, so each match ends on a character boundary.
        pieces.for_each_prefix(vocab, text.as_bytes(), start, |end, id| {
            if end == char_end {
                has_single = true;
            }
            let score = base.score + score(id);
            // Strictly better only: on ties the earliest start, found first, stays.
            if best[end].is_none_or(|b| score > b.score) {
                best[end] = Some(Best {
                    score,
                    start,
                    id: Some(id),
                });
            }
        });
        if !has_single {
            let score = base.score + unk_score;
            if best[char_end].is_none_or(|b| score > b.score) {
                best[char_end] = Some(Best {
                    score,
                    start,
                    id: None,
                });
            }
        }
    }

    let mut rev = Vec::new();
    let mut at = n;
    while at > 0 {
        // Every boundary is reachable: each character has at least the unknown edge.
        let Some(b) = best[at] else { break };
        rev.push(b.id.ok_or(b.start..at));
        at = b.start;
    }
    let mut out: Vec<Result<u32, std::ops::Range<usize>>> = Vec::with_capacity(rev.len());
    for piece in rev.into_iter().rev() {
        match (out.last_mut(), piece) {
            (Some(Err(prev)), Err(r)) if prev.end == r.start => prev.end = r.end,
            (_, p) => out.push(p),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::TokenType;

    fn vocab(pieces: &[&str]) -> Vocab {
        let n = pieces.len();
        Vocab::new(
            pieces.iter().map(|p| p.to_string()).collect(),
            vec![0.0; n],
            vec![TokenType::Normal; n],
        )
        .unwrap()
    }

    #[test]
    fn prefix_search_finds_every_piece_that_starts_a_position() {
        let v = vocab(&["a", "ab", "abc", "abd", "b", "bc", "", "zz", "ab"]);
        let index = PieceIndex::new(&v, |_| true).unwrap();
        let text = b"abcab";
        for start in 0..text.len() {
            let mut got = Vec::new();
            index.for_each_prefix(&v, text, start, |end, id| got.push((end, id)));
            got.sort();
            let mut want: Vec<(usize, u32)> = (start + 1..=text.len())
                .filter_map(|end| {
                    let s = std::str::from_utf8(&text[start..end]).unwrap();
                    v.id(s).map(|id| (end, id))
                })
                .collect();
            want.sort();
            assert_eq!(got, want, "start {start}");
        }
    }

    #[test]
    fn gallops_agree_with_partition_point() {
        let ids: Vec<u32> = (0..40).collect();
        for cut in 0..=40 {
            assert_eq!(gallop(&ids, |x| x < cut), cut as usize, "front {cut}");
            assert_eq!(
                gallop_back(&ids, |x| x >= cut),
                40 - cut as usize,
                "back {cut}"
            );
        }
    }
}
