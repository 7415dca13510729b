//! SentencePiece unigram segmentation: the Viterbi path maximising the summed piece scores,
//! as sentencepiece's `unigram::Model::EncodeOptimized`.

/// What `lookup` says about a candidate piece.
pub struct Piece {
    pub id: u32,
    pub score: f32,
}

/// Segments `text`; unknown characters (no single-character piece) cost `unk_score` and come
/// back as `Err(range)`, consecutive ones merged into one range as sentencepiece does.
pub fn viterbi<F>(
    text: &str,
    max_piece_len: usize,
    unk_score: f32,
    lookup: F,
) -> Vec<Result<u32, std::ops::Range<usize>>>
where
    F: Fn(&str) -> Option<Piece>,
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
        // Candidate ends at later character boundaries, up to the longest piece.
        for &end in bounds[k + 1..].iter().chain(std::iter::once(&n)) {
            if end - start > max_piece_len {
                break;
            }
            if let Some(p) = lookup(&text[start..end]) {
                if end == char_end {
                    has_single = true;
                }
                let score = base.score + p.score;
                // Strictly better only: on ties the earliest start, found first, stays.
                if best[end].is_none_or(|b| score > b.score) {
                    best[end] = Some(Best {
                        score,
                        start,
                        id: Some(p.id),
                    });
                }
            }
        }
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
