//! Writes a `.ninfer` file whose tensors are made one at a time, so that writing a model needs
//! memory for a tensor, not for the model. Both packers use it: `ninfer-pack hf|gguf`
//! ([`super::writer`]) and `ninfer-pack random` ([`crate::pack::random`]).
//!
//! Safetensors puts the header (with every tensor's offsets) first, and the header holds the
//! digest of all tensors. So the layout (names, dtypes, shapes) is fixed before any bytes are
//! made; the header is written with a placeholder digest of the final length; each tensor is
//! made, hashed and written in name order (the digest's order); then the header is rewritten
//! with the real digest. The file goes to a temporary sibling, renamed into place only when
//! complete: an error leaves nothing behind.

use super::digest::DigestBuilder;
use anyhow::{bail, Context, Result};
use safetensors::tensor::Dtype;
use std::collections::BTreeMap;
use std::io::{Seek, SeekFrom, Write};
use std::path::Path;

/// One stored tensor: name, dtype, shape.
pub type Entry = (String, Dtype, Vec<usize>);

/// A dtype as the safetensors header and the digest spell it ("F32", "BF16", "F8_E4M3", ...).
pub fn dtype_name(d: Dtype) -> String {
    format!("{d:?}")
}

fn header(meta: &BTreeMap<String, String>, entries: &[(&Entry, usize, usize)]) -> Result<Vec<u8>> {
    let mut h = serde_json::Map::new();
    h.insert("__metadata__".into(), serde_json::to_value(meta)?);
    for ((name, dtype, shape), a, b) in entries {
        h.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype_name(*dtype), "shape": shape, "data_offsets": [a, b]}),
        );
    }
    let mut bytes = serde_json::to_vec(&serde_json::Value::Object(h))?;
    while !bytes.len().is_multiple_of(8) {
        bytes.push(b' ');
    }
    Ok(bytes)
}

/// Writes `layout` (sorted by name, no name twice) to `out`; `make(entry)` returns each
/// tensor's bytes, called once per entry in order. `meta` must not hold `digest`: it is
/// added. Returns the digest. `progress(done, total)` counts tensors.
pub fn write(
    mut meta: BTreeMap<String, String>,
    layout: &[Entry],
    out: &Path,
    make: &mut dyn FnMut(&Entry) -> Result<Vec<u8>>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<String> {
    if layout.windows(2).any(|w| w[0].0 >= w[1].0) {
        bail!("internal: the artifact layout is not sorted by name");
    }
    crate::outfile::refuse_special(out)?;
    let mut digest = DigestBuilder::new();
    for (k, v) in &meta {
        digest.metadata(k, v);
    }
    let mut entries = Vec::with_capacity(layout.len());
    let mut off = 0usize;
    for e in layout {
        let n = e.2.iter().product::<usize>() * e.1.bitsize() / 8;
        entries.push((e, off, off + n));
        off += n;
    }
    meta.insert("digest".into(), format!("sha256:{}", "0".repeat(64)));
    let placeholder = header(&meta, &entries)?;

    let dir = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)
        .with_context(|| format!("{}: cannot create directory", dir.display()))?;
    let mut tmp = tempfile::NamedTempFile::new_in(dir)
        .with_context(|| format!("{}: cannot write", dir.display()))?;
    let failed = |e: std::io::Error| anyhow::anyhow!("{}: cannot write: {e}", out.display());
    {
        let f = tmp.as_file_mut();
        let mut w = std::io::BufWriter::with_capacity(8 << 20, &mut *f);
        w.write_all(&(placeholder.len() as u64).to_le_bytes())
            .map_err(failed)?;
        w.write_all(&placeholder).map_err(failed)?;
        let total = entries.len();
        for (i, &(e, a, b)) in entries.iter().enumerate() {
            let bytes = make(e)?;
            if bytes.len() != b - a {
                bail!(
                    "internal: tensor `{}` has {} bytes, its header entry {}",
                    e.0,
                    bytes.len(),
                    b - a
                );
            }
            digest.tensor(&e.0, &dtype_name(e.1), &e.2, &bytes);
            w.write_all(&bytes).map_err(failed)?;
            progress(i + 1, total);
        }
        w.flush().map_err(failed)?;
    }
    let d = digest.finish();
    meta.insert("digest".into(), d.clone());
    let real = header(&meta, &entries)?;
    if real.len() != placeholder.len() {
        bail!("internal: header length changed when the digest was filled in");
    }
    let f = tmp.as_file_mut();
    f.seek(SeekFrom::Start(8)).map_err(failed)?;
    f.write_all(&real).map_err(failed)?;
    f.sync_all().ok();
    tmp.persist(out)
        .map_err(|e| anyhow::anyhow!("{}: cannot write: {}", out.display(), e.error))?;
    crate::outfile::set_default_mode(out)?;
    Ok(d)
}
