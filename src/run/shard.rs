//! Narrowing a run's prepared inputs to one shard's windows (`--shard I/N`).

use crate::run::inputs::Inputs;
use crate::score::Protocol;
use crate::shard::{plan, RunDomain, RunStream, Shard, ShardInfo};
use anyhow::Result;

/// Keeps only `shard`'s windows in `inputs` (streams it does not touch are dropped, and
/// domains without streams left) and returns what the shard report records about the run.
pub fn narrow(inputs: &mut Inputs, shard: Shard, protocol: Protocol) -> Result<ShardInfo> {
    let run_streams: Vec<RunStream> = inputs
        .streams
        .iter()
        .map(|p| RunStream {
            id: p.stream.id.clone(),
            domain: p.stream.domain.clone(),
            sha256: p.stream.sha256.clone(),
            input_tokens: p.tokens.len(),
            windows: p.windows.len(),
        })
        .collect();
    let run_domains = inputs
        .domains
        .iter()
        .map(|(id, title)| RunDomain {
            id: id.clone(),
            title: title.clone(),
        })
        .collect();
    let run_windows = inputs.window_count();
    let run_processed_tokens = inputs.processed_tokens();
    let per_stream: Vec<_> = inputs.streams.iter().map(|p| p.windows.clone()).collect();
    debug_assert_eq!(
        per_stream,
        crate::shard::run_windows(&run_streams, protocol)?,
        "the plan merge recomputes is the run's"
    );
    let (mine, ranges) = plan(&per_stream, shard)?;
    let mut kept = Vec::with_capacity(inputs.streams.len());
    for (mut p, r) in std::mem::take(&mut inputs.streams).into_iter().zip(ranges) {
        if r.is_empty() {
            continue;
        }
        p.first_window = r.start;
        p.windows = p.windows[r].to_vec();
        p.processed = p.windows.iter().map(|w| w.len()).sum();
        kept.push(p);
    }
    inputs.streams = kept;
    let streams = &inputs.streams;
    inputs
        .domains
        .retain(|(id, _)| streams.iter().any(|p| &p.stream.domain == id));
    Ok(ShardInfo {
        index: shard.index,
        count: shard.count,
        windows: [mine.start, mine.end],
        processed_tokens: inputs.processed_tokens(),
        run_windows,
        run_processed_tokens,
        run_streams,
        run_domains,
    })
}
