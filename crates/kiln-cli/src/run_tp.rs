//! `kiln run --tp N`: the model split over N ranks (`kiln_models::tp`), a thread each:
//! N GPUs summing through NCCL (`--device cuda`, the default with N GPUs), or N shares of
//! the CPU's threads summing through host memory (`--device cpu`: a split where there are
//! no GPUs, and the way it is tested). Every rank runs the same generation: the
//! all-reduce leaves each rank the same logits and their samplers share the seed, so all
//! pick the same tokens; rank 0's text is what is shown.

use crate::console::{CliResult, Failure};
use crate::model_file::{DeviceChoice, ModelFile};
use crate::ranks::Ranks;
use kiln_models::{generate, GenerateOptions, Generation, Model, Sampler, SamplerConfig};

/// What [`generate_split`] needs of `kiln run`'s settings.
pub struct SplitRun<'a> {
    pub tp: usize,
    pub device: DeviceChoice,
    pub threads: Option<usize>,
    pub prompt: &'a [u32],
    pub sampler: SamplerConfig,
    pub opts: GenerateOptions<'a>,
}

/// Generate on `r.tp` ranks: `on_start` runs once every rank has loaded its part, and
/// `on_piece` sees rank 0's text as it comes.
pub fn generate_split(
    file: &ModelFile,
    r: &SplitRun,
    on_start: &(dyn Fn() + Sync),
    on_piece: &(dyn Fn(&str) + Sync),
) -> CliResult<Generation> {
    // What is wrong with the split as such is said once, before any rank starts.
    kiln_models::tp::Plan::new(file.config(), r.tp).map_err(|e| match e {
        kiln_core::Error::Unsupported(why) => Failure::usage(why),
        e => Failure::from(e),
    })?;
    let ranks = Ranks::new("--tp", r.tp, r.device, r.threads)?;
    let start = kiln_dist::start::StartLine::new(r.tp);
    let results: Vec<CliResult<Option<Generation>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..r.tp)
            .map(|rank| {
                let (ranks, start) = (&ranks, &start);
                s.spawn(move || -> CliResult<Option<Generation>> {
                    let model: CliResult<Model> = ranks
                        .take(rank, r.tp)
                        .and_then(|(b, c)| Ok(file.checkpoint.load_rank(b, c)?));
                    let mut model = start.cross(rank, model).map_err(Failure::usage)?;
                    if rank == 0 {
                        on_start();
                    }
                    let mut sampler = Sampler::new(r.sampler.clone());
                    let g = generate(
                        &mut model,
                        &file.tokenizer,
                        r.prompt,
                        &mut sampler,
                        &r.opts,
                        |piece| {
                            if rank == 0 {
                                on_piece(piece)
                            }
                        },
                    )?;
                    Ok((rank == 0).then_some(g))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Failure::usage("a rank panicked")))
            })
            .collect()
    });
    let mut first = None;
    for result in results {
        if let Some(g) = result? {
            first = Some(g);
        }
    }
    first.ok_or_else(|| Failure::usage("rank 0 produced nothing"))
}
