//! Output files other than run reports (the packer's artifacts, `compare --json/--plot`):
//! checked before any work, written atomically, and created with ordinary modes.
//!
//! A packer run that converts for minutes must not fail only at the end because its output
//! path is unwritable, and must never replace one of its own inputs. And the temporary files
//! it renames into place are created 0600 by their library, so the finished file gets the
//! mode any other new file would have (0666 less the umask).

use anyhow::{anyhow, bail, Result};
use std::path::{Path, PathBuf};

/// Checks, before any work, that `out` can be written and is none of `inputs`: its directory
/// exists (or can be created) and takes a new file, and `out` is not a directory. Errors name
/// `out` once, with the cause.
pub fn check_output(out: &Path, inputs: &[PathBuf]) -> Result<()> {
    let shown = out.display();
    refuse_special(out)?;
    for i in inputs {
        if same_file(out, i) {
            bail!(
                "{shown}: the output is one of the inputs ({}); give another path",
                i.display()
            );
        }
    }
    let dir = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if let Some(a) = dir
        .ancestors()
        .find(|a| a.exists() && !a.as_os_str().is_empty())
    {
        if !a.is_dir() {
            bail!(
                "{shown}: cannot create its directory: {} is not a directory",
                a.display()
            );
        }
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| anyhow!("{shown}: cannot create its directory: {e}"))?;
    let probe = dir.join(format!(".ninfer-pack-probe-{}", std::process::id()));
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
        .map_err(|e| anyhow!("{shown}: cannot write in {}: {e}", dir.display()))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// Refuses an output path where something other than a regular file is (a device, a FIFO,
/// a socket, or a symlink to one): an atomic write renames over what is there, and must
/// never replace `/dev/null` with a file. A missing path or a regular file passes.
pub fn refuse_special(out: &Path) -> Result<()> {
    match std::fs::metadata(out) {
        Ok(m) if m.is_dir() => bail!(
            "{}: the output is a directory; give a file path",
            out.display()
        ),
        Ok(m) if !m.is_file() => bail!(
            "{}: the output is not a regular file (a device, pipe or socket); give a file path",
            out.display()
        ),
        _ => Ok(()),
    }
}

/// Whether two paths name the same existing file (same device and inode).
pub fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

/// Gives a file written through a 0600 temporary file the mode a new file would have.
pub fn set_default_mode(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mode = 0o666 & !umask();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| anyhow!("{}: cannot set its mode: {e}", path.display()))
}

/// The process umask, read from `/proc/self/status` (Linux); 022 when it cannot be read.
pub fn umask() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Umask:"))
                .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
        })
        .unwrap_or(0o022)
}

/// Writes `bytes` to `out` through a temporary file beside it, renamed into place (replacing
/// `out`), with the ordinary mode: a reader sees the old file or the new one, never a part.
pub fn write_atomic(out: &Path, bytes: &[u8]) -> Result<()> {
    refuse_special(out)?;
    let shown = out.display();
    let dir = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(|e| {
        anyhow!(
            "{shown}: cannot create a temporary file in {}: {e}",
            dir.display()
        )
    })?;
    std::io::Write::write_all(&mut tmp, bytes)
        .and_then(|()| tmp.as_file().sync_all())
        .map_err(|e| anyhow!("{shown}: cannot write: {e}"))?;
    let tmp = tmp.into_temp_path();
    set_default_mode(&tmp)?;
    tmp.persist(out)
        .map_err(|e| anyhow!("{shown}: cannot rename into place: {}", e.error))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outputs_are_checked_up_front() {
        let d = tempfile::tempdir().unwrap();
        let input = d.path().join("in.gguf");
        std::fs::write(&input, b"x").unwrap();
        let e = check_output(&input, std::slice::from_ref(&input)).unwrap_err();
        assert!(e.to_string().contains("is one of the inputs"), "{e}");
        let e = check_output(d.path(), &[]).unwrap_err();
        assert!(e.to_string().contains("is a directory"), "{e}");
        let under_file = input.join("x.ninfer");
        let e = check_output(&under_file, &[]).unwrap_err().to_string();
        assert!(e.ends_with("in.gguf is not a directory"), "{e}");
        check_output(
            &d.path().join("new/dir/out.ninfer"),
            std::slice::from_ref(&input),
        )
        .unwrap();
    }
}
