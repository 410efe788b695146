//! SPDK store paths (`spdk:CONFIG.json#BDEV`) and the bdev config files they name.
//!
//! The path syntax is recognised in every build, so that a build without the `spdk` feature
//! can say so; the config file is read only with the feature.

use std::path::{Path, PathBuf};

/// The prefix that marks a store path as an SPDK bdev. (A file whose name really starts with
/// `spdk:` can still be named as `./spdk:...`.)
pub const PREFIX: &str = "spdk:";

/// A parsed `spdk:CONFIG.json#BDEV` store path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpdkPath {
    /// The JSON config that creates the bdev (relative paths: to the current directory).
    pub config: PathBuf,
    /// The bdev's name.
    pub bdev: String,
}

impl SpdkPath {
    /// `None` when `path` is not an SPDK path; an error when it is one but malformed.
    pub fn parse(path: &Path) -> Option<Result<SpdkPath, String>> {
        let text = path.to_str()?;
        let rest = text.strip_prefix(PREFIX)?;
        Some(match rest.rsplit_once('#') {
            Some((config, bdev)) if !config.is_empty() && !bdev.is_empty() => {
                Ok(SpdkPath { config: PathBuf::from(config), bdev: bdev.to_string() })
            }
            _ => Err(format!(
                "{text:?}: an SPDK store path is spdk:CONFIG.json#BDEV (a bdev config file and a bdev name)"
            )),
        })
    }
}

#[cfg(feature = "spdk")]
pub use config::*;

#[cfg(feature = "spdk")]
mod config {
    use serde_json::{Map, Value};
    use std::collections::BTreeMap;
    use std::path::{Path, PathBuf};

