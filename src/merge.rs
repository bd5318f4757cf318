//! `ninfer-perplexity merge`: shard reports (`--shard I/N`) back into the one report of the
//! whole run.
//!
//! Merging refuses anything that is not exactly the N pieces of one run: reports without a
//! shard record, shards whose numbers came from a different artifact, tokenizer, corpus, KV
//! format, protocol, token cap, precision, device class, build or test fault, a shard given
//! twice or missing, and shards whose windows are not the ones the plan
//! ([`crate::shard::plan`]) assigns them. What passes is summed window by window in the
//! run's window order, the order an unsharded run accumulates in, so the NLL sums, the
//! calibration sums and the table are the unsharded run's bits. Only what describes the
//! processes differs: timings are summed over shards (device-seconds), and `merged_from`
//! names each shard's run, device and time.

use crate::compare::load::Loaded;
use crate::report::{aggregate, CalibrationReport, MergedShard, Report, StreamReport, Totals};
use crate::score::{Calibration, NllSum, Protocol};
use crate::shard::{plan, run_windows, RunStream, ShardInfo};
use anyhow::{anyhow, bail, Result};

/// Everything that must be equal across the shards of one run, by name.
fn identity(r: &Report, s: &ShardInfo) -> Vec<(&'static str, String)> {
    let st = &r.settings;
    vec![
        (
            "tool version and commit",
            format!("{} (git {})", r.tool.version, r.tool.commit),
        ),
        ("artifact digest", r.artifact.digest.clone()),
        ("tokenizer", r.tokenizer.sha256.clone()),
        (
            "corpus",
            r.corpus.as_ref().map_or("none (a --text run)".into(), |c| {
                format!(
                    "{} (manifest sha256 {})",
                    c.name,
                    c.manifest_sha256.as_deref().unwrap_or("none")
                )
            }),
        ),
        ("mode", st.mode.clone()),
        ("KV format", st.kv_dtype.clone()),
        (
            "protocol",
            format!("context {} stride {}", st.context, st.stride),
        ),
        (
            "--max-tokens",
            st.max_tokens.map_or("none".into(), |m| m.to_string()),
        ),
        ("precision", st.precision.clone()),
        ("device class", st.device_class.clone()),
        (
            "test fault",
            st.test_fault.clone().unwrap_or_else(|| "none".into()),
        ),
        ("shard count", s.count.to_string()),
        ("streams", s.run_streams.len().to_string()),
    ]
}

/// The first difference between two runs' stream lists, in words.
fn stream_difference(a: &[RunStream], b: &[RunStream]) -> Option<String> {
    let show = |s: &RunStream| {
        format!(
            "`{}` ({} tokens, sha256 {})",
            s.id,
            s.input_tokens,
            &s.sha256[..s.sha256.len().min(12)]
        )
    };
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .map(|i| format!("stream {} is {} vs {}", i + 1, show(&a[i]), show(&b[i])))
}

