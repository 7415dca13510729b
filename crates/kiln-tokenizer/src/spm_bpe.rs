//! SentencePiece BPE merging, as llama.cpp's `llm_tokenizer_spm`: start from single
//! characters and repeatedly merge the adjacent pair whose concatenation is the vocabulary
//! piece with the highest score (ties: leftmost). Characters left outside the vocabulary
//! are returned as `None` for the caller's byte fallback.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

struct Bigram {
    left: usize,
    right: usize,
    score: f32,
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    // Max-heap: higher score first, then the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// Splits `text` into pieces; each is a vocabulary id found by `lookup` (which returns the
/// id and its score for pieces that may be merged into), or `None` with its byte range.
pub fn merge<F>(text: &str, lookup: F) -> Vec<Result<u32, std::ops::Range<usize>>>
where
    F: Fn(&str) -> Option<(u32, f32)>,
{
    let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
    for (i, (start, c)) in text.char_indices().enumerate() {
        let len = c.len_utf8();
        symbols.push(Symbol {
            start,
            len,
            prev: i.checked_sub(1),
            next: (start + len < text.len()).then_some(i + 1),
        });
    }

    let mut queue = BinaryHeap::new();
    let try_add =
        |symbols: &[Symbol], queue: &mut BinaryHeap<Bigram>, left: usize, right: usize| {
            let (l, r) = (&symbols[left], &symbols[right]);
            let piece = &text[l.start..r.start + r.len];
            if let Some((_, score)) = lookup(piece) {
                queue.push(Bigram {
                    left,
                    right,
                    score,
                    size: piece.len(),
                });
            }
        };
    for i in 1..symbols.len() {
        try_add(&symbols, &mut queue, i - 1, i);
    }

    while let Some(b) = queue.pop() {
        let (ln, rn) = (symbols[b.left].len, symbols[b.right].len);
        // Stale entry: one side was merged away since it was queued.
        if ln == 0 || rn == 0 || ln + rn != b.size {
            continue;
        }
        symbols[b.left].len += rn;
        symbols[b.right].len = 0;
        let next = symbols[b.right].next;
        symbols[b.left].next = next;
        if let Some(n) = next {
            symbols[n].prev = Some(b.left);
        }
        if let Some(p) = symbols[b.left].prev {
            try_add(&symbols, &mut queue, p, b.left);
        }
        if let Some(n) = next {
            try_add(&symbols, &mut queue, b.left, n);
        }
    }

    let mut out = Vec::new();
    let mut at = if symbols.is_empty() { None } else { Some(0) };
    while let Some(i) = at {
        let s = &symbols[i];
        let range = s.start..s.start + s.len;
        // Merged pieces are always in the vocabulary; only single characters can miss.
        out.push(lookup(&text[range.clone()]).map(|(id, _)| id).ok_or(range));
        at = s.next;
    }
    out
}
