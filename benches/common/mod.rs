//! Shared by the bench binaries.

/// The value after `--name` on the command line, parsed, or `default` when absent.
///
/// # Panics
/// When the value does not parse (a bench's command line is a developer's, not a user's).
pub fn arg<T: std::str::FromStr>(name: &str, default: T) -> T {
    let args: Vec<String> = std::env::args().collect();
    match args
        .iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
    {
        Some(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{name}: cannot parse `{v}`")),
        None => default,
    }
}
