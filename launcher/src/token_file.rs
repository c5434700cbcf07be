//! `--rdzv-token-file`: the rendezvous service's bearer token read from a file, so that it is
//! not on the command line, where `ps` shows it. One reading for the launcher and for
//! `rlaunch status`/`rlaunch top`: the file's text with surrounding whitespace (a trailing
//! newline) trimmed; an empty file means no token.

use std::path::{Path, PathBuf};

/// The file could not be read.
#[derive(Debug, thiserror::Error)]
#[error("--rdzv-token-file {}: {source}", path.display())]
pub struct TokenFileError {
    pub path: PathBuf,
    pub source: std::io::Error,
}

/// The token `path` holds; `None` when it holds only whitespace.
pub fn read(path: &Path) -> Result<Option<String>, TokenFileError> {
    std::fs::read_to_string(path)
        .map(|t| Some(t.trim().to_owned()).filter(|t| !t.is_empty()))
        .map_err(|source| TokenFileError { path: path.to_owned(), source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_is_trimmed_an_empty_file_is_none_and_a_missing_one_named() {
        let dir = std::env::temp_dir().join(format!("rlaunch-token-file-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("token");
        std::fs::write(&file, "  s3cret\n").unwrap();
        assert_eq!(read(&file).unwrap().as_deref(), Some("s3cret"));
        std::fs::write(&file, "\n").unwrap();
        assert_eq!(read(&file).unwrap(), None);
        let missing = dir.join("missing");
        let e = read(&missing).unwrap_err().to_string();
        assert!(e.starts_with(&format!("--rdzv-token-file {}: ", missing.display())), "{e}");
        assert!(e.contains("No such file"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
