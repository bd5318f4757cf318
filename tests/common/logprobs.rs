//! Per-token log-probabilities of the engine against a committed transformers fixture.

use ninfer_perplexity::engine::Engine;
use ninfer_perplexity::kv::KvDtype;
use ninfer_perplexity::score::Protocol;
use serde_json::Value;

/// Largest differences between the engine and a fixture.
#[derive(Debug, Default)]
pub struct Diff {
    pub max_abs_logprob: f64,
    pub max_rel_mean_nll: f64,
    pub tokens: usize,
}

pub fn compare(engine: &Engine, fixture: &Value) -> Diff {
    let mut d = Diff::default();
    for case in fixture["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let text = case["text"].as_str().unwrap();
        let want_ids: Vec<u32> = case["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let ids = engine.tokenizer.encode(text).unwrap();
        assert_eq!(
            ids, want_ids,
            "{name}: token ids differ from the reference tokenizer"
        );
        let p = Protocol::new(
            case["context"].as_u64().unwrap() as usize,
            case["stride"].as_u64().unwrap() as usize,
        )
        .unwrap();
        let s = engine
            .score(&ids, p, KvDtype::F32, true, &mut |_, _| {})
            .unwrap();
        let wins = case["windows"].as_array().unwrap();
        assert_eq!(s.windows.len(), wins.len(), "{name}: window count");
        for (w, fw) in s.windows.iter().zip(wins) {
            assert_eq!(
                (w.begin, w.first_target, w.end),
                (
                    fw["begin"].as_u64().unwrap() as usize,
                    fw["start"].as_u64().unwrap() as usize,
                    fw["end"].as_u64().unwrap() as usize
                ),
                "{name}: window bounds"
            );
            let lps = w.logprobs.as_ref().unwrap();
            let flps = fw["logprobs"].as_array().unwrap();
            assert_eq!(lps.len(), flps.len());
            for (a, b) in lps.iter().zip(flps) {
                let diff = (*a as f64 - b.as_f64().unwrap()).abs();
                d.max_abs_logprob = d.max_abs_logprob.max(diff);
                d.tokens += 1;
            }
        }
        assert_eq!(
            s.totals.scored,
            case["scored"].as_u64().unwrap(),
            "{name}: scored tokens"
        );
        let want = case["mean_nll"].as_f64().unwrap();
        let rel = (s.totals.mean_nll() - want).abs() / want.abs();
        d.max_rel_mean_nll = d.max_rel_mean_nll.max(rel);
        eprintln!(
            "{name}: mean_nll {:.8} ref {:.8} rel {:.2e}",
            s.totals.mean_nll(),
            want,
            rel
        );
    }
    d
}
