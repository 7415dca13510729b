//! Attention over a paged KV cache: many sequences' keys and values in blocks of one pool,
//! found through block tables (a server's batch), in every KV type. Each query is checked
//! against float64 attention over its own sequence's rows laid out contiguously.

use super::kv_cache::kv_types;
use crate::reference::{self, assert_close, AttentionShape};
use crate::target::{random, stored, Target};
use kiln_core::{AttentionParams, DType, Pages};

/// One sequence of a paged batch: its block table and the positions of its queries.
struct Sequence {
    blocks: Vec<i32>,
    positions: Vec<i32>,
}

/// A pool of `pool_blocks` blocks of `block` rows, random, the sequences' queries run in
/// one call, each query's output against float64 attention over its sequence alone; for
/// every KV type the head size allows.
fn check_paged(
    t: &Target,
    stream: u64,
    shape: AttentionShape,
    block: usize,
    pool_blocks: usize,
    seqs: &[Sequence],
) {
    for dtype in kv_types(shape.head_dim) {
        check_paged_of(t, stream, shape, block, pool_blocks, seqs, dtype);
    }
}

fn check_paged_of(
    t: &Target,
    stream: u64,
    shape: AttentionShape,
    block: usize,
    pool_blocks: usize,
    seqs: &[Sequence],
    dtype: DType,
) {
    let mut rng = t.rng(stream);
    let (heads, kvh, hd) = (shape.heads, shape.kv_heads, shape.head_dim);
    let row = kvh * hd;
    let rows = pool_blocks * block;
    let kv = stored(dtype, &random(&mut rng, rows * row, 1.5));
    let vv = stored(dtype, &random(&mut rng, rows * row, 1.0));
    let positions: Vec<i32> = seqs.iter().flat_map(|s| s.positions.clone()).collect();
    let seq_of: Vec<i32> = seqs
        .iter()
        .enumerate()
        .flat_map(|(i, s)| std::iter::repeat_n(i as i32, s.positions.len()))
        .collect();
    let max_blocks = seqs.iter().map(|s| s.blocks.len()).max().unwrap_or(1);
    // Unused entries hold -1: a kernel must not read past the blocks a query sees.
    let mut tables = vec![-1i32; seqs.len() * max_blocks];
    for (i, s) in seqs.iter().enumerate() {
        tables[i * max_blocks..][..s.blocks.len()].copy_from_slice(&s.blocks);
    }
    let n = positions.len();
    let qv = random(&mut rng, n * heads * hd, 1.5);
    let q = t.upload(DType::F32, &[n, heads, hd], &qv);
    let k = t.upload(dtype, &[rows, kvh, hd], &kv);
    let v = t.upload(dtype, &[rows, kvh, hd], &vv);
    let (seq_t, tables_t) = (t.ints(&seq_of), t.ints(&tables));
    let mut table_tensor = tables_t;
    table_tensor
        .reshape(crate::target::shape(&[seqs.len(), max_blocks]))
        .unwrap();
    let mut out = t.poisoned(&[n, heads, hd]);
    let params = AttentionParams {
        scale: shape.scale,
        softcap: shape.softcap,
        window: shape.window,
    };
    let runs: Vec<usize> = seqs.iter().map(|s| s.positions.len()).collect();
    let pages = Pages {
        seq: &seq_t,
        tables: &table_tensor,
        block,
        runs: &runs,
    };
    t.backend
        .paged_attention(&q, &k, &v, &t.ints(&positions), &pages, &params, &mut out)
        .unwrap();
    let got = t.read(&out);
    let mut at = 0;
    for (i, s) in seqs.iter().enumerate() {
        // The sequence's positions laid out contiguously, as the one-sequence reference reads.
        let len = s.positions.iter().max().map_or(0, |&p| p as usize + 1);
        let gather = |pool: &[f32]| -> Vec<f32> {
            (0..len)
                .flat_map(|p| {
                    let r = s.blocks[p / block] as usize * block + p % block;
                    pool[r * row..][..row].to_vec()
                })
                .collect()
        };
        let m = s.positions.len();
        let want = reference::attention(
            &qv[at * heads * hd..][..m * heads * hd],
            &gather(&kv),
            &gather(&vv),
            &s.positions,
            shape,
        );
        let what = format!(
            "{shape:?} {dtype} block {block}, sequence {i} at {:?}",
            s.positions
        );
        assert_close(
            &got[at * heads * hd..][..m * heads * hd],
            &want,
            2e-5,
            &what,
        );
        at += m;
    }
}

