//! How both binaries open a file they read (artifacts, manifests, streams, reports, the
//! registry, and every packer input): regular files only, every read bounded.
//!
//! A FIFO would block an ordinary open until a writer appears, `/dev/zero` would be read
//! until memory runs out, a directory cannot be read. So a file is opened non-blocking (an
//! open that cannot hang), its type is checked on the opened descriptor (no race between
//! looking and opening), and a whole-file read stops one byte past its cap.

use anyhow::{anyhow, bail, Result};
use std::fs::File;
use std::io::Read;
use std::path::Path;

/// Opens `path` for reading if it is a regular file; returns it and its size. `what` names
/// the role in errors ("the registry", "config.json"); the caller adds the path.
pub fn open_regular(path: &Path, what: &str) -> Result<(File, u64)> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        // Non-blocking, so that opening a FIFO returns at once; it changes nothing for the
        // regular files that pass the check below.
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| anyhow!("cannot read {what}: {e}"))?;
    let m = f
        .metadata()
        .map_err(|e| anyhow!("cannot read {what}: {e}"))?;
    let t = m.file_type();
    if t.is_dir() {
        bail!("{what} is a directory, not a file");
    }
    if !t.is_file() {
        bail!("{what} is not a regular file (a pipe, device or socket); give a file");
    }
    Ok((f, m.len()))
}

/// [`open_regular`]'s check alone: the size of the regular file at `path`.
pub fn require_regular_file(path: &Path, what: &str) -> Result<u64> {
    open_regular(path, what).map(|(_, size)| size)
}

/// Reads a regular file of at most `limit` bytes; a longer one is an error, found after
/// reading `limit + 1` bytes at most (a file that grows while it is read cannot make this
/// read without bound).
pub fn read_bounded(path: &Path, what: &str, limit: u64) -> Result<Vec<u8>> {
    let (f, size) = open_regular(path, what)?;
    if size > limit {
        bail!("{what} is {size} bytes, more than the {limit} this reads");
    }
    let mut bytes = Vec::with_capacity(size as usize);
    f.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| anyhow!("cannot read {what}: {e}"))?;
    if bytes.len() as u64 > limit {
        bail!("{what} grew past {limit} bytes while it was read");
    }
    Ok(bytes)
}

/// [`read_bounded`] as UTF-8 text.
pub fn read_text_bounded(path: &Path, what: &str, limit: u64) -> Result<String> {
    String::from_utf8(read_bounded(path, what, limit)?)
        .map_err(|e| anyhow!("{what} is not UTF-8: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_regular_files_are_opened_and_reads_stop_at_the_cap() {
        let d = tempfile::tempdir().unwrap();
        let fifo = d.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo reads the NUL-terminated path it is given.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = read_bounded(&fifo, "x", 10).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        let e = read_bounded(Path::new("/dev/zero"), "x", 10)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a regular file"), "{e}");
        let e = read_bounded(d.path(), "x", 10).unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
        let f = d.path().join("f");
        std::fs::write(&f, b"0123456789a").unwrap();
        let e = read_bounded(&f, "x", 10).unwrap_err().to_string();
        assert!(e.contains("11 bytes, more than the 10"), "{e}");
        assert_eq!(read_bounded(&f, "x", 11).unwrap(), b"0123456789a");
    }
}
