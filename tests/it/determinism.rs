//! The CPU path is bit-identical run to run and for any thread count. With 2 and 3 threads
//! the engine also scores 2 and 3 windows at once (`score_cpu` in src/engine.rs), so this
//! covers window-level concurrency as well as the kernels' own splits; with 16 threads every
//! window of the stream is in flight at once and the threads left over steal the windows'
//! column blocks and attention tasks (more threads than this machine has cores: the bits
//! must not care). The hybrid (qwen3_5) model is held to the same.

use crate::common;

use ninfer_perplexity::engine::{Engine, LoadOptions};
use ninfer_perplexity::kv::KvDtype;
use ninfer_perplexity::score::{Protocol, StreamScore};

fn score(threads: usize, kv: KvDtype, tokens: &[u32]) -> StreamScore {
    score_with(threads, kv, tokens, Protocol::new(96, 40).unwrap())
}

fn score_with(threads: usize, kv: KvDtype, tokens: &[u32], protocol: Protocol) -> StreamScore {
    score_model("smollm2-135m-bf16.ninfer", threads, kv, tokens, protocol)
}

fn score_model(
    artifact: &str,
    threads: usize,
    kv: KvDtype,
    tokens: &[u32],
    protocol: Protocol,
) -> StreamScore {
    let e = Engine::load(
        &common::artifact(artifact),
        &LoadOptions {
            threads,
            ..Default::default()
        },
        &mut |_, _| {},
    )
    .unwrap();
    e.score(tokens, protocol, kv, true, &mut |_, _| {}).unwrap()
}

fn bits(s: &StreamScore) -> Vec<u64> {
    let mut v = vec![s.totals.nll_sum.to_bits(), s.totals.nll_sq_sum.to_bits()];
    for w in &s.windows {
        v.push(w.nll_sum.to_bits());
        v.extend(
            w.logprobs
                .as_ref()
                .unwrap()
                .iter()
                .map(|x| x.to_bits() as u64),
        );
    }
    v
}

fn tokens(bytes: usize, take: usize) -> Vec<u32> {
    let text =
        std::fs::read_to_string(common::repo().join("eval/fixtures/tiny_qwen3_logprobs.json"))
            .unwrap();
    let e = Engine::load(
        &common::artifact("smollm2-135m-bf16.ninfer"),
        &LoadOptions::default(),
        &mut |_, _| {},
    )
    .unwrap();
    let tokens: Vec<u32> = e
        .tokenizer
        .encode(&text[..bytes])
        .unwrap()
        .into_iter()
        .take(take)
        .collect();
    assert_eq!(tokens.len(), take, "fixture text too short");
    tokens
}

#[test(prepared)]
fn identical_bits_for_1_2_3_and_16_threads_and_repeated_runs() {
    let tokens = tokens(4000, 300);
    for kv in [KvDtype::Bf16, KvDtype::Nvfp4] {
        let one = score(1, kv, &tokens);
        assert!(one.windows.len() >= 5, "needs several windows");
        let reference = bits(&one);
        for threads in [2, 3, 16] {
            assert_eq!(
                bits(&score(threads, kv, &tokens)),
                reference,
                "{} with {threads} threads",
                kv.name()
            );
        }
        assert_eq!(
            bits(&score(2, kv, &tokens)),
            reference,
            "{}: second run",
            kv.name()
        );
    }
}

#[test(prepared)]
fn windows_split_between_threads_give_the_same_bits() {
    // Windows of 512 tokens are long enough to be split between two threads (rows of the
    // window's later layers on a second thread, `Split` in src/model/forward.rs). A stream
    // of one window with 2 or 3 threads is split before layer 0 every time; in a stream of
    // five windows the last ones split whenever a thread runs out of windows, at whatever
    // layer that happens. The bits must match one thread, which never splits.
    let tokens = tokens(20_000, 1300);
    let protocol = Protocol::new(512, 256).unwrap();
    for stream in [&tokens[..512], &tokens[..]] {
        let one = score_with(1, KvDtype::Int8, stream, protocol);
        let reference = bits(&one);
        for threads in [2, 3] {
            assert_eq!(
                bits(&score_with(threads, KvDtype::Int8, stream, protocol)),
                reference,
                "{} tokens, {threads} threads",
                stream.len()
            );
        }
    }
}

#[test(prepared)]
fn a_hybrid_model_gives_identical_bits_for_any_thread_count() {
    // Gated DeltaNet value heads run as parallel tasks, windows in flight together; windows
    // of 160 tokens cross the chunked rule's 64-token chunks.
    let tokens: Vec<u32> = tokens(20_000, 900).iter().map(|t| t % 150_000).collect();
    let protocol = Protocol::new(160, 80).unwrap();
    for kv in [KvDtype::F32, KvDtype::K8v4] {
        let one = score_model("tiny-qwen3_5-f32.ninfer", 1, kv, &tokens, protocol);
        let reference = bits(&one);
        for threads in [2, 3, 16] {
            let s = score_model("tiny-qwen3_5-f32.ninfer", threads, kv, &tokens, protocol);
            assert_eq!(bits(&s), reference, "{} with {threads} threads", kv.name());
        }
    }
}