/// Decodes of several sequences beside a prompt chunk, blocks out of order and shared,
/// awkward and real head sizes, windows and soft-caps, long tables.
pub fn paged_attention(t: &Target) {
    let seqs = || {
        vec![
            // Decode at the end of its third block.
            Sequence {
                blocks: vec![5, 2, 7],
                positions: vec![47],
            },
            // A prompt chunk across a block edge.
            Sequence {
                blocks: vec![0, 9],
                positions: (10..27).collect(),
            },
            // A one-token prompt, and a sequence whose first block is shared with the first.
            Sequence {
                blocks: vec![3],
                positions: vec![0],
            },
            Sequence {
                blocks: vec![5, 1],
                positions: vec![20],
            },
        ]
    };
    for (c, (hd, window, softcap)) in [
        (5, None, None),
        (64, Some(9), Some(20.0f32)),
        (128, None, None),
    ]
    .into_iter()
    .enumerate()
    {
        let shape = AttentionShape {
            heads: 8,
            kv_heads: 2,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            softcap,
            window,
        };
        check_paged(t, c as u64, shape, 16, 10, &seqs());
    }
    // A real model's heads (32 on 8) over long tables: a decode of 700 positions among
    // short ones, blocks of 16 taken from a large pool in a scattered order.
    let long: Vec<i32> = (0..44).map(|b| b * 37 % 61).collect();
    let shape = AttentionShape {
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        scale: 1.0 / 128f32.sqrt(),
        softcap: None,
        window: None,
    };
    let batch = vec![
        Sequence {
            blocks: long,
            positions: vec![699],
        },
        Sequence {
            blocks: vec![61, 62],
            positions: vec![17, 18, 19],
        },
        Sequence {
            blocks: vec![63],
            positions: vec![3],
        },
    ];
    check_paged(t, 10, shape, 16, 64, &batch);

    // A server's chunked prompts beside decodes (CUDA: tiles of 16 or 32 rows on tensor
    // cores, the decodes by row list): chunks of several tiles whose keys span several
    // chunks of 64 positions and scattered blocks, a chunk of two rows, heads of 64 in
    // groups of 8 and of 128 in groups of 4 and 1, a window and a soft-cap.
    let scattered =
        |first: i32, count: i32| -> Vec<i32> { (0..count).map(|b| (first + 7 * b) % 40).collect() };
    for (c, (heads, kvh, hd, window, softcap)) in [
        (16, 2, 64, None, None),
        (8, 2, 128, Some(70usize), Some(30.0f32)),
        (4, 4, 64, None, None),
    ]
    .into_iter()
    .enumerate()
    {
        let shape = AttentionShape {
            heads,
            kv_heads: kvh,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            softcap,
            window,
        };
        let batch = vec![
            Sequence {
                blocks: scattered(3, 10),
                positions: (100..150).collect(),
            },
            Sequence {
                blocks: scattered(5, 3),
                positions: vec![40],
            },
            Sequence {
                blocks: scattered(11, 5),
                positions: (61..63).collect(),
            },
            Sequence {
                blocks: scattered(17, 3),
                positions: (0..37).collect(),
            },
            Sequence {
                blocks: scattered(23, 10),
                positions: vec![150],
            },
        ];
        check_paged(t, 20 + c as u64, shape, 16, 40, &batch);
    }

    // Training's micro-batches: prompts alone, each from position 0 in its own scattered
    // blocks (CUDA over F32: the prompt kernel's tiles, each kept inside one sequence),
    // of lengths whose starts allow tiles of 8 rows, and of 32 rows each.
    for (c, (heads, kvh, hd, window, lengths)) in [
        (12, 12, 64, None, [40, 24, 17]),
        (8, 2, 128, Some(20usize), [40, 24, 17]),
        (6, 3, 5, None, [32, 32, 32]),
        (16, 2, 64, None, [32, 32, 32]),
    ]
    .into_iter()
    .enumerate()
    {
        let shape = AttentionShape {
            heads,
            kv_heads: kvh,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            softcap: None,
            window,
        };
        let batch: Vec<Sequence> = lengths
            .iter()
            .enumerate()
            .map(|(i, &len)| Sequence {
                blocks: scattered(1 + 13 * i as i32, 3),
                positions: (0..len).collect(),
            })
            .collect();
        check_paged(t, 30 + c as u64, shape, 16, 40, &batch);
    }
}

/// A block id outside the pool is an error, or (on devices that cannot report errors
/// mid-step) hides its keys: never a fault or a read outside the pool.
/// Both for one query and for a prompt chunk of five (heads of 64 over an f16 pool: the
/// tensor-core kernel on CUDA).
pub fn paged_attention_with_a_block_outside_the_pool(t: &Target) {
    for (dtype, hd, positions) in [
        (DType::F32, 16, vec![20]),
        (DType::F16, 64, (16..21).collect::<Vec<i32>>()),
    ] {
        let (heads, kvh, block, n) = (4, 2, 16, positions.len());
        let q = t.upload(DType::F32, &[n, heads, hd], &vec![0.5; n * heads * hd]);
        let ones = vec![1.0; 2 * block * kvh * hd];
        let k = t.upload(dtype, &[2 * block, kvh, hd], &stored(dtype, &ones));
        let v = t.upload(dtype, &[2 * block, kvh, hd], &stored(dtype, &ones));
        let mut tables = t.ints(&[1, 1_000_000]);
        tables.reshape(crate::target::shape(&[1, 2])).unwrap();
        let seq = t.ints(&vec![0; n]);
        let pages = Pages {
            seq: &seq,
            tables: &tables,
            block,
            runs: &[n],
        };
        let mut out = t.poisoned(&[n, heads, hd]);
        let params = AttentionParams {
            scale: 0.25,
            softcap: None,
            window: None,
        };
        if t.backend
            .paged_attention(&q, &k, &v, &t.ints(&positions), &pages, &params, &mut out)
            .is_ok()
        {
            // The visible keys (block 1's first 16 positions) are all ones: so is the output.
            let got = t.read(&out);
            assert!(
                got.iter().all(|&x| (x - 1.0).abs() < 1e-5),
                "{dtype}: keys of a block outside the pool were read: {:?}",
                &got[..4]
            );
        }
    }
}
