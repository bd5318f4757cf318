//! A saved reference (`--save-reference FILE`, read back by `--kld-base FILE`): every scored
//! position's final-normed hidden state, so that a later run of the same head recomputes
//! the reference's full-vocabulary distribution exactly, without the reference model.
//!
//! Why hidden states and not top-K log-probabilities: with the head applied again, the KL
//! divergence, top-1 agreement and Δp of a later run are the very numbers an in-process
//! `--reference-kv` run computes (the same bits), where a top-K record only bounds them. The
//! price is `4 · hidden_size` bytes per position (2,304 for SmolLM2, 20,480 for a model of
//! hidden size 5120), against `8 · K + 4` for top-K; and the head must be the same tensor
//! (checked by its sha256): a KV format, a kernel, a build, another machine, or weights that
//! leave the head alone (the packer quantizes it only with `--quantize-head`).
//!
//! Layout (little-endian): the magic `NINFREF1`; then per stream, its input token ids (u32)
//! and each scored window's rows (`[rows, d]` f32) in window order; then the index, a JSON
//! document naming the artifact, head, tokenizer, corpus, protocol, KV format, device and
//! build and, per stream, the sha256 of its token ids, its windows and where their rows
//! are; then the index's length (u64) and the sha256 of everything before it (32 bytes).
//! The file is written to a temporary name and renamed when whole.

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"NINFREF1";
/// The largest index this reads (a full corpus needs well under 1 MiB).
const MAX_INDEX: u64 = 64 << 20;

/// What a saved reference is a reference of: a later run must match it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Identity {
    pub artifact_path: String,
    pub artifact_digest: String,
    pub weight_format: String,
    /// sha256 of the output head's stored tensors: the head a later run applies again.
    pub head_sha256: String,
    pub tokenizer_sha256: String,
    pub hidden_size: usize,
    pub context: usize,
    pub stride: usize,
    /// How the streams were cut into windows (`sliding` in files older than this field).
    #[serde(default)]
    pub window_plan: crate::score::WindowPlan,
    pub kv_dtype: String,
    pub device: String,
    pub build: String,
}

