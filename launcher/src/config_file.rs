//! The cluster's defaults: `config.toml` files an operator writes once (the rendezvous service's
//! endpoint, its token file, …) so that `rlaunch --nproc-per-node 4 --nnodes 2 train` joins it.
//!
//! Files, each overriding the one before: `/etc/rlaunch/config.toml`,
//! `$XDG_CONFIG_HOME/rlaunch/config.toml` (default `~/.config`), and the file `$RLAUNCH_CONFIG`
//! names. Keys are the long flag names (`rdzv-endpoint` or `rdzv_endpoint`); values are strings,
//! numbers or booleans. A flag beats its environment variable, which beats the files: a file's
//! value is used only where the command line and the environment say nothing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::cli::UsageError;

/// One setting a file gave, and which file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileSetting {
    pub value: String,
    pub file: PathBuf,
}

/// The files to read, in order, given the environment.
pub fn config_paths(env: &dyn Fn(&str) -> Option<String>) -> Vec<(PathBuf, bool)> {
    let mut paths = vec![(PathBuf::from("/etc/rlaunch/config.toml"), false)];
    let xdg = env("XDG_CONFIG_HOME")
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .or_else(|| env("HOME").map(|h| Path::new(&h).join(".config")));
    if let Some(x) = xdg {
        paths.push((x.join("rlaunch/config.toml"), false));
    }
    if let Some(f) = env("RLAUNCH_CONFIG").filter(|s| !s.is_empty()) {
        // Named on purpose: it must exist.
        paths.push((PathBuf::from(f), true));
    }
    paths
}

/// Reads the files into `long flag name → setting`, later files winning. `known` says which
/// keys exist (long flag names with dashes).
pub fn load(
    paths: &[(PathBuf, bool)],
    known: &dyn Fn(&str) -> bool,
) -> Result<BTreeMap<String, FileSetting>, UsageError> {
    let mut out = BTreeMap::new();
    for (path, required) in paths {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => continue,
            Err(e) => return Err(UsageError(format!("cannot read the config file {}: {e}", path.display()))),
        };
        for (key, value) in parse(&text, path, known)? {
            out.insert(key, FileSetting { value, file: path.clone() });
        }
    }
    Ok(out)
}

/// One file's settings.
pub fn parse(text: &str, path: &Path, known: &dyn Fn(&str) -> bool) -> Result<Vec<(String, String)>, UsageError> {
    let table: toml::Table = toml::from_str(text)
        .map_err(|e| UsageError(format!("config file {} is not valid TOML: {e}", path.display())))?;
    let mut out = Vec::new();
    for (key, value) in table {
        let name = key.replace('_', "-");
        if !known(&name) {
            return Err(UsageError(format!(
                "config file {}: unknown setting `{key}` (settings are rlaunch's long flag names, e.g. rdzv-endpoint)",
                path.display()
            )));
        }
        let value = match value {
            toml::Value::String(s) => s,
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(f) => f.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            other => {
                return Err(UsageError(format!(
                    "config file {}: `{key}` must be a string, number or boolean, not {}",
                    path.display(),
                    other.type_str()
                )))
            }
        };
        out.push((name, value));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn known(k: &str) -> bool {
        ["rdzv-endpoint", "max-restarts", "standalone"].contains(&k)
    }

    #[test]
    fn reads_flag_names_in_either_spelling_and_plain_values() {
        let got =
            parse("rdzv_endpoint = \"svc:29400\"\nmax-restarts = 3\nstandalone = false\n", Path::new("f"), &known)
                .unwrap();
        assert_eq!(
            got,
            [
                ("max-restarts".to_string(), "3".to_string()),
                ("rdzv-endpoint".to_string(), "svc:29400".to_string()),
                ("standalone".to_string(), "false".to_string())
            ]
        );
    }

    #[test]
    fn refuses_unknown_keys_tables_and_bad_toml_naming_the_file() {
        let e = parse("rdzv_endpont = \"x\"", Path::new("/etc/rlaunch/config.toml"), &known).unwrap_err();
        assert!(e.0.contains("unknown setting `rdzv_endpont`") && e.0.contains("/etc/rlaunch/config.toml"), "{e}");
        assert!(parse("max-restarts = [1]", Path::new("f"), &known).unwrap_err().0.contains("must be a string"));
        assert!(parse("= nope", Path::new("f"), &known).unwrap_err().0.contains("not valid TOML"));
    }

    #[test]
    fn later_files_win_and_a_named_file_must_exist() {
        let dir = std::env::temp_dir().join(format!("rlaunch-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = (dir.join("a.toml"), dir.join("b.toml"));
        std::fs::write(&a, "rdzv-endpoint = \"a:1\"\nmax-restarts = 1\n").unwrap();
        std::fs::write(&b, "rdzv-endpoint = \"b:2\"\n").unwrap();
        let got = load(&[(a.clone(), false), (dir.join("missing.toml"), false), (b.clone(), false)], &known).unwrap();
        assert_eq!(got["rdzv-endpoint"], FileSetting { value: "b:2".into(), file: b });
        assert_eq!(got["max-restarts"].file, a);
        assert!(load(&[(dir.join("missing.toml"), true)], &known).is_err());
        let env = |k: &str| match k {
            "HOME" => Some("/home/u".to_string()),
            "RLAUNCH_CONFIG" => Some("/x.toml".to_string()),
            _ => None,
        };
        let paths: Vec<PathBuf> = config_paths(&env).into_iter().map(|(p, _)| p).collect();
        assert_eq!(
            paths,
            [PathBuf::from("/etc/rlaunch/config.toml"), "/home/u/.config/rlaunch/config.toml".into(), "/x.toml".into()]
        );
        std::fs::remove_dir_all(dir).ok();
    }
}
