//! Sizes and counts as people write them: 4096, 64M, 1.5GiB, 2T (binary multiples); "1 block",
//! "2 blocks".

/// A size in bytes: a whole number, or a decimal one with a unit (`0.5G`), rounded down to
/// whole bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let digits = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let invalid = || format!("invalid size {s:?}: expected a number with an optional K, M, G or T suffix");
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        other => return Err(format!("invalid size {s:?}: unknown unit {other:?}")),
    };
    let too_large = || format!("size {s:?} is too large");
    if num.contains('.') {
        let x: f64 = num.parse().map_err(|_| invalid())?;
        let bytes = (x * (1u64 << shift) as f64).floor();
        // 2^64 is the first f64 beyond u64 (u64::MAX as f64 rounds up to it).
        return if bytes < 18_446_744_073_709_551_616.0 { Ok(bytes as u64) } else { Err(too_large()) };
    }
    let n: u64 = num.parse().map_err(|_| invalid())?;
    n.checked_mul(1 << shift).ok_or_else(too_large)
}

/// `n` and the noun, plural unless `n` is 1: "1 block", "2 blocks".
pub fn count(n: impl Into<u64>, noun: &str) -> String {
    let n = n.into();
    format!("{n} {noun}{}", if n == 1 { "" } else { "s" })
}

pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("2t"), Ok(2 << 40));
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("").is_err());
        assert_eq!(parse_size("0.5G"), Ok(512 << 20));
        assert_eq!(parse_size("1.5k"), Ok(1536));
        assert!(parse_size("1.2.3M").is_err() && parse_size(".").is_err() && parse_size("99999999999T").is_err());
        assert_eq!((count(1u64, "block"), count(0u64, "layer")), ("1 block".into(), "0 layers".into()));
        assert_eq!(human_bytes(3 << 20), "3.0 MiB");
    }
}