/// Merges the shard reports in `inputs` (any order) into the whole run's report.
pub fn merge(inputs: &[Loaded]) -> Result<Report> {
    if inputs.is_empty() {
        bail!("merge: give the shard reports (run directories or report.json files)");
    }
    let mut shards: Vec<(&Loaded, &ShardInfo)> = Vec::with_capacity(inputs.len());
    for l in inputs {
        match (&l.report.shard, &l.report.merged_from) {
            (Some(s), _) => shards.push((l, s)),
            (None, Some(_)) => bail!(
                "{}: an already merged report, not a shard report (merge the shard runs themselves)",
                l.path.display()
            ),
            (None, None) => bail!(
                "{}: not a shard report (no `shard` record: shards come from runs with --shard I/N)",
                l.path.display()
            ),
        }
        if l.report.settings.reference.is_some() {
            bail!(
                "{}: a run with a reference pass cannot be merged",
                l.path.display()
            );
        }
    }
    let (first, first_info) = shards[0];
    let want = identity(&first.report, first_info);
    for &(l, s) in &shards[1..] {
        let got = identity(&l.report, s);
        let why = want
            .iter()
            .zip(&got)
            .find(|(a, b)| a.1 != b.1)
            .map(|((name, a), (_, b))| format!("{name} {a} vs {b}"))
            .or_else(|| stream_difference(&first_info.run_streams, &s.run_streams))
            .or_else(|| {
                (first_info.run_domains != s.run_domains)
                    .then(|| "the corpus's domains differ".to_string())
            });
        if let Some(why) = why {
            bail!(
                "{} and {} are shards of different runs: {why}",
                first.path.display(),
                l.path.display()
            );
        }
    }
    let n = first_info.count;
    if n == 0 || n > crate::shard::MAX_SHARDS {
        bail!(
            "{}: a shard count of {n} (1..={} are possible)",
            first.path.display(),
            crate::shard::MAX_SHARDS
        );
    }
    let mut by_index: Vec<Option<(&Loaded, &ShardInfo)>> = vec![None; n];
    for &(l, s) in &shards {
        if s.index == 0 || s.index > n {
            bail!(
                "{}: shard index {} outside 1..{n}",
                l.path.display(),
                s.index
            );
        }
        if let Some((other, _)) = by_index[s.index - 1] {
            bail!(
                "shard {}/{n} given twice: {} and {}",
                s.index,
                other.path.display(),
                l.path.display()
            );
        }
        by_index[s.index - 1] = Some((l, s));
    }
    let missing: Vec<String> = (1..=n)
        .filter(|i| by_index[i - 1].is_none())
        .map(|i| format!("{i}/{n}"))
        .collect();
    if !missing.is_empty() {
        bail!(
            "{}: its run has {n} shards; missing {} ({} given)",
            first.path.display(),
            missing.join(", "),
            shards.len()
        );
    }
    let shards: Vec<(&Loaded, &ShardInfo)> = by_index.into_iter().flatten().collect();

    let st = &first.report.settings;
    let sliding = st.window_plan == crate::score::WindowPlan::Sliding;
    let protocol = Protocol::with_plan(st.window_plan, st.context, sliding.then_some(st.stride))
        .ok()
        .filter(|p| p.stride == st.stride)
        .ok_or_else(|| {
            anyhow!(
                "{}: context {} stride {} is not a {} protocol",
                first.path.display(),
                st.context,
                st.stride,
                st.window_plan.name()
            )
        })?;
    let run_streams = &first_info.run_streams;
    // The plan is recomputed from these counts: check them against what the files hold
    // first, so no recorded number can make it allocate more than the reports themselves.
    let held: usize = shards
        .iter()
        .map(|(l, _)| {
            l.report
                .streams
                .iter()
                .map(|x| x.windows.len())
                .sum::<usize>()
        })
        .sum();
    let recorded: usize = run_streams
        .iter()
        .map(|x| x.windows)
        .fold(0, usize::saturating_add);
    if recorded != first_info.run_windows || held != first_info.run_windows {
        bail!(
            "{}: the run has {} windows ({recorded} over its streams) but its shards hold {held}",
            first.path.display(),
            first_info.run_windows
        );
    }
    for x in run_streams {
        let most = protocol.most_tokens(x.windows);
        if x.windows == 0 || x.input_tokens > most {
            bail!(
                "{}: stream `{}` records {} tokens in {} windows, which context {} stride {} cannot give",
                first.path.display(),
                x.id,
                x.input_tokens,
                x.windows,
                protocol.context,
                protocol.stride
            );
        }
    }
    let per_stream =
        run_windows(run_streams, protocol).map_err(|e| anyhow!("{}: {e}", first.path.display()))?;
    // Every shard must hold exactly the windows the plan gives it.
    for &(l, s) in &shards {
        let shown = l.path.display();
        let (mine, ranges) = plan(&per_stream, s.shard()).map_err(|e| anyhow!("{shown}: {e}"))?;
        if s.windows != [mine.start, mine.end] {
            bail!(
                "{shown}: shard {}/{n} should hold windows {}..{} of the run but records {}..{}",
                s.index,
                mine.start,
                mine.end,
                s.windows[0],
                s.windows[1]
            );
        }
        let expected: Vec<(usize, std::ops::Range<usize>)> = ranges
            .into_iter()
            .enumerate()
            .filter(|(_, r)| !r.is_empty())
            .collect();
        let held: Vec<&str> = l.report.streams.iter().map(|x| x.id.as_str()).collect();
        let planned: Vec<&str> = expected
            .iter()
            .map(|(i, _)| run_streams[*i].id.as_str())
            .collect();
        if held != planned {
            bail!(
                "{shown}: shard {}/{n} should hold streams [{}] but holds [{}]",
                s.index,
                planned.join(", "),
                held.join(", ")
            );
        }
        for ((si, r), rep) in expected.iter().zip(&l.report.streams) {
            let plan_ws = &per_stream[*si][r.clone()];
            let same = rep.windows.len() == plan_ws.len()
                && rep.windows.iter().zip(plan_ws).all(|(a, b)| {
                    a.begin == b.begin
                        && a.first_target == b.first_target
                        && a.end == b.end
                        && a.scored == b.scored() as u64
                });
            if !same {
                bail!(
                    "{shown}: stream `{}` does not hold the windows shard {}/{n} should score ({} windows from {})",
                    rep.id,
                    s.index,
                    plan_ws.len(),
                    r.start
                );
            }
        }
    }

    // Stream by stream, the shards' windows in run order.
    let mut streams = Vec::with_capacity(run_streams.len());
    for rs in run_streams {
        let parts: Vec<(&Loaded, &StreamReport)> = shards
            .iter()
            .flat_map(|(l, _)| l.report.streams.iter().map(move |x| (*l, x)))
            .filter(|(_, x)| x.id == rs.id)
            .collect();
        let Some(&(l0, head)) = parts.first() else {
            bail!("merge: no shard holds stream `{}`", rs.id);
        };
        for (l, x) in &parts[1..] {
            if (x.path.as_str(), x.tokens, x.input_tokens, x.totals.bytes)
                != (
                    head.path.as_str(),
                    head.tokens,
                    head.input_tokens,
                    head.totals.bytes,
                )
            {
                bail!(
                    "{} and {}: stream `{}` is described differently (path, tokens or bytes)",
                    l0.path.display(),
                    l.path.display(),
                    rs.id
                );
            }
        }
        let mut sum = NllSum::default();
        let mut calibration = Some(Calibration::default());
        let mut windows = Vec::new();
        let (mut seconds, mut processed) = (0.0, 0usize);
        let mut scored_total = 0u64;
        for (l, x) in &parts {
            let overflow = || {
                anyhow::anyhow!(
                    "{}: stream `{}`: the merged counts overflow",
                    l.path.display(),
                    rs.id
                )
            };
            seconds += x.seconds;
            processed = processed
                .checked_add(x.processed_tokens)
                .ok_or_else(overflow)?;
            for w in &x.windows {
                scored_total = scored_total.checked_add(w.scored).ok_or_else(overflow)?;
                sum.add(&NllSum {
                    scored: w.scored,
                    nll_sum: w.nll_sum,
                    nll_sq_sum: w.nll_sq_sum,
                });
                match (&w.calibration, calibration.as_mut()) {
                    (Some(c), Some(all)) => all.add(c),
                    _ => calibration = None,
                }
                let mut w = w.clone();
                w.calibration = None;
                windows.push(w);
            }
        }
        if !(sum.nll_sum.is_finite() && sum.nll_sq_sum.is_finite()) {
            bail!("merge: stream `{}`: the merged NLL sums overflow", rs.id);
        }
        streams.push(StreamReport {
            id: head.id.clone(),
            domain: head.domain.clone(),
            path: head.path.clone(),
            sha256: head.sha256.clone(),
            tokens: head.tokens,
            input_tokens: head.input_tokens,
            unscored_tokens: head.input_tokens.saturating_sub(sum.scored as usize),
            processed_tokens: processed,
            totals: Totals::new(&sum, head.totals.bytes),
            seconds,
            processed_tokens_per_s: processed as f64 / seconds.max(1e-9),
            calibration: calibration.as_ref().and_then(CalibrationReport::new),
            reference: None,
            reference_acc: None,
            // Integer counts: the shards' sums add up to the unsharded run's.
            routing: parts
                .iter()
                .map(|(_, x)| x.routing.as_ref().map(|r| &r.tokens_per_expert))
                .collect::<Option<Vec<_>>>()
                .and_then(|all| {
                    let mut sum = vec![0u64; all[0].len()];
                    for v in &all {
                        if v.len() != sum.len() {
                            return None;
                        }
                        for (s, x) in sum.iter_mut().zip(v.iter()) {
                            // Counts past u64 are no routing anyone ran: none reported.
                            *s = s.checked_add(*x)?;
                        }
                    }
                    crate::report::RoutingReport::new(&sum)
                }),
            windows,
        });
    }
    let domains = first_info
        .run_domains
        .iter()
        .map(|d| {
            let mut a = aggregate(&d.id, &d.title, streams.iter().filter(|s| s.domain == d.id));
            a.domain = Some(d.id.clone());
            a
        })
        .collect();
    let overall = aggregate("overall", "overall", streams.iter());

    let reports: Vec<&Report> = shards.iter().map(|(l, _)| &l.report).collect();
    let mut devices: Vec<String> = Vec::new();
    let mut warnings: Vec<String> = Vec::new();
    for r in &reports {
        if !devices.contains(&r.settings.device) {
            devices.push(r.settings.device.clone());
        }
        for w in &r.warnings {
            if !warnings.contains(w) {
                warnings.push(w.clone());
            }
        }
    }
    let score_s: f64 = reports.iter().map(|r| r.timings.score_s).sum();
    let load_s = reports.iter().map(|r| r.timings.load_s).fold(0.0, f64::max);
    let tokenize_s = reports
        .iter()
        .map(|r| r.timings.tokenize_s)
        .fold(0.0, f64::max);
    let total_s: f64 = reports.iter().map(|r| r.timings.total_s).sum();
    let processed = first_info.run_processed_tokens;
    let mut settings = first.report.settings.clone();
    settings.device = devices.join(", ");
    let rep0 = &first.report;
    Ok(Report {
        schema: rep0.schema.clone(),
        schema_version: rep0.schema_version,
        metric: rep0.metric.clone(),
        execution: rep0.execution.clone(),
        timing: crate::report::Timing {
            load_seconds: load_s,
            read_and_tokenize_seconds: tokenize_s,
            score_seconds: score_s,
            total_seconds: total_s,
            scored_tokens_per_second: overall.totals.scored as f64 / score_s.max(1e-9),
        },
        run_id: format!("{}-merged-{n}", rep0.run_id),
        tool: rep0.tool.clone(),
        invocation: None,
        started_unix_s: reports
            .iter()
            .map(|r| r.started_unix_s)
            .fold(f64::INFINITY, f64::min),
        settings,
        artifact: rep0.artifact.clone(),
        tokenizer: rep0.tokenizer.clone(),
        corpus: rep0.corpus.clone().map(|mut c| {
            c.stream_count = streams.len();
            c
        }),
        throughput: crate::report::Throughput {
            processed_tokens: processed,
            processed_tokens_per_s: processed as f64 / score_s.max(1e-9),
            scored_tokens_per_s: overall.totals.scored as f64 / score_s.max(1e-9),
        },
        streams,
        domains,
        overall,
        timings: crate::report::Timings {
            load_s,
            tokenize_s,
            score_s,
            total_s,
        },
        peak_rss_bytes: reports.iter().filter_map(|r| r.peak_rss_bytes).max(),
        warnings,
        cuda_memory: None,
        cuda_versions: None,
        cpu_memory: None,
        shard: None,
        merged_from: Some(
            shards
                .iter()
                .map(|(l, s)| MergedShard {
                    index: s.index,
                    run_id: l.report.run_id.clone(),
                    report: l.path.display().to_string(),
                    device: l.report.settings.device.clone(),
                    threads: l.report.settings.threads,
                    processed_tokens: s.processed_tokens,
                    score_s: l.report.timings.score_s,
                })
                .collect(),
        ),
    })
}
