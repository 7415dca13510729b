//! `kiln run --tp N`: the model split over N ranks (`kiln_models::tp`), a thread each:
//! N GPUs summing through NCCL (`--device cuda`, the default with N GPUs), or N shares of
//! the CPU's threads summing through host memory (`--device cpu`: a split where there are
//! no GPUs, and the way it is tested). Every rank runs the same generation: the
//! all-reduce leaves each rank the same logits and their samplers share the seed, so all
//! pick the same tokens; rank 0's text is what is shown. Over several hosts
//! (`--nnodes`, see `ranks`) host 0 shows it.

use crate::console::{CliResult, Failure};
use crate::model_file::{DeviceChoice, ModelFile};
use crate::ranks::{self, NodeArgs, Ranks, Watchdog};
use kiln_models::{generate, GenerateOptions, Generation, Sampler, SamplerConfig};

/// What [`generate_split`] needs of `kiln run`'s settings.
pub struct SplitRun<'a> {
    pub tp: usize,
    pub device: DeviceChoice,
    pub threads: Option<usize>,
    pub prompt: &'a [u32],
    pub sampler: SamplerConfig,
    pub opts: GenerateOptions<'a>,
    pub nodes: NodeArgs,
    /// What must be the same on every host (see `ranks::fingerprint`).
    pub fingerprint: String,
}

/// Generate on `r.tp` ranks: `on_start` runs once every rank here has loaded its part,
/// and `on_piece` sees rank 0's text as it comes (nothing on the other hosts, which give
/// back their first rank's generation: the same tokens).
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
    let ranks = Ranks::new("--tp", r.tp, r.device, r.threads, &r.nodes, &r.fingerprint)?;
    let here = ranks.here();
    let lead = here.start;
    let timeout = ranks::rank_timeout()?;
    let start = kiln_dist::start::StartLine::new(here.len());
    let results = ranks.each(|rank| -> CliResult<Option<Generation>> {
        let starting = Watchdog::starting(rank, 3 * timeout);
        let model = ranks
            .take(rank)
            .and_then(|(b, c)| Ok((file.checkpoint.load_rank(b, c.clone())?, c)));
        let (mut model, c) = start.cross(rank, model).map_err(Failure::usage)?;
        drop(starting);
        if rank == lead {
            on_start();
        }
        let dog = Watchdog::new(rank, c, timeout);
        let mut sampler = Sampler::new(r.sampler.clone());
        let g = generate(
            &mut model,
            &file.tokenizer,
            r.prompt,
            &mut sampler,
            &r.opts,
            |piece| {
                dog.alive();
                if rank == 0 {
                    on_piece(piece)
                }
            },
        );
        match g {
            Ok(g) => Ok((rank == lead).then_some(g)),
            Err(e) => {
                ranks.abort(rank, &e.to_string());
                Err(e.into())
            }
        }
    });
    let mut first = None;
    for result in results {
        if let Some(g) = result? {
            first = Some(g);
        }
    }
    first.ok_or_else(|| Failure::usage(format!("rank {lead} produced nothing")))
}
