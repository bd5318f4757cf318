//! Where reports go, and writing them atomically.
//!
//! `--output DIR` must be absent or empty; this is checked before any work starts, and
//! nothing is created until the run has finished. The report is written to a temporary
//! file in the target directory and renamed into place, so an interrupted run leaves no
//! half-written `report.json`.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// Checks that `dir` can receive a report: absent (with a writable ancestor) or empty.
pub fn check_output_dir(dir: &Path) -> Result<()> {
    match std::fs::metadata(dir) {
        Ok(m) if !m.is_dir() => bail!("{}: --output exists and is not a directory", dir.display()),
        Ok(_) => {
            let mut it = std::fs::read_dir(dir)
                .with_context(|| format!("{}: cannot read --output directory", dir.display()))?;
            if it.next().is_some() {
                bail!(
                    "{}: --output directory is not empty (give an empty or new directory)",
                    dir.display()
                );
            }
            probe_writable(dir)
        }
        Err(_) => {
            let mut anc = dir.parent();
            while let Some(a) = anc {
                let a = if a.as_os_str().is_empty() {
                    Path::new(".")
                } else {
                    a
                };
                if a.exists() {
                    if !a.is_dir() {
                        bail!(
                            "{}: cannot create --output directory: {} is not a directory",
                            dir.display(),
                            a.display()
                        );
                    }
                    return probe_writable(a).with_context(|| {
                        format!("{}: cannot create --output directory", dir.display())
                    });
                }
                anc = a.parent();
            }
            Ok(())
        }
    }
}

fn probe_writable(dir: &Path) -> Result<()> {
    tempfile::Builder::new()
        .prefix(".ninfer-probe")
        .tempfile_in(dir)
        .map(drop)
        .with_context(|| format!("{}: directory is not writable", dir.display()))
}

/// Writes `json` as `dir/report.json` atomically; returns the path.
pub fn write_report(dir: &Path, json: &str) -> Result<PathBuf> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("{}: cannot create output directory", dir.display()))?;
    let path = dir.join("report.json");
    let mut tmp = tempfile::Builder::new()
        .prefix(".report.json.")
        .tempfile_in(dir)
        .with_context(|| format!("{}: cannot create a temporary file", dir.display()))?;
    use std::io::Write;
    tmp.write_all(json.as_bytes())
        .and_then(|_| tmp.as_file().sync_all())
        .with_context(|| format!("{}: cannot write report", path.display()))?;
    tmp.persist(&path)
        .with_context(|| format!("{}: cannot move report into place", path.display()))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_rules() {
        let root = tempfile::tempdir().unwrap();
        // Absent: fine, and nothing is created by the check.
        let new = root.path().join("a/b");
        check_output_dir(&new).unwrap();
        assert!(!new.exists());
        // Empty: fine.
        let empty = root.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        check_output_dir(&empty).unwrap();
        // Not empty: refused.
        std::fs::write(empty.join("x"), "1").unwrap();
        let e = check_output_dir(&empty).unwrap_err().to_string();
        assert!(e.contains("not empty"), "{e}");
        // A file: refused.
        let file = root.path().join("file");
        std::fs::write(&file, "1").unwrap();
        let e = check_output_dir(&file).unwrap_err().to_string();
        assert!(e.contains("not a directory"), "{e}");
        // Under a file: refused.
        let e = format!("{:#}", check_output_dir(&file.join("sub")).unwrap_err());
        assert!(e.contains("not a directory"), "{e}");
    }

    #[test]
    fn atomic_write_leaves_only_the_report() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("out");
        let p = write_report(&dir, "{}").unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "{}");
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("report.json")]);
    }
}
