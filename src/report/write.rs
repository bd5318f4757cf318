//! Where reports go, and writing them so that no report is ever lost or replaced.
//!
//! A run claims its output directory before anything else is done ([`OutputDir::claim`]):
//! `--output DIR` must be absent (then it is created) or an empty directory, the default
//! directory (the seed engine's `profiles/perplexity/<model>/<weights>/<kv>/<corpus>/<mode>/
//! <UTC time>`, or the first free `<UTC time>-N`, [`OutputDir::claim_new_under`]) must not
//! exist, and in every case a lock file
//! is created in it with `O_EXCL`. Two runs aimed at the same directory therefore cannot both
//! proceed: the second fails in its first second, not after an hour of scoring, and so does
//! an unwritable or over-long path. The report is written to a temporary file beside its
//! final name and linked into place, which fails rather than replace an existing
//! `report.json`; an interrupted run leaves no half-written report. A run that fails removes
//! its lock file and the directory if it created it.
//!
//! Files are created with the ordinary mode (0666 less the umask), like any other output.

use anyhow::{anyhow, bail, Context, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The lock file's name: present while a run owns the directory.
const LOCK: &str = ".ninfer-perplexity.lock";
/// The report's name.
pub const REPORT: &str = "report.json";

/// How a directory is to be claimed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// `--output DIR`: absent (created) or an empty directory.
    AbsentOrEmpty,
    /// A directory of the run's own (a run's default, `merge`'s default): must not exist yet.
    New,
}

/// An output directory this run owns until it writes its report or fails.
#[derive(Debug)]
pub struct OutputDir {
    dir: PathBuf,
    /// This run created `dir` (then a failure removes it again).
    created: bool,
    lock: Option<PathBuf>,
}

/// Whether a lock file names a process that no longer runs (or names none: a run killed
/// between creating the lock and writing its pid).
fn lock_is_stale(lock: &Path) -> bool {
    let Ok(text) = crate::input::read_text_bounded(lock, "the lock", 64) else {
        return false;
    };
    match text.trim().parse::<i32>() {
        Ok(pid) if pid > 0 => {
            // SAFETY: signal 0 only asks whether the process exists.
            let r = unsafe { libc::kill(pid, 0) };
            r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
        }
        _ => true,
    }
}

/// A path component made from `s` (a run id read from a shard's report): letters, digits,
/// `.`, `_` and `-` kept, anything else `_`, no leading dot, at most 160 bytes; never a path
/// that leaves the directory it is joined to.
pub fn safe_component(s: &str) -> String {
    component(s, '_', "run")
}

/// One component of the seed engine's default output path: ASCII letters, digits, `-`, `_`
/// and `.` kept, anything else `-`, empty `unknown` (its rule); and, beyond it, no leading
/// dot (so never `.` or `..`) and at most 160 bytes.
pub fn seed_component(s: &str) -> String {
    component(s, '-', "unknown")
}

/// `s` with characters other than ASCII letters, digits, `.`, `_`, `-` replaced by `other`,
/// cut to 160 characters, a leading dot replaced too (so never `.` or `..`), `empty` when
/// nothing is left.
fn component(s: &str, other: char, empty: &str) -> String {
    let keep = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    let mut out: String = s
        .chars()
        .map(|c| if keep(c) { c } else { other })
        .take(160)
        .collect();
    if out.starts_with('.') {
        out.replace_range(..1, other.encode_utf8(&mut [0; 4]));
    }
    if out.is_empty() {
        out.push_str(empty);
    }
    out
}

impl OutputDir {
    /// Claims a new directory `base/name`, or `base/name-2`, `base/name-3`, ... when another
    /// run has that one: two runs never share a directory.
    pub fn claim_new_under(base: &Path, name: &str) -> Result<OutputDir> {
        let mut last = None;
        for n in 1..=1000 {
            let dir = if n == 1 {
                base.join(name)
            } else {
                base.join(format!("{name}-{n}"))
            };
            if std::fs::symlink_metadata(&dir).is_ok() {
                continue;
            }
            match OutputDir::claim(&dir, Claim::New) {
                Ok(o) => return Ok(o),
                // Lost a race for this name: try the next.
                Err(e) if std::fs::symlink_metadata(&dir).is_ok() => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| {
            anyhow!(
                "{}: 1000 runs already have a directory named {name}",
                base.display()
            )
        }))
    }