    /// How the SPDK environment (DPDK's EAL) and the app framework are set up. It applies once
    /// per process: to the first config opened.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct EnvOptions {
        /// Use hugepages for SPDK's memory (false: `--no-huge`).
        pub hugepages: bool,
        /// Where hugetlbfs is mounted (DPDK finds it when unset).
        pub hugedir: Option<String>,
        /// SPDK/DPDK memory in MiB (`-s`); `None`: 512 without hugepages, SPDK's default with.
        pub mem_size_mb: Option<i32>,
        /// Let DPDK scan and claim PCI devices (false: `--no-pci`).
        pub pci: bool,
        /// Only these PCI addresses (`-A`), e.g. "0000:5e:00.0". Implies `pci`.
        pub pci_allowed: Vec<String>,
        /// Reactor core mask (`-m`), e.g. "0x1" or "[2]". Without one, the reactor is not
        /// pinned: it may run on any CPU the process may.
        pub core_mask: Option<String>,
        /// Reactors sleep while idle instead of polling. Default: on, unless the config names
        /// reactor cores (`core_mask`) or attaches NVMe controllers, where SPDK's usual polling
        /// is the point. A polling reactor on a core it shares with the process's own threads
        /// makes them wait for its time slices.
        pub interrupt_mode: bool,
        /// Claim the reactor cores with lock files in /var/tmp, as SPDK apps do.
        pub cpumask_locks: bool,
        /// DPDK IOVA mode: "pa" or "va".
        pub iova_mode: Option<String>,
        /// More DPDK EAL arguments, appended last (so they win).
        pub eal_args: Option<String>,
        /// SPDK's stderr log level: "error", "warn", "notice", "info", "debug" or "disabled".
        pub log_level: i32,
    }

    /// The keys a config's "ctxfs" object may have.
    const KEYS: &[&str] = &[
        "hugepages",
        "hugedir",
        "mem_size_mb",
        "pci",
        "pci_allowed",
        "core_mask",
        "interrupt_mode",
        "cpumask_locks",
        "iova_mode",
        "eal_args",
        "log_level",
    ];

    /// Environment variables that override the config file, for quick changes on a server.
    pub const ENV_VARS: &[(&str, &str)] = &[
        ("CTXFS_SPDK_HUGEPAGES", "hugepages"),
        ("CTXFS_SPDK_MEM_MB", "mem_size_mb"),
        ("CTXFS_SPDK_PCI_ALLOWED", "pci_allowed"),
        ("CTXFS_SPDK_CORE_MASK", "core_mask"),
        ("CTXFS_SPDK_INTERRUPT_MODE", "interrupt_mode"),
        ("CTXFS_SPDK_LOG_LEVEL", "log_level"),
    ];

    /// A bdev config file, read and checked.
    #[derive(Debug, Clone)]
    pub struct Config {
        /// Canonical path: a config is loaded once per process.
        pub path: PathBuf,
        /// The config as SPDK reads it: `{"subsystems": [...]}`, without the "ctxfs" object,
        /// relative bdev file names made absolute.
        pub spdk_json: Vec<u8>,
        /// Environment options: from the "ctxfs" object, the environment variables, defaults.
        pub env: EnvOptions,
        /// Whether the file had a "ctxfs" object (or an override variable was set).
        pub env_explicit: bool,
        /// Bdevs the config creates by name (`bdev_*_create` calls).
        pub creates: Vec<String>,
        /// Backing files of AIO and uring bdevs, by bdev name.
        pub files: BTreeMap<String, PathBuf>,
    }

    fn bad(path: &Path, what: impl std::fmt::Display) -> String {
        format!("SPDK config {}: {what}", path.display())
    }

    impl Config {
        pub fn read(path: &Path) -> Result<Config, String> {
            let text = std::fs::read(path).map_err(|e| bad(path, format!("cannot read it: {e}")))?;
            let canonical = std::fs::canonicalize(path).map_err(|e| bad(path, e))?;
            Self::parse(&canonical, &text, |var| std::env::var(var).ok().filter(|v| !v.is_empty()))
        }

        /// `path` is the (canonical) file the text came from; `env` looks up variables.
        pub fn parse(path: &Path, text: &[u8], env: impl Fn(&str) -> Option<String>) -> Result<Config, String> {
            let mut root: Value =
                serde_json::from_slice(text).map_err(|e| bad(path, format!("not valid JSON: {e}")))?;
            let obj = root.as_object_mut().ok_or_else(|| bad(path, "must be a JSON object"))?;
            let ctxfs = match obj.remove("ctxfs") {
                None => None,
                Some(Value::Object(m)) => Some(m),
                Some(_) => return Err(bad(path, "\"ctxfs\" must be an object")),
            };
            for key in obj.keys() {
                if key != "subsystems" {
                    return Err(bad(path, format!("unknown key {key:?} (expected \"subsystems\" and \"ctxfs\")")));
                }
            }
            let dir = path.parent().unwrap_or(Path::new("/")).to_path_buf();
            let mut creates = Vec::new();
            let mut files = BTreeMap::new();
            let mut nvme_pcie = false;
            let mut nvme = false;
            if let Some(subsystems) = obj.get_mut("subsystems") {
                let subsystems =
                    subsystems.as_array_mut().ok_or_else(|| bad(path, "\"subsystems\" must be an array"))?;
                for sub in subsystems {
                    let Some(calls) = sub.get_mut("config").and_then(Value::as_array_mut) else { continue };
                    for call in calls {
                        let method = call.get("method").and_then(Value::as_str).unwrap_or("").to_string();
                        let Some(params) = call.get_mut("params").and_then(Value::as_object_mut) else { continue };
                        let name = params.get("name").and_then(Value::as_str).map(str::to_string);
                        if method == "bdev_nvme_attach_controller" {
                            nvme = true;
                            let trtype = params.get("trtype").and_then(Value::as_str).unwrap_or("");
                            nvme_pcie |= trtype.eq_ignore_ascii_case("pcie");
                        }
                        if method.starts_with("bdev_") && method.ends_with("_create") {
                            if let Some(name) = &name {
                                creates.push(name.clone());
                            }
                        }
                        if method == "bdev_aio_create" || method == "bdev_uring_create" {
                            if let (Some(name), Some(Value::String(file))) = (&name, params.get_mut("filename")) {
                                let full = dir.join(&*file);
                                *file = full.display().to_string();
                                files.insert(name.clone(), full);
                            }
                        }
                    }
                }
            }
            let env_explicit = ctxfs.is_some() || ENV_VARS.iter().any(|(v, _)| env(v).is_some());
            let env = env_options(path, ctxfs.unwrap_or_default(), nvme_pcie, nvme, env)?;
            let spdk_json = serde_json::to_vec(&root).map_err(|e| bad(path, e))?;
            Ok(Config { path: path.to_path_buf(), spdk_json, env, env_explicit, creates, files })
        }
    }

    fn env_options(
        path: &Path,
        mut m: Map<String, Value>,
        nvme_pcie: bool,
        nvme: bool,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<EnvOptions, String> {
        for key in m.keys() {
            if !KEYS.contains(&key.as_str()) {
                return Err(bad(path, format!("unknown \"ctxfs\" option {key:?} (known: {})", KEYS.join(", "))));
            }
        }
        // Variables override the file: turn each into the JSON value it stands for.
        for (var, key) in ENV_VARS {
            let Some(v) = env(var) else { continue };
            let value = match *key {
                "hugepages" | "interrupt_mode" => {
                    Value::Bool(parse_bool(&v).ok_or_else(|| format!("{var}={v:?}: expected 0 or 1"))?)
                }
                "mem_size_mb" => Value::from(v.parse::<i64>().map_err(|_| format!("{var}={v:?}: expected MiB"))?),
                "pci_allowed" => Value::from(v.split(',').map(str::trim).filter(|s| !s.is_empty()).collect::<Vec<_>>()),
                _ => Value::String(v),
            };
            m.insert(key.to_string(), value);
        }
        let flag = |key: &str, default: bool| -> Result<bool, String> {
            match m.get(key) {
                None => Ok(default),
                Some(Value::Bool(b)) => Ok(*b),
                Some(_) => Err(bad(path, format!("\"ctxfs\".{key} must be true or false"))),
            }
        };
        let text = |key: &str| -> Result<Option<String>, String> {
            match m.get(key) {
                None => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(_) => Err(bad(path, format!("\"ctxfs\".{key} must be a string"))),
            }
        };
        let pci_allowed = match m.get("pci_allowed") {
            None => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| bad(path, "\"ctxfs\".pci_allowed must be an array of PCI addresses"))?,
            Some(_) => return Err(bad(path, "\"ctxfs\".pci_allowed must be an array of PCI addresses")),
        };
        let mem_size_mb = match m.get("mem_size_mb") {
            None => None,
            Some(v) => Some(
                v.as_i64()
                    .filter(|&n| n > 0 && n <= i32::MAX as i64)
                    .ok_or_else(|| bad(path, "\"ctxfs\".mem_size_mb must be a positive number of MiB"))?
                    as i32,
            ),
        };
        let log_level = match text("log_level")?.as_deref() {
            None | Some("warn") | Some("warning") => 1,
            Some("disabled") => -1,
            Some("error") => 0,
            Some("notice") => 2,
            Some("info") => 3,
            Some("debug") => 4,
            Some(other) => {
                return Err(bad(
                    path,
                    format!("\"ctxfs\".log_level {other:?}: expected error, warn, notice, info, debug or disabled"),
                ))
            }
        };
        if let Some(mode) = text("iova_mode")? {
            if mode != "pa" && mode != "va" {
                return Err(bad(path, format!("\"ctxfs\".iova_mode {mode:?}: expected \"pa\" or \"va\"")));
            }
        }
        let core_mask = text("core_mask")?;
        Ok(EnvOptions {
            hugepages: flag("hugepages", false)?,
            hugedir: text("hugedir")?,
            mem_size_mb,
            pci: flag("pci", nvme_pcie || !pci_allowed.is_empty())? || !pci_allowed.is_empty(),
            pci_allowed,
            interrupt_mode: flag("interrupt_mode", core_mask.is_none() && !nvme)?,
            core_mask,
            cpumask_locks: flag("cpumask_locks", false)?,
            iova_mode: text("iova_mode")?,
            eal_args: text("eal_args")?,
            log_level,
        })
    }

    fn parse_bool(v: &str) -> Option<bool> {
        match v {
            "1" | "true" | "yes" | "on" => Some(true),
            "0" | "false" | "no" | "off" => Some(false),
            _ => None,
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        fn parse(text: &str, vars: &[(&str, &str)]) -> Result<Config, String> {
            let vars: Vec<(String, String)> = vars.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect();
            Config::parse(Path::new("/cfg/bdev.json"), text.as_bytes(), |v| {
                vars.iter().find(|(k, _)| k == v).map(|(_, val)| val.clone())
            })
        }

        #[test]
        fn defaults_need_no_hugepages_and_no_pci() {
            let c = parse(
                r#"{"subsystems": [{"subsystem": "bdev", "config": [
                    {"method": "bdev_aio_create", "params": {"name": "a0", "filename": "x.img", "block_size": 4096}}]}]}"#,
                &[],
            )
            .unwrap();
            assert!(!c.env.hugepages && !c.env.pci && !c.env_explicit);
            assert!(c.env.interrupt_mode, "no dedicated cores named: the reactor sleeps when idle");
            assert_eq!(c.creates, ["a0"]);
            assert_eq!(c.files["a0"], Path::new("/cfg/x.img"), "relative files are beside the config");
            let json: Value = serde_json::from_slice(&c.spdk_json).unwrap();
            assert_eq!(json["subsystems"][0]["config"][0]["params"]["filename"], "/cfg/x.img");
        }

        #[test]
        fn ctxfs_options_and_variables() {
            let c = parse(
                r#"{"ctxfs": {"hugepages": true, "core_mask": "0x3", "mem_size_mb": 2048},
                    "subsystems": [{"subsystem": "bdev", "config": [{"method": "bdev_nvme_attach_controller",
                    "params": {"name": "nvme0", "trtype": "PCIe", "traddr": "0000:5e:00.0"}}]}]}"#,
                &[("CTXFS_SPDK_CORE_MASK", "0xc"), ("CTXFS_SPDK_PCI_ALLOWED", "0000:5e:00.0, 0000:5f:00.0")],
            )
            .unwrap();
            assert!(c.env.hugepages && c.env.pci && c.env_explicit);
            assert!(!c.env.interrupt_mode, "NVMe on named cores: SPDK polls");
            assert_eq!(c.env.core_mask.as_deref(), Some("0xc"), "a variable overrides the file");
            assert_eq!(c.env.mem_size_mb, Some(2048));
            assert_eq!(c.env.pci_allowed, ["0000:5e:00.0", "0000:5f:00.0"]);
            assert!(c.creates.is_empty());
            assert!(!String::from_utf8(c.spdk_json).unwrap().contains("ctxfs"), "SPDK never sees the ctxfs object");
        }

        #[test]
        fn mistakes_are_named() {
            assert!(parse("[1]", &[]).unwrap_err().contains("JSON object"));
            assert!(parse("{", &[]).unwrap_err().contains("not valid JSON"));
            assert!(parse(r#"{"subsytems": []}"#, &[]).unwrap_err().contains("unknown key \"subsytems\""));
            assert!(parse(r#"{"ctxfs": {"hugepage": true}}"#, &[]).unwrap_err().contains("unknown \"ctxfs\" option"));
            assert!(parse(r#"{"ctxfs": {"log_level": "loud"}}"#, &[]).unwrap_err().contains("log_level"));
            assert!(parse("{}", &[("CTXFS_SPDK_HUGEPAGES", "maybe")]).unwrap_err().contains("CTXFS_SPDK_HUGEPAGES"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spdk_paths() {
        assert_eq!(SpdkPath::parse(Path::new("store.img")), None);
        assert_eq!(SpdkPath::parse(Path::new("./spdk:x#y")), None);
        assert_eq!(
            SpdkPath::parse(Path::new("spdk:/etc/ctxfs/bdev.json#nvme0n1")),
            Some(Ok(SpdkPath { config: "/etc/ctxfs/bdev.json".into(), bdev: "nvme0n1".into() }))
        );
        assert_eq!(
            SpdkPath::parse(Path::new("spdk:a#b.json#aio0")),
            Some(Ok(SpdkPath { config: "a#b.json".into(), bdev: "aio0".into() })),
            "the last # separates the bdev"
        );
        for bad in ["spdk:bdev.json", "spdk:#aio0", "spdk:bdev.json#"] {
            assert!(SpdkPath::parse(Path::new(bad)).unwrap().is_err(), "{bad}");
        }
    }
}
