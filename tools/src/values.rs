//! Parsers of flag values that refuse what no command could use, so that clap reports them
//! as usage errors (exit code 2) before anything runs.

use std::str::FromStr;

/// A finite number above 0.
pub fn positive<T: FromStr + Into<f64> + Copy>(s: &str) -> Result<T, String> {
    number(s, |x| x > 0.0, "a positive number")
}

/// A finite number of at least 0.
pub fn non_negative<T: FromStr + Into<f64> + Copy>(s: &str) -> Result<T, String> {
    number(s, |x| x >= 0.0, "a finite number ≥ 0")
}

fn number<T: FromStr + Into<f64> + Copy>(s: &str, ok: impl Fn(f64) -> bool, what: &str) -> Result<T, String> {
    match s.trim().parse::<T>() {
        // `1e40` parses to an f32 infinity: refused as the number typed, not as "inf".
        Ok(v) if v.into().is_finite() && ok(v.into()) => Ok(v),
        _ => Err(format!("{s:?} is not {what}")),
    }
}

/// A store's block size: a power of two from 4096 to 65536
/// ([`ctxfs_vfs::device::check_block_size`]).
pub fn block_size(s: &str) -> Result<usize, String> {
    let n = s.trim().parse::<usize>().map_err(|e| format!("{s:?}: {e}"))?;
    ctxfs_vfs::device::check_block_size(n).map(|()| n)
}

/// A count of at least `MIN`.
pub fn at_least<const MIN: usize>(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n >= MIN => Ok(n),
        _ => Err(format!("{s:?}: expected a whole number of at least {MIN}")),
    }
}

/// A size in bytes above 0 ([`crate::units::parse_size`]).
pub fn positive_size(s: &str) -> Result<u64, String> {
    match crate::units::parse_size(s)? {
        0 => Err(format!("{s:?} is 0 bytes: expected a positive size")),
        n => Ok(n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_what_no_command_could_use() {
        assert_eq!(positive::<f32>("0.01"), Ok(0.01));
        assert_eq!(non_negative::<f32>("0"), Ok(0.0));
        assert_eq!(positive::<f64>(" 0.125 "), Ok(0.125));
        for bad in ["0", "-1", "nan", "inf", "1e40", "x", ""] {
            assert!(positive::<f32>(bad).is_err(), "{bad}");
        }
        for bad in ["-0.5", "NaN", "1e40"] {
            assert!(non_negative::<f32>(bad).is_err(), "{bad}");
        }
        assert_eq!((at_least::<2>("2"), at_least::<1>(" 5 ")), (Ok(2), Ok(5)));
        assert!(at_least::<2>("1").is_err() && at_least::<1>("0").is_err() && at_least::<1>("-1").is_err());
        assert_eq!(positive_size("1K"), Ok(1024));
        assert!(positive_size("0").is_err() && positive_size("0.1").is_err());
    }
}
