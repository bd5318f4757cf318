//! The rows of one forward pass: one plan for both backends.
//!
//! A pass runs one window (the CPU) or several windows packed row after row (CUDA). Every
//! window starts from empty State and Main KV; its rows are its tokens at positions
//! `0..len`; the rows that predict a target are its rows `first_target - 1 .. len - 1`, the
//! target of row `i` being token `i + 1`. After the last layer only those rows are read, so
//! the last layer's output projection and MLP need only the rows from the first that
//! predicts a target to the window's end ([`PassPlan::last_layer`]; every row still gives
//! its key and value, or its State update, in every layer). Both backends take that policy
//! from here, so they agree on it or differ visibly.

use crate::model::ForwardError;

/// One window's rows in a pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowRows {
    /// Its first row in the pass.
    pub row0: usize,
    /// Its tokens.
    pub len: usize,
    /// Its first target (`>= 1`): row `first_target - 1` is the first that predicts one.
    pub first_target: usize,
}

impl WindowRows {
    /// Its rows (in the pass) that the last layer must produce.
    pub fn last_layer(&self) -> std::ops::Range<usize> {
        self.row0 + self.first_target - 1..self.row0 + self.len
    }

    /// Its rows (in the pass) that predict a target.
    pub fn scored(&self) -> std::ops::Range<usize> {
        self.row0 + self.first_target - 1..self.row0 + self.len - 1
    }
}

/// The rows of a pass over windows `(tokens, first_target)`, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PassPlan {
    pub windows: Vec<WindowRows>,
    /// `[rows]`: each row's token, its position in its window, its window.
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    pub window_of: Vec<u32>,
    /// The rows that predict a target, in window order, and each one's target.
    pub scored: Vec<u32>,
    pub targets: Vec<u32>,
    /// The rows the last layer must produce ([`WindowRows::last_layer`] of every window).
    pub last_layer: Vec<u32>,
    /// Where each scored row is among [`PassPlan::last_layer`]'s rows.
    pub scored_in_last_layer: Vec<u32>,
}

impl PassPlan {
    /// Plans a pass over `windows`, each `(tokens, first_target)` with
    /// `1 <= first_target <= tokens.len()`. A token outside the vocabulary fails the window
    /// that holds it, naming the first such position: `(window, error)`.
    pub fn new(
        windows: &[(&[u32], usize)],
        vocab: usize,
    ) -> Result<PassPlan, (usize, ForwardError)> {
        let rows: usize = windows.iter().map(|w| w.0.len()).sum();
        let scored: usize = windows.iter().map(|w| w.0.len() - w.1).sum();
        let mut p = PassPlan {
            windows: Vec::with_capacity(windows.len()),
            tokens: Vec::with_capacity(rows),
            positions: Vec::with_capacity(rows),
            window_of: Vec::with_capacity(rows),
            scored: Vec::with_capacity(scored),
            targets: Vec::with_capacity(scored),
            last_layer: Vec::with_capacity(scored + windows.len()),
            scored_in_last_layer: Vec::with_capacity(scored),
        };
        for (wi, &(tokens, first_target)) in windows.iter().enumerate() {
            assert!(
                first_target >= 1 && first_target <= tokens.len(),
                "first_target out of range"
            );
            if let Some((pos, &id)) = tokens
                .iter()
                .enumerate()
                .find(|(_, &id)| id as usize >= vocab)
            {
                return Err((wi, ForwardError::TokenOutOfRange { id, pos, vocab }));
            }
            let w = WindowRows {
                row0: p.tokens.len(),
                len: tokens.len(),
                first_target,
            };
            p.tokens.extend_from_slice(tokens);
            p.positions.extend(0..tokens.len() as u32);
            p.window_of
                .extend(std::iter::repeat_n(wi as u32, tokens.len()));
            for r in w.scored() {
                p.scored_in_last_layer
                    .push(p.last_layer.len() as u32 + (r - w.scored().start) as u32);
                p.scored.push(r as u32);
                p.targets.push(p.tokens[r + 1]);
            }
            p.last_layer.extend(w.last_layer().map(|r| r as u32));
            p.windows.push(w);
        }
        Ok(p)
    }

    /// Packed rows.
    pub fn rows(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the last layer may skip rows (some window's first target is past its row 1).
    pub fn trims_last_layer(&self) -> bool {
        self.last_layer.len() < self.rows()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_positions_targets_and_the_last_layer_of_packed_windows() {
        let (a, b) = ([5u32, 6, 7, 8], [9u32, 10, 11]);
        let p = PassPlan::new(&[(&a, 1), (&b, 2)], 12).unwrap();
        assert_eq!(p.rows(), 7);
        assert_eq!(p.tokens, [5, 6, 7, 8, 9, 10, 11]);
        assert_eq!(p.positions, [0, 1, 2, 3, 0, 1, 2]);
        assert_eq!(p.window_of, [0, 0, 0, 0, 1, 1, 1]);
        // Window 0 scores its tokens 1..4 from rows 0..3, window 1 its token 2 from row 5.
        assert_eq!(p.scored, [0, 1, 2, 5]);
        assert_eq!(p.targets, [6, 7, 8, 11]);
        assert_eq!(p.last_layer, [0, 1, 2, 3, 5, 6]);
        for (&r, &i) in p.scored.iter().zip(&p.scored_in_last_layer) {
            assert_eq!(p.last_layer[i as usize], r);
        }
        assert!(p.trims_last_layer());
        let whole = PassPlan::new(&[(&a, 1)], 12).unwrap();
        assert!(!whole.trims_last_layer());
    }

    #[test]
    fn a_token_outside_the_vocabulary_fails_its_window_at_its_first_position() {
        let (a, b) = ([1u32, 2, 3], [4u32, 12, 13, 1]);
        assert_eq!(
            PassPlan::new(&[(&a, 1), (&b, 1)], 12),
            Err((
                1,
                ForwardError::TokenOutOfRange {
                    id: 12,
                    pos: 1,
                    vocab: 12
                }
            ))
        );
    }
}
