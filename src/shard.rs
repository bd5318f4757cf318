//! Splitting one run's windows over many processes (`--shard I/N`) and the plan `merge`
//! checks them against.
//!
//! A run's windows are listed in one order (streams in input order, each stream's windows in
//! order) and cut into N contiguous pieces of nearly equal processed tokens, never by stream
//! count: one long stream may span several shards and a shard may hold several short
//! streams. The cut depends only on the streams' token counts and the protocol, so every
//! shard computes the same plan on its own, and `merge` recomputes it to check that the
//! shards it was given are exactly the pieces of one run. Because every sum in a report is
//! accumulated window by window in this order, adding the shards' windows back up in the
//! same order gives the unsharded run's bits.

use crate::score::{windows, Protocol, Window};
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// The most shards a run may be split into (more than any cluster; bounds the plan).
pub const MAX_SHARDS: usize = 1 << 16;

/// `--shard I/N`: the I-th (1-based) of N pieces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    pub index: usize,
    pub count: usize,
}

impl Shard {
    /// Parses `I/N` with `1 <= I <= N <= MAX_SHARDS`.
    pub fn parse(s: &str) -> Result<Shard> {
        let Some((i, n)) = s.split_once('/') else {
            bail!("--shard {s}: expected I/N, the I-th of N shards counted from 1 (e.g. 2/8)");
        };
        let num = |t: &str| t.trim().parse::<usize>().ok();
        let (Some(index), Some(count)) = (num(i), num(n)) else {
            bail!("--shard {s}: expected I/N with whole numbers, the I-th of N shards counted from 1 (e.g. 2/8)");
        };
        if count == 0 {
            bail!("--shard {s}: the shard count must be at least 1");
        }
        if count > MAX_SHARDS {
            bail!("--shard {s}: at most {MAX_SHARDS} shards");
        }
        if index == 0 || index > count {
            bail!("--shard {s}: the shard index counts from 1 to the shard count (1/{count} .. {count}/{count})");
        }
        Ok(Shard { index, count })
    }

    pub fn name(&self) -> String {
        format!("{}/{}", self.index, self.count)
    }
}

/// Cuts `costs` (in order) into `n` contiguous, non-empty ranges of nearly equal sums: the
/// k-th cut is the index whose prefix sum is nearest to k/n of the total (the earlier one on
/// a tie), moved only as far as needed to keep every range non-empty. Errors when there are
/// fewer items than ranges.
pub fn split(costs: &[u64], n: usize) -> Result<Vec<Range<usize>>> {
    let w = costs.len();
    if n == 0 || n > w {
        bail!("the run has {w} windows, too few for {n} shards (use at most {w})");
    }
    let mut prefix = Vec::with_capacity(w + 1);
    prefix.push(0u128);
    for &c in costs {
        prefix.push(prefix.last().unwrap() + c as u128);
    }
    let total = prefix[w];
    let n128 = n as u128;
    let mut cuts = vec![0usize];
    for k in 1..n {
        let goal = total * k as u128; // compare prefix·n with k·total (exact, no division)
                                      // The first cut at or past the goal (k < n, so one exists), or the one before it
                                      // when that is at least as near.
        let mut j = prefix.partition_point(|&p| p * n128 < goal);
        if j > 0 && goal - prefix[j - 1] * n128 <= prefix[j] * n128 - goal {
            j -= 1;
        }
        let lo = cuts[k - 1] + 1;
        let hi = w - (n - k);
        cuts.push(j.clamp(lo, hi));
    }
    cuts.push(w);
    Ok(cuts.windows(2).map(|c| c[0]..c[1]).collect())
}

/// One stream of a sharded run, as every shard records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunStream {
    pub id: String,
    pub domain: String,
    pub sha256: String,
    /// Tokens scored over (after a `--max-tokens` cap): with the protocol, the windows.
    pub input_tokens: usize,
    pub windows: usize,
}

/// A domain of the run (id and title), in the corpus's order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunDomain {
    pub id: String,
    pub title: String,
}

/// What a shard report records about its place in the run (`shard` in report.json).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardInfo {
    pub index: usize,
    pub count: usize,
    /// This shard's windows, `[first, end)` in the run's window order.
    pub windows: [usize; 2],
    pub processed_tokens: usize,
    /// Windows and processed tokens of the whole run (all shards).
    pub run_windows: usize,
    pub run_processed_tokens: usize,
    /// Every stream and domain of the whole run, in order.
    pub run_streams: Vec<RunStream>,
    pub run_domains: Vec<RunDomain>,
}

impl ShardInfo {
    pub fn shard(&self) -> Shard {
        Shard {
            index: self.index,
            count: self.count,
        }
    }
}

