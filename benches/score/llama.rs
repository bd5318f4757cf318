//! llama.cpp's `llama-perplexity` as the score bench's second peer: the same tokens through
//! its own chunk windows (this engine's `--window-plan kld-chunks`), processed tokens/s side
//! by side.
//!
//! llama.cpp tokenizes the text itself, and its `smollm` pre-tokenizer splits runs of
//! newlines differently from the transformers conversion this engine follows, so the text is
//! the stream with every run of whitespace made one space (on such prose the two agree token
//! for token: checked by `eval/results/llama-cpp-side-by-side.sh`; here the mean NLLs are
//! printed side by side as the check). Its time is read from its own log timestamps, from
//! "calculating perplexity" to "Final estimate": after loading and tokenizing, as this
//! engine's is.

use std::path::{Path, PathBuf};
use std::process::Command;

/// One `llama-perplexity` run.
pub struct LlamaRun {
    pub seconds: f64,
    pub mean_nll: f64,
}

/// `text` with every run of whitespace made one space.
pub fn prose(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The `llama-perplexity` binary, built on first use by `eval/peers/llama-cpp.sh`.
pub fn binary(root: &Path) -> PathBuf {
    let out = Command::new("bash")
        .arg(root.join("eval/peers/llama-cpp.sh"))
        .output()
        .expect("bash eval/peers/llama-cpp.sh");
    assert!(
        out.status.success(),
        "eval/peers/llama-cpp.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// A float32 GGUF of `gguf`'s dequantized weights (`eval/peers/gguf_to_f32.py`).
pub fn f32_gguf(root: &Path, py: &Path, gguf: &Path, dst: &Path) {
    let out = Command::new(py)
        .arg(root.join("eval/peers/gguf_to_f32.py"))
        .args([gguf, dst])
        .output()
        .expect("gguf_to_f32.py");
    assert!(
        out.status.success(),
        "gguf_to_f32.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Seconds since the start of the run from a log timestamp `M.SS.mmm.uuu`.
fn stamp(s: &str) -> Option<f64> {
    let p: Vec<f64> = s
        .split('.')
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    (p.len() == 4).then(|| p[0] * 60.0 + p[1] + p[2] / 1e3 + p[3] / 1e6)
}

/// The timestamp of the log message that begins with `marker`.
fn time_of(log: &str, marker: &str) -> Option<f64> {
    let at = log.find(marker)?;
    let before = log[..at].trim_end().strip_suffix(" I")?;
    stamp(before.rsplit(char::is_whitespace).next()?)
}

/// `llama-perplexity` on `text` with `chunks` chunks of `context` tokens, `threads`
/// threads, its default KV cache (f16).
pub fn run(
    bin: &Path,
    gguf: &Path,
    text: &Path,
    context: usize,
    chunks: usize,
    threads: usize,
) -> LlamaRun {
    let c = context.to_string();
    let out = Command::new(bin)
        .args([
            "-m".as_ref(),
            gguf.as_os_str(),
            "-f".as_ref(),
            text.as_os_str(),
        ])
        .args(["-c", &c, "-b", &c, "-t", &threads.to_string()])
        .args([
            "--chunks",
            &chunks.to_string(),
            "--log-timestamps",
            "--log-prefix",
        ])
        .output()
        .expect("llama-perplexity");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "llama-perplexity failed: {log}");
    let want = format!("calculating perplexity over {chunks} chunks");
    assert!(
        log.contains(&want),
        "llama-perplexity did not run {chunks} chunks: {log}"
    );
    let t0 = time_of(&log, "perplexity: calculating perplexity").expect("its start time");
    let t1 = time_of(&log, "Final estimate").expect("its end time");
    let ppl: f64 = log
        .split("Final estimate: PPL = ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|x| x.parse().ok())
        .expect("its final estimate");
    LlamaRun {
        seconds: t1 - t0,
        mean_nll: ppl.ln(),
    }
}