    /// Claims `dir` (see the module docs). Errors name the directory.
    pub fn claim(dir: &Path, how: Claim) -> Result<OutputDir> {
        let shown = dir.display();
        let created = match std::fs::metadata(dir) {
            Ok(m) if !m.is_dir() => bail!("{shown}: --output exists and is not a directory"),
            Ok(_) if how == Claim::New => bail!("{shown}: the run's directory already exists"),
            Ok(_) => {
                let entries: Vec<std::ffi::OsString> = std::fs::read_dir(dir)
                    .with_context(|| format!("{shown}: cannot read --output directory"))?
                    .take(2)
                    .filter_map(|e| e.ok().map(|e| e.file_name()))
                    .collect();
                // A run that was killed leaves only its lock: with its process gone, the
                // directory is empty for a retry.
                if entries == [LOCK] && lock_is_stale(&dir.join(LOCK)) {
                    let _ = std::fs::remove_file(dir.join(LOCK));
                } else if !entries.is_empty() {
                    bail!(
                        "{shown}: --output directory is not empty (give an empty or new directory)"
                    );
                }
                false
            }
            Err(_) => {
                if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                    // Name the file in the way rather than "File exists".
                    if let Some(file) = parent
                        .ancestors()
                        .find(|a| std::fs::metadata(a).is_ok_and(|m| !m.is_dir()))
                    {
                        bail!(
                            "{shown}: cannot create the output directory: {} is a file, not a directory",
                            file.display()
                        );
                    }
                    std::fs::create_dir_all(parent).map_err(|e| {
                        anyhow!("{shown}: cannot create the output directory's parent: {e}")
                    })?;
                }
                match std::fs::create_dir(dir) {
                    Ok(()) => true,
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                        bail!("{shown}: another run created this output directory first")
                    }
                    Err(e) => bail!("{shown}: cannot create output directory: {e}"),
                }
            }
        };
        let mut out = OutputDir {
            dir: dir.to_path_buf(),
            created,
            lock: None,
        };
        let lock = dir.join(LOCK);
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&lock)
        {
            Ok(mut f) => {
                let _ = writeln!(f, "{}", std::process::id());
                out.lock = Some(lock);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                bail!("{shown}: another run is writing its report here")
            }
            Err(e) => bail!("{shown}: output directory is not writable: {e}"),
        }
        Ok(out)
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Writes `json` as `report.json` (never replacing one) and releases the directory.
    pub fn write_report(self, json: &str) -> Result<PathBuf> {
        self.write_report_with(json, &[])
    }

    /// [`OutputDir::write_report`] after `extras` (name, bytes: `plot.svg`), each linked into
    /// place the same way; if anything fails, the extras already written are removed again.
    pub fn write_report_with(mut self, json: &str, extras: &[(&str, &[u8])]) -> Result<PathBuf> {
        let mut written_extras = vec![];
        for (name, bytes) in extras {
            let path = self.dir.join(name);
            let r = self.place(&path, bytes);
            if let Err(e) = r {
                written_extras.iter().for_each(|p| {
                    let _ = std::fs::remove_file(p);
                });
                return Err(e);
            }
            written_extras.push(path);
        }
        let path = self.dir.join(REPORT);
        if let Err(e) = self.place(&path, json.as_bytes()) {
            written_extras.iter().for_each(|p| {
                let _ = std::fs::remove_file(p);
            });
            return Err(e);
        }
        if let Some(lock) = self.lock.take() {
            let _ = std::fs::remove_file(lock);
        }
        self.created = false; // the directory now holds the report
        Ok(path)
    }

    /// Writes `bytes` to a temporary file and links it to `path` (never replacing a file).
    fn place(&self, path: &Path, bytes: &[u8]) -> Result<()> {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let tmp = self.dir.join(format!(".{name}.{}.tmp", std::process::id()));
        let written = write_new(&tmp, bytes)
            .and_then(|()| {
                // A hard link fails when the name exists, where a rename would replace it.
                std::fs::hard_link(&tmp, path).map_err(|e| {
                    if e.kind() == std::io::ErrorKind::AlreadyExists {
                        anyhow!("a {name} is already there; it was left as it is")
                    } else {
                        anyhow!("cannot move the {name} into place: {e}")
                    }
                })
            })
            .with_context(|| path.display().to_string());
        let _ = std::fs::remove_file(&tmp);
        written
    }
}

impl Drop for OutputDir {
    /// A run that did not write its report leaves nothing behind of its own.
    fn drop(&mut self) {
        if let Some(lock) = self.lock.take() {
            let _ = std::fs::remove_file(lock);
        }
        if self.created {
            let _ = std::fs::remove_dir(&self.dir); // only if empty
        }
    }
}