/// The whole run's windows, one list per stream, from the recorded token counts.
pub fn run_windows(streams: &[RunStream], p: Protocol) -> Result<Vec<Vec<Window>>> {
    streams
        .iter()
        .map(|s| {
            let ws = windows(s.input_tokens, p)
                .map_err(|e| anyhow::anyhow!("stream `{}`: {e}", s.id))?;
            if ws.len() != s.windows {
                bail!(
                    "stream `{}`: {} input tokens make {} windows under context {} stride {}, not the {} recorded",
                    s.id,
                    s.input_tokens,
                    ws.len(),
                    p.context,
                    p.stride,
                    s.windows
                );
            }
            Ok(ws)
        })
        .collect()
}

/// The plan of `shard`: for every stream, the range of its windows this shard scores (empty
/// for streams it does not touch), and the shard's range in the run's window order.
pub fn plan(per_stream: &[Vec<Window>], shard: Shard) -> Result<(Range<usize>, Vec<Range<usize>>)> {
    let costs: Vec<u64> = per_stream
        .iter()
        .flatten()
        .map(|w| w.len() as u64)
        .collect();
    let pieces =
        split(&costs, shard.count).map_err(|e| anyhow::anyhow!("--shard {}: {e}", shard.name()))?;
    let mine = pieces[shard.index - 1].clone();
    let mut start = 0;
    let ranges = per_stream
        .iter()
        .map(|ws| {
            let (a, b) = (start, start + ws.len());
            start = b;
            let lo = mine.start.clamp(a, b) - a;
            let hi = mine.end.clamp(a, b) - a;
            lo..hi
        })
        .collect();
    Ok((mine, ranges))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn shard_specs() {
        assert_eq!(Shard::parse("2/8").unwrap(), Shard { index: 2, count: 8 });
        assert_eq!(Shard::parse("1/1").unwrap(), Shard { index: 1, count: 1 });
        for (s, want) in [
            (
                "3/2",
                "--shard 3/2: the shard index counts from 1 to the shard count (1/2 .. 2/2)",
            ),
            ("0/0", "--shard 0/0: the shard count must be at least 1"),
            ("0/4", "--shard 0/4: the shard index counts from 1"),
            ("2", "--shard 2: expected I/N"),
            ("a/b", "--shard a/b: expected I/N with whole numbers"),
            ("-1/4", "--shard -1/4: expected I/N with whole numbers"),
            ("1/99999999", "--shard 1/99999999: at most 65536 shards"),
        ] {
            let e = Shard::parse(s).unwrap_err().to_string();
            assert!(e.starts_with(want), "{s}: {e}");
        }
    }

    #[test]
    fn splits_balance_processed_tokens_not_counts() {
        // One long stream of 4 windows of 100 tokens, then 8 short windows of 10.
        let mut costs = vec![100u64; 4];
        costs.extend([10u64; 8]);
        let p = split(&costs, 2).unwrap();
        // 200 | 280: the cut nearest to half of 480 (the 300 one is farther).
        assert_eq!(p, vec![0..2, 2..12]);
        let p = split(&costs, 4).unwrap();
        assert_eq!(p, vec![0..1, 1..2, 2..4, 4..12]);
        assert!(split(&costs, 13)
            .unwrap_err()
            .to_string()
            .contains("12 windows, too few for 13 shards"));
        // As many shards as windows: one each, however uneven.
        let p = split(&[1000, 1, 1], 3).unwrap();
        assert_eq!(p, vec![0..1, 1..2, 2..3]);
    }

    proptest! {
        #[test]
        fn pieces_are_contiguous_nonempty_and_balanced(
            costs in proptest::collection::vec(1u64..5000, 1..300),
            n_frac in 0.0f64..1.0,
        ) {
            let n = 1 + ((costs.len() - 1) as f64 * n_frac) as usize;
            let p = split(&costs, n).unwrap();
            prop_assert_eq!(p.len(), n);
            prop_assert_eq!(p[0].start, 0);
            prop_assert_eq!(p[n - 1].end, costs.len());
            for w in p.windows(2) {
                prop_assert_eq!(w[0].end, w[1].start);
            }
            let total: u64 = costs.iter().sum();
            let biggest = *costs.iter().max().unwrap();
            for r in &p {
                prop_assert!(!r.is_empty());
                // Unclamped cuts are off their goal by at most half a window each; the
                // non-empty clamp only binds when windows are scarce.
                let sum: u64 = costs[r.clone()].iter().sum();
                if n * 4 <= costs.len() && biggest * (n as u64) * 4 <= total {
                    prop_assert!(sum as f64 <= total as f64 / n as f64 + biggest as f64 + 1.0);
                }
            }
        }
    }
}
