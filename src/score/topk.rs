//! Bounded references: how much of the full-vocabulary KL divergence a top-K record of the
//! reference's distribution keeps.
//!
//! A saved reference here holds exact final hidden states (`score::saved`), so a later run
//! recomputes the reference's whole distribution. Peers store a bounded record instead: the
//! K most likely tokens with their log-probabilities, the rest either lumped into one tail
//! bucket or dropped. These functions compute what such a record gives, from full
//! distributions, so the loss can be measured (`benches/kld_topk.rs`) rather than assumed:
//!
//! - [`kl_top_k_tail`]: the reference kept as its top K plus one bucket for the rest mass,
//!   the run (computed live, full vocabulary) grouped the same way. This is the KL of the
//!   two distributions coarsened to K + 1 outcomes, so it never exceeds the exact KL (data
//!   processing), and equals it when K covers the vocabulary.
//! - [`kl_top_k_union`]: the seed engine's `NINFTOPK` comparison of two top-K records: both
//!   distributions restricted to the union of their top-K sets and the target, each
//!   renormalized over it. Here each side's value on every id of the union is its true one
//!   (a record holds only its own K, so this is the most that scheme can give).
//!
//! Log-probabilities are natural-log, per position, over the whole vocabulary, in f64.

/// The `k` most likely ids of `logprobs` with their log-probabilities, most likely first
/// (the lowest id first among equals).
pub fn top_k(logprobs: &[f64], k: usize) -> Vec<(u32, f64)> {
    let k = k.min(logprobs.len());
    let mut ids: Vec<u32> = (0..logprobs.len() as u32).collect();
    let by = |a: &u32, b: &u32| {
        logprobs[*b as usize]
            .total_cmp(&logprobs[*a as usize])
            .then(a.cmp(b))
    };
    if k < ids.len() && k > 0 {
        ids.select_nth_unstable_by(k - 1, by);
    }
    ids.truncate(k);
    ids.sort_unstable_by(by);
    ids.into_iter().map(|i| (i, logprobs[i as usize])).collect()
}

/// KL(reference ‖ run) over the exact distributions.
pub fn kl_exact(reference: &[f64], run: &[f64]) -> f64 {
    reference
        .iter()
        .zip(run)
        .map(|(&p, &q)| p.exp() * (p - q))
        .sum()
}

/// KL(reference ‖ run) with the reference's top `k` tokens kept and everything else one
/// bucket, on both sides.
pub fn kl_top_k_tail(reference_top: &[(u32, f64)], run: &[f64]) -> f64 {
    let mut kl = 0.0;
    let (mut p_kept, mut q_kept) = (0.0f64, 0.0f64);
    for &(id, p) in reference_top {
        let q = run[id as usize];
        kl += p.exp() * (p - q);
        p_kept += p.exp();
        q_kept += q.exp();
    }
    let p_tail = (1.0 - p_kept).max(0.0);
    if p_tail > 0.0 {
        let q_tail = (1.0 - q_kept).max(f64::MIN_POSITIVE);
        kl += p_tail * (p_tail.ln() - q_tail.ln());
    }
    kl
}

/// KL(reference ‖ run) over the union of both top-K sets (`reference_top`, `run_top`, from
/// [`top_k`]) and `target`, each side renormalized over that union (the `NINFTOPK`
/// comparison).
pub fn kl_top_k_union(
    reference: &[f64],
    run: &[f64],
    reference_top: &[(u32, f64)],
    run_top: &[(u32, f64)],
    target: u32,
) -> f64 {
    let mut ids: Vec<u32> = reference_top
        .iter()
        .chain(run_top)
        .map(|&(i, _)| i)
        .chain(std::iter::once(target))
        .collect();
    ids.sort_unstable();
    ids.dedup();
    let lse = |lp: &[f64]| {
        let m = ids
            .iter()
            .map(|&i| lp[i as usize])
            .fold(f64::NEG_INFINITY, f64::max);
        m + ids
            .iter()
            .map(|&i| (lp[i as usize] - m).exp())
            .sum::<f64>()
            .ln()
    };
    let (zp, zq) = (lse(reference), lse(run));
    ids.iter()
        .map(|&i| {
            let (p, q) = (reference[i as usize] - zp, run[i as usize] - zq);
            p.exp() * (p - q)
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log_softmax(l: &[f64]) -> Vec<f64> {
        let m = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z = m + l.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
        l.iter().map(|x| x - z).collect()
    }

    fn pair(n: usize, salt: u64) -> (Vec<f64>, Vec<f64>) {
        let mut s = salt;
        let mut next = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        };
        let a: Vec<f64> = (0..n).map(|i| 3.0 * next() - (i % 7) as f64).collect();
        let b: Vec<f64> = a.iter().map(|x| x + 0.3 * next()).collect();
        (log_softmax(&a), log_softmax(&b))
    }

    #[test]
    fn top_k_is_the_k_largest_in_order_lowest_id_first_on_ties() {
        let lp = [-3.0, -1.0, -2.0, -1.0, -5.0];
        assert_eq!(top_k(&lp, 3), vec![(1, -1.0), (3, -1.0), (2, -2.0)]);
        assert_eq!(top_k(&lp, 9).len(), 5);
        assert!(top_k(&lp, 0).is_empty());
    }

    #[test]
    fn the_tail_bucket_bounds_the_exact_kl_from_below_and_meets_it_at_full_k() {
        let (p, q) = pair(500, 7);
        let exact = kl_exact(&p, &q);
        assert!(exact > 1e-3);
        let mut last = 0.0;
        for k in [1, 4, 16, 64, 256, 499] {
            let kl = kl_top_k_tail(&top_k(&p, k), &q);
            assert!(kl <= exact + 1e-12, "k {k}: {kl} > {exact}");
            assert!(kl >= last - 1e-12, "k {k}: the bound tightens with k");
            last = kl;
        }
        let full = kl_top_k_tail(&top_k(&p, 500), &q);
        assert!((full - exact).abs() < 1e-12, "{full} vs {exact}");
        // Equal distributions: 0 at every k.
        assert!(kl_top_k_tail(&top_k(&p, 8), &p).abs() < 1e-15);
    }

    #[test]
    fn the_union_form_is_exact_over_the_whole_vocabulary_and_zero_for_equal_sides() {
        let (p, q) = pair(300, 11);
        let exact = kl_exact(&p, &q);
        let union = |k| kl_top_k_union(&p, &q, &top_k(&p, k), &top_k(&q, k), 7);
        assert!((union(300) - exact).abs() < 1e-12);
        assert!(union(5) > 0.0);
        assert!(kl_top_k_union(&p, &p, &top_k(&p, 5), &top_k(&p, 5), 7).abs() < 1e-15);
    }
}