/// Creates `path` (which must not exist) holding `bytes`, synced to disk.
fn write_new(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|e| anyhow!("cannot create a temporary file: {e}"))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .map_err(|e| anyhow!("cannot write the report: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_run_id_from_a_file_becomes_one_safe_component() {
        assert_eq!(
            safe_component("20261203T2239Z-65c3b8b6-bf16-1"),
            "20261203T2239Z-65c3b8b6-bf16-1"
        );
        assert_eq!(safe_component("../../etc/x"), "_._.._etc_x");
        assert_eq!(safe_component("/abs"), "_abs");
        assert_eq!(safe_component(".."), "_.");
        assert_eq!(safe_component(""), "run");
        assert_eq!(safe_component(&"a".repeat(500)).len(), 160);
        // The seed engine's rule, for the default output directory's components.
        assert_eq!(seed_component("qwen3.5 27b/nvfp4"), "qwen3.5-27b-nvfp4");
        assert_eq!(seed_component(".."), "-.");
        assert_eq!(seed_component(""), "unknown");
        for s in ["../../etc/x", "/abs", "..", "a/../.."] {
            let p = Path::new("profiles/perplexity").join(safe_component(s));
            assert_eq!(p.components().count(), 3, "{s}: {}", p.display());
        }
    }

    /// A directory holding only the lock of a process that is gone is claimed again (the
    /// retry of a killed run); one whose lock names a live process is not.
    #[test]
    fn a_dead_runs_lock_does_not_block_a_retry() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("out");
        std::fs::create_dir(&dir).unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        std::fs::write(dir.join(LOCK), format!("{dead}\n")).unwrap();
        let out = OutputDir::claim(&dir, Claim::AbsentOrEmpty).unwrap();
        out.write_report("{}").unwrap();
        assert_eq!(names(&dir), ["report.json"]);
        let live = tmp.path().join("live");
        std::fs::create_dir(&live).unwrap();
        std::fs::write(live.join(LOCK), format!("{}\n", std::process::id())).unwrap();
        let e = OutputDir::claim(&live, Claim::AbsentOrEmpty)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not empty"), "{e}");
        let file = tmp.path().join("f");
        std::fs::write(&file, "x").unwrap();
        let e = OutputDir::claim(&file.join("a/b"), Claim::AbsentOrEmpty)
            .unwrap_err()
            .to_string();
        assert!(
            e.ends_with(&format!("{} is a file, not a directory", file.display())),
            "{e}"
        );
    }

    #[test]
    fn output_rules() {
        let root = tempfile::tempdir().unwrap();
        // Absent: created (parents too) and locked while claimed.
        let new = root.path().join("a/b");
        let claimed = OutputDir::claim(&new, Claim::AbsentOrEmpty).unwrap();
        assert_eq!(names(&new), [LOCK]);
        // A second claim of the same directory fails at once.
        let e = OutputDir::claim(&new, Claim::AbsentOrEmpty).unwrap_err();
        assert!(e.to_string().contains("not empty"), "{e}");
        drop(claimed);
        assert!(
            !new.exists(),
            "a failed run removes the directory it created"
        );
        // Empty: fine, and kept on failure.
        let empty = root.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        drop(OutputDir::claim(&empty, Claim::AbsentOrEmpty).unwrap());
        assert!(empty.exists() && names(&empty).is_empty());
        // Not empty: refused.
        std::fs::write(empty.join("x"), "1").unwrap();
        let e = OutputDir::claim(&empty, Claim::AbsentOrEmpty).unwrap_err();
        assert!(e.to_string().contains("not empty"), "{e}");
        // A run's own directory must be new.
        let e = OutputDir::claim(&empty, Claim::New).unwrap_err();
        assert!(e.to_string().contains("already exists"), "{e}");
        // A file: refused.
        let file = root.path().join("file");
        std::fs::write(&file, "1").unwrap();
        let e = OutputDir::claim(&file, Claim::AbsentOrEmpty).unwrap_err();
        assert!(e.to_string().contains("not a directory"), "{e}");
        // Under a file: refused.
        let e = format!(
            "{:#}",
            OutputDir::claim(&file.join("sub"), Claim::New).unwrap_err()
        );
        assert!(e.contains("cannot create"), "{e}");
        // Over-long: refused up front.
        let long = root.path().join("x".repeat(300));
        let e = format!("{:#}", OutputDir::claim(&long, Claim::New).unwrap_err());
        assert!(e.contains("cannot create output directory"), "{e}");
    }

    #[test]
    fn the_report_is_written_once_and_never_replaced() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("out");
        let p = OutputDir::claim(&dir, Claim::AbsentOrEmpty)
            .unwrap()
            .write_report("{}")
            .unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "{}");
        assert_eq!(names(&dir), [REPORT]);
        // Someone else's report appearing in a claimed directory is kept, and the run fails.
        let dir2 = root.path().join("out2");
        let claimed = OutputDir::claim(&dir2, Claim::AbsentOrEmpty).unwrap();
        std::fs::write(dir2.join(REPORT), "theirs").unwrap();
        let e = format!("{:#}", claimed.write_report("ours").unwrap_err());
        assert!(e.contains("already there"), "{e}");
        assert_eq!(
            std::fs::read_to_string(dir2.join(REPORT)).unwrap(),
            "theirs"
        );
        assert_eq!(names(&dir2), [REPORT]);
    }

    #[test]
    fn reports_follow_the_umask() {
        use std::os::unix::fs::PermissionsExt;
        let root = tempfile::tempdir().unwrap();
        let p = OutputDir::claim(&root.path().join("o"), Claim::New)
            .unwrap()
            .write_report("{}")
            .unwrap();
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        // Whatever the umask, the group/other read bits are not stripped the way a
        // temporary file's 0600 would strip them (unless the umask itself does).
        let umask = current_umask();
        assert_eq!(mode, 0o666 & !umask, "mode {mode:o}, umask {umask:o}");
    }

    /// The process umask, read from /proc (Linux).
    fn current_umask() -> u32 {
        let s = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = s.lines().find(|l| l.starts_with("Umask:")).unwrap();
        u32::from_str_radix(line.split_whitespace().nth(1).unwrap(), 8).unwrap()
    }
}
