//! What the machine lets this process use, read before anything large is allocated: the
//! memory it may fill (a cgroup's limit where one is set, else the kernel's estimate of
//! available memory) and the address space it may map (`RLIMIT_AS`, which a mapped artifact
//! counts against), and afterwards what it used (peak resident set). Linux sources; where
//! one cannot be read, it sets no limit.

/// A limit and where it comes from (said in refusals and recorded in reports).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limit {
    pub bytes: u64,
    pub source: String,
}

/// Memory this process may fill now: the smallest of the cgroup's remaining allowance
/// (`memory.max` less `memory.current`, cgroup v2; `memory.limit_in_bytes` less
/// `memory.usage_in_bytes`, v1) and `MemAvailable`.
pub fn memory_available() -> Option<Limit> {
    let mut best: Option<Limit> = None;
    let mut consider = |bytes: u64, source: String| {
        if best.as_ref().is_none_or(|b| bytes < b.bytes) {
            best = Some(Limit { bytes, source });
        }
    };
    if let Some(kb) = meminfo("MemAvailable:") {
        consider(kb * 1024, "MemAvailable in /proc/meminfo".into());
    }
    for (limit, usage) in [
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ] {
        // "max" (v2) or a huge number (v1) means no limit.
        if let (Some(l), Some(u)) = (read_u64(limit), read_u64(usage)) {
            if l < (1 << 60) {
                consider(l.saturating_sub(u), format!("the cgroup's limit ({limit})"));
            }
        }
    }
    best
}

/// Address space this process may still map: `RLIMIT_AS` less what is mapped now
/// (`VmSize`); `None` without a limit.
pub fn address_space_available() -> Option<Limit> {
    let limit = rlimit_as()?;
    let mapped = status_kb("VmSize:").unwrap_or(0) * 1024;
    Some(Limit {
        bytes: limit.saturating_sub(mapped),
        source: format!(
            "the address-space limit (RLIMIT_AS {} MiB, {} MiB mapped already)",
            limit >> 20,
            mapped >> 20
        ),
    })
}

/// The process's peak resident set so far (`VmHWM`).
pub fn peak_resident_bytes() -> Option<u64> {
    status_kb("VmHWM:").map(|kb| kb * 1024)
}

#[cfg(target_os = "linux")]
fn rlimit_as() -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut r) } != 0 || r.rlim_cur == libc::RLIM_INFINITY
    {
        return None;
    }
    Some(r.rlim_cur)
}

#[cfg(not(target_os = "linux"))]
fn rlimit_as() -> Option<u64> {
    None
}

fn read_u64(path: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// A `/proc/meminfo` field in kB.
fn meminfo(key: &str) -> Option<u64> {
    field_kb(&std::fs::read_to_string("/proc/meminfo").ok()?, key)
}

/// A `/proc/self/status` field in kB.
fn status_kb(key: &str) -> Option<u64> {
    field_kb(&std::fs::read_to_string("/proc/self/status").ok()?, key)
}

fn field_kb(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// A byte count from the command line: a number with an optional unit, `K`, `M`, `G`, `T`
/// (powers of 1024, `iB`/`B` allowed: `20G`, `20GiB`, `512MB`, `1073741824`).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let shift = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        _ => return Err(format!("`{s}`: unknown unit (use K, M, G or T)")),
    };
    let v: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size (e.g. 20G, 512M)"))?;
    let bytes = v * (1u64 << shift) as f64;
    if !(bytes.is_finite() && bytes >= 1.0 && bytes < 2f64.powi(63)) {
        return Err(format!("`{s}` is not a size this machine can have"));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_bytes("1073741824"), Ok(1 << 30));
        assert_eq!(parse_bytes("20G"), Ok(20 << 30));
        assert_eq!(parse_bytes("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_bytes("512mb"), Ok(512 << 20));
        assert!(parse_bytes("12 parsecs")
            .unwrap_err()
            .contains("unknown unit"));
        assert!(parse_bytes("G").unwrap_err().contains("not a size"));
        assert!(parse_bytes("0").is_err());
    }

    #[test]
    fn the_kernel_files_are_read() {
        assert!(field_kb("VmHWM:\t  1234 kB\nX: 1", "VmHWM:") == Some(1234));
        // On Linux these exist for every process.
        if cfg!(target_os = "linux") {
            assert!(peak_resident_bytes().is_some_and(|b| b > 0));
            assert!(memory_available().is_some_and(|l| l.bytes > 0));
        }
    }
}