/// One scored window: its bounds and where its rows start in the file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SavedWindow {
    pub begin: usize,
    pub first_target: usize,
    pub end: usize,
    pub offset: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SavedStream {
    /// sha256 of the stream's input token ids (u32 little-endian): how a later run's stream
    /// is matched with it.
    pub tokens_sha256: String,
    pub input_tokens: usize,
    pub tokens_offset: u64,
    pub windows: Vec<SavedWindow>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Index {
    pub format: String,
    pub version: u32,
    pub identity: Identity,
    pub streams: Vec<SavedStream>,
}

/// sha256 of token ids as the file keys streams.
pub fn tokens_sha256(tokens: &[u32]) -> String {
    let mut h = Sha256::new();
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    hex::encode(h.finalize())
}

/// Writes a saved reference as the run goes, stream by stream and window by window.
pub struct SavedWriter {
    path: PathBuf,
    tmp: PathBuf,
    out: BufWriter<std::fs::File>,
    hash: Sha256,
    at: u64,
    index: Index,
}

impl SavedWriter {
    /// Starts `path` (through a temporary file beside it; `path` must not be a device, a
    /// pipe or a directory).
    pub fn create(path: &Path, identity: Identity) -> Result<SavedWriter> {
        crate::outfile::refuse_special(path)?;
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let tmp = dir.join(format!(
            ".{}.tmp-{}",
            path.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            std::process::id()
        ));
        let f = std::fs::File::create(&tmp)
            .map_err(|e| anyhow!("{}: cannot write the saved reference: {e}", path.display()))?;
        let mut w = SavedWriter {
            path: path.to_path_buf(),
            tmp,
            out: BufWriter::with_capacity(1 << 20, f),
            hash: Sha256::new(),
            at: 0,
            index: Index {
                format: "ninfer-perplexity saved reference".into(),
                version: 1,
                identity,
                streams: Vec::new(),
            },
        };
        w.put(MAGIC)?;
        Ok(w)
    }

    fn put(&mut self, b: &[u8]) -> Result<()> {
        self.out.write_all(b).map_err(|e| {
            anyhow!(
                "{}: cannot write the saved reference: {e}",
                self.path.display()
            )
        })?;
        self.hash.update(b);
        self.at += b.len() as u64;
        Ok(())
    }

    /// Begins a stream of these input tokens.
    pub fn begin_stream(&mut self, tokens: &[u32]) -> Result<()> {
        let tokens_offset = self.at;
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        self.put(&bytes)?;
        self.index.streams.push(SavedStream {
            tokens_sha256: tokens_sha256(tokens),
            input_tokens: tokens.len(),
            tokens_offset,
            windows: Vec::new(),
        });
        Ok(())
    }

    /// Adds the current stream's next window: its rows `[rows, d]`.
    pub fn window(&mut self, w: &crate::score::Window, rows: &[f32]) -> Result<()> {
        let d = self.index.identity.hidden_size;
        if rows.len() != (w.end - w.first_target) * d {
            bail!(
                "saved reference: window [{}, {}) gave {} values, not {} rows of {d}",
                w.begin,
                w.end,
                rows.len(),
                w.end - w.first_target
            );
        }
        let offset = self.at;
        let bytes: &[u8] = bytemuck::cast_slice(rows);
        self.put(bytes)?;
        let s = self
            .index
            .streams
            .last_mut()
            .ok_or_else(|| anyhow!("saved reference: a window before its stream"))?;
        s.windows.push(SavedWindow {
            begin: w.begin,
            first_target: w.first_target,
            end: w.end,
            offset,
        });
        Ok(())
    }

    /// Writes the index and checksum and puts the file in place; returns its size.
    pub fn finish(mut self) -> Result<u64> {
        let index = serde_json::to_vec(&self.index)?;
        self.put(&index)?;
        self.put(&(index.len() as u64).to_le_bytes())?;
        let sum = self.hash.clone().finalize();
        self.out
            .write_all(&sum)
            .and_then(|_| self.out.flush())
            .map_err(|e| {
                anyhow!(
                    "{}: cannot write the saved reference: {e}",
                    self.path.display()
                )
            })?;
        let size = self.at + 32;
        self.out.get_ref().sync_all().map_err(|e| {
            anyhow!(
                "{}: cannot write the saved reference: {e}",
                self.path.display()
            )
        })?;
        std::fs::rename(&self.tmp, &self.path).map_err(|e| {
            anyhow!(
                "{}: cannot write the saved reference: {e}",
                self.path.display()
            )
        })?;
        crate::outfile::set_default_mode(&self.path)?;
        Ok(size)
    }
}

impl Drop for SavedWriter {
    fn drop(&mut self) {
        // A run that failed leaves no partial file (after `finish` the name is gone).
        let _ = std::fs::remove_file(&self.tmp);
    }
}

/// A saved reference opened for a later run: its index checked against its checksum, its
/// rows read window by window.
pub struct SavedReference {
    pub path: PathBuf,
    pub index: Index,
    file: std::fs::File,
    size: u64,
    /// Another engine's file read as a reference (`None`: this tool's own).
    llama: Option<LlamaBase>,
}

/// A llama.cpp `--kl-divergence-base` file: its layout and its token ids.
struct LlamaBase {
    layout: super::llama_logits::Layout,
    tokens: Vec<u32>,
}

/// What a saved reference holds for a window's scored positions.
pub enum SavedRows {
    /// Final-normed hidden states `[rows, d]`, for this head to apply again.
    Hidden(Vec<f32>),
    /// Log-probabilities `[rows, vocab]` (another engine's).
    Logprobs(Vec<f32>),
}

impl SavedReference {
    pub fn open(path: &Path) -> Result<SavedReference> {
        let shown = path.display();
        let (mut f, size) = crate::input::open_regular(path, "the saved reference")
            .map_err(|e| anyhow!("{shown}: {e}"))?;
        if size < (MAGIC.len() + 8 + 32) as u64 {
            bail!("{shown}: {size} bytes, too short for a saved reference");
        }
        let mut magic = [0u8; 8];
        f.read_exact(&mut magic)
            .map_err(|e| anyhow!("{shown}: cannot read: {e}"))?;
        if &magic == super::llama_logits::MAGIC {
            return Self::open_llama(path, f, size);
        }
        if &magic != MAGIC {
            bail!("{shown}: not a saved reference (no NINFREF1 magic; write one with --save-reference)");
        }
        // The checksum covers every byte before it: read once, in blocks.
        f.seek(SeekFrom::Start(0))?;
        let mut h = Sha256::new();
        let mut left = size - 32;
        let mut buf = vec![0u8; 1 << 20];
        while left > 0 {
            let n = (left as usize).min(buf.len());
            f.read_exact(&mut buf[..n])
                .map_err(|e| anyhow!("{shown}: cannot read: {e}"))?;
            h.update(&buf[..n]);
            left -= n as u64;
        }
        let mut sum = [0u8; 32];
        f.read_exact(&mut sum)
            .map_err(|e| anyhow!("{shown}: cannot read: {e}"))?;
        if h.finalize()[..] != sum {
            bail!("{shown}: the checksum does not match: the file is damaged or incomplete");
        }
        let mut len = [0u8; 8];
        f.seek(SeekFrom::Start(size - 40))?;
        f.read_exact(&mut len)?;
        let len = u64::from_le_bytes(len);
        if len > MAX_INDEX || len > size - 40 - MAGIC.len() as u64 {
            bail!("{shown}: an index of {len} bytes does not fit the file");
        }
        let mut index = vec![0u8; len as usize];
        f.seek(SeekFrom::Start(size - 40 - len))?;
        f.read_exact(&mut index)?;
        let index: Index = serde_json::from_slice(&index)
            .map_err(|e| anyhow!("{shown}: the index is not valid: {e}"))?;
        if index.version != 1 {
            bail!(
                "{shown}: version {} is not supported (this reads 1)",
                index.version
            );
        }
        let data_end = size - 40 - len;
        let d = index.identity.hidden_size as u64;
        if d == 0 {
            bail!("{shown}: a hidden size of 0");
        }
        // Every count from the index is bounded by the file before it sizes anything.
        let in_file = |off: u64, items: u64, each: u64| {
            items
                .checked_mul(each)
                .and_then(|b| off.checked_add(b))
                .is_some_and(|e| e <= data_end)
        };
        for s in &index.streams {
            if !in_file(s.tokens_offset, s.input_tokens as u64, 4) {
                bail!("{shown}: a stream's tokens lie outside the file");
            }
            for w in &s.windows {
                let ok = w.begin < w.first_target
                    && w.first_target < w.end
                    && w.end <= s.input_tokens
                    && d.checked_mul(4)
                        .is_some_and(|row| in_file(w.offset, (w.end - w.first_target) as u64, row));
                if !ok {
                    bail!(
                        "{shown}: a window [{}, {}) does not fit its stream or the file",
                        w.begin,
                        w.end
                    );
                }
            }
        }
        Ok(SavedReference {
            path: path.to_path_buf(),
            index,
            file: f,
            size,
            llama: None,
        })
    }

    /// A llama.cpp `--kl-divergence-base` file (its magic already read).
    fn open_llama(path: &Path, mut f: std::fs::File, size: u64) -> Result<SavedReference> {
        use super::llama_logits as ll;
        let shown = path.display().to_string();
        let mut head = [0u8; 20];
        f.seek(SeekFrom::Start(0))?;
        f.read_exact(&mut head)
            .map_err(|e| anyhow!("{shown}: cannot read: {e}"))?;
        let layout = ll::layout(&shown, &head, size)?;
        let mut bytes = vec![0u8; 4 * layout.n_chunk * layout.n_ctx];
        f.read_exact(&mut bytes)
            .map_err(|e| anyhow!("{shown}: cannot read: {e}"))?;
        let tokens = ll::tokens(&shown, &bytes)?;
        let index = ll::index(path, &layout, &tokens);
        Ok(SavedReference {
            path: path.to_path_buf(),
            index,
            file: f,
            size,
            llama: Some(LlamaBase { layout, tokens }),
        })
    }

    /// Whether this is another engine's file (log-probabilities, no head to apply).
    pub fn is_foreign(&self) -> bool {
        self.llama.is_some()
    }

    /// The vocabulary of a foreign file's log-probabilities.
    pub fn foreign_vocab(&self) -> Option<usize> {
        self.llama.as_ref().map(|l| l.layout.n_vocab)
    }

    /// The saved stream whose input tokens are `tokens`.
    pub fn stream(&self, tokens: &[u32]) -> Option<&SavedStream> {
        if let Some(l) = &self.llama {
            // llama.cpp keeps the whole chunks only: the stream's tokens must begin with them.
            return (tokens.len() < l.tokens.len() + l.layout.n_ctx
                && tokens.starts_with(&l.tokens))
            .then(|| &self.index.streams[0]);
        }
        let key = tokens_sha256(tokens);
        self.index.streams.iter().find(|s| s.tokens_sha256 == key)
    }

    /// What the file holds for window `w`'s scored positions.
    pub fn window_rows(&self, w: &SavedWindow) -> Result<SavedRows> {
        use std::os::unix::fs::FileExt;
        let Some(l) = &self.llama else {
            return self.rows(w).map(SavedRows::Hidden);
        };
        let mut bytes = vec![0u8; 2 * l.layout.nv * (w.end - w.first_target)];
        self.file
            .read_exact_at(&mut bytes, w.offset)
            .with_context(|| format!("{}: cannot read", self.path.display()))?;
        super::llama_logits::dequantize(&self.path.display().to_string(), &bytes, &l.layout)
            .map(SavedRows::Logprobs)
    }

    /// The rows `[rows, d]` of window `w` of a stream.
    pub fn rows(&self, w: &SavedWindow) -> Result<Vec<f32>> {
        use std::os::unix::fs::FileExt;
        let n = (w.end - w.first_target) * self.index.identity.hidden_size;
        let mut bytes = vec![0u8; 4 * n];
        self.file
            .read_exact_at(&mut bytes, w.offset)
            .with_context(|| format!("{}: cannot read", self.path.display()))?;
        let rows: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        if let Some(i) = rows.iter().position(|x| !x.is_finite()) {
            bail!(
                "{}: a non-finite hidden-state value in window [{}, {}), row {}",
                self.path.display(),
                w.begin,
                w.end,
                i / self.index.identity.hidden_size
            );
        }
        Ok(rows)
    }

    /// A saved stream's input token ids (checked against the sha256 the index keys it by).
    pub fn tokens(&self, s: &SavedStream) -> Result<Vec<u32>> {
        use std::os::unix::fs::FileExt;
        if let Some(l) = &self.llama {
            return Ok(l.tokens.clone());
        }
        let mut bytes = vec![0u8; 4 * s.input_tokens];
        self.file
            .read_exact_at(&mut bytes, s.tokens_offset)
            .with_context(|| format!("{}: cannot read", self.path.display()))?;
        let tokens: Vec<u32> = bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        if tokens_sha256(&tokens) != s.tokens_sha256 {
            bail!(
                "{}: a stream's token ids do not match their sha256",
                self.path.display()
            );
        }
        Ok(tokens)
    }

    /// The file's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(d: usize) -> Identity {
        Identity {
            artifact_path: "a.ninfer".into(),
            artifact_digest: "sha256:0".into(),
            weight_format: "f32".into(),
            head_sha256: "0".into(),
            tokenizer_sha256: "0".into(),
            hidden_size: d,
            context: 4,
            stride: 2,
            window_plan: Default::default(),
            kv_dtype: "f32".into(),
            device: "cpu".into(),
            build: "test".into(),
        }
    }

    /// The file with its index replaced and its checksum recomputed.
    fn resealed(bytes: &[u8], edit: impl Fn(&mut Index)) -> Vec<u8> {
        let n = bytes.len();
        let len = u64::from_le_bytes(bytes[n - 40..n - 32].try_into().unwrap()) as usize;
        let mut index: Index = serde_json::from_slice(&bytes[n - 40 - len..n - 40]).unwrap();
        edit(&mut index);
        let mut out = bytes[..n - 40 - len].to_vec();
        let j = serde_json::to_vec(&index).unwrap();
        out.extend_from_slice(&j);
        out.extend_from_slice(&(j.len() as u64).to_le_bytes());
        let sum = Sha256::digest(&out);
        out.extend_from_slice(&sum);
        out
    }

    #[test]
    fn rows_round_trip_and_sizes_from_the_index_are_bounded_by_the_file() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("r.bin");
        let mut w = SavedWriter::create(&p, identity(2)).unwrap();
        let tokens = [5u32, 6, 7, 8, 9];
        w.begin_stream(&tokens).unwrap();
        let win = crate::score::Window {
            begin: 0,
            first_target: 1,
            end: 4,
        };
        let rows = [1.0f32, -2.0, 3.5, 0.25, 8.0, 9.0];
        w.window(&win, &rows).unwrap();
        let size = w.finish().unwrap();
        let r = SavedReference::open(&p).unwrap();
        assert_eq!(r.size(), size);
        let s = r.stream(&tokens).unwrap();
        assert_eq!(r.rows(&s.windows[0]).unwrap(), rows);
        assert!(r.stream(&[5, 6]).is_none());
        // A hidden size whose row bytes wrap u64 to 0 must not pass as "fits the file".
        let bytes = std::fs::read(&p).unwrap();
        for (what, edit) in [
            (
                "hidden size 2^62",
                Box::new(|i: &mut Index| i.identity.hidden_size = 1 << 62)
                    as Box<dyn Fn(&mut Index)>,
            ),
            (
                "hidden size 0",
                Box::new(|i: &mut Index| i.identity.hidden_size = 0),
            ),
            (
                "tokens past the end",
                Box::new(|i: &mut Index| i.streams[0].input_tokens = usize::MAX / 2),
            ),
            (
                "window past its stream",
                Box::new(|i: &mut Index| i.streams[0].windows[0].end = 9),
            ),
        ] {
            std::fs::write(&p, resealed(&bytes, edit)).unwrap();
            let e = SavedReference::open(&p).err().map(|e| e.to_string());
            assert!(e.is_some(), "{what}: accepted");
        }
        // A flipped byte without a new checksum.
        let mut bad = bytes.clone();
        bad[10] ^= 1;
        std::fs::write(&p, &bad).unwrap();
        let e = SavedReference::open(&p).err().unwrap().to_string();
        assert!(e.contains("checksum does not match"), "{e}");
    }
}
