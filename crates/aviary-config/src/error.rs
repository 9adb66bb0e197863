//! Configuration errors, each naming the file, the line and column, and the
//! offending key.

use std::fmt;
use std::ops::Range;
use std::path::PathBuf;

/// A 1-based position in the configuration text (columns count characters).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct LineCol {
    pub line: usize,
    pub column: usize,
}

impl LineCol {
    /// Position of byte offset `offset` in `text` (clamped to the text's end).
    pub fn of_offset(text: &str, offset: usize) -> LineCol {
        let mut offset = offset.min(text.len());
        while !text.is_char_boundary(offset) {
            offset -= 1;
        }
        let before = &text[..offset];
        let line = before.matches('\n').count() + 1;
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        let column = text[line_start..offset].chars().count() + 1;
        LineCol { line, column }
    }
}

impl fmt::Display for LineCol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.line, self.column)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("read config file {}", path.display())]
    ReadFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// TOML syntax error, unknown key, wrong type or missing key.
    #[error("{origin}:{pos}: {message}")]
    ParseToml {
        origin: String,
        pos: LineCol,
        /// The key on the offending line, with its table (`class.cpu`), when
        /// the error points at a `key = value` line.
        key: Option<String>,
        message: String,
    },
    /// A well-typed value that breaks a rule (`cpu must be > 0`, an unknown
    /// class name, `pool_min > pool_max`, ...).
    #[error("{origin}:{pos}: {message}")]
    ValidateField {
        origin: String,
        pos: LineCol,
        /// Dotted path of the offending key, e.g. `class[2].cpu`.
        key: String,
        message: String,
    },
}

impl ConfigError {
    /// Where the error is, when it is in the text (not for [`ConfigError::ReadFile`]).
    pub fn position(&self) -> Option<LineCol> {
        match self {
            ConfigError::ReadFile { .. } => None,
            ConfigError::ParseToml { pos, .. } | ConfigError::ValidateField { pos, .. } => {
                Some(*pos)
            }
        }
    }

    /// The offending key, when known.
    pub fn key(&self) -> Option<&str> {
        match self {
            ConfigError::ReadFile { .. } => None,
            ConfigError::ParseToml { key, .. } => key.as_deref(),
            ConfigError::ValidateField { key, .. } => Some(key),
        }
    }

    /// Converts toml's error (a byte span and a message) into one that names
    /// the line, the column, the table and the key.
    pub(crate) fn from_toml(text: &str, origin: &str, err: &toml::de::Error) -> ConfigError {
        let span = err.span().unwrap_or(0..0);
        let pos = LineCol::of_offset(text, span.start);
        let table = table_at(text, span.start);
        let key = key_at(text, span.start).map(|k| match &table {
            Some(t) => format!("{}.{k}", t.trim_matches(['[', ']'])),
            None => k,
        });
        let message = match (&table, &key) {
            (_, Some(k)) => format!("{k}: {}", err.message()),
            (Some(t), None) => format!("in {t}: {}", err.message()),
            (None, None) => err.message().to_owned(),
        };
        ConfigError::ParseToml {
            origin: origin.to_owned(),
            pos,
            key,
            message,
        }
    }

    pub(crate) fn invalid(
        text: &str,
        origin: &str,
        span: &Range<usize>,
        key: impl Into<String>,
        message: impl Into<String>,
    ) -> ConfigError {
        ConfigError::ValidateField {
            origin: origin.to_owned(),
            pos: LineCol::of_offset(text, span.start),
            key: key.into(),
            message: message.into(),
        }
    }
}

/// The line that contains byte `offset`.
fn line_at(text: &str, offset: usize) -> (usize, &str) {
    let offset = offset.min(text.len());
    let start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let end = text[offset..].find('\n').map_or(text.len(), |i| offset + i);
    (start, &text[start..end])
}

/// The key of the `key = value` line that contains `offset`, if any.
fn key_at(text: &str, offset: usize) -> Option<String> {
    let (_, line) = line_at(text, offset);
    let trimmed = line.trim_start();
    if trimmed.starts_with('[') || trimmed.starts_with('#') {
        return None;
    }
    let (key, _) = trimmed.split_once('=')?;
    let key = key.trim().trim_matches('"');
    let plausible = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    plausible.then(|| key.to_owned())
}

/// The nearest table header (`[server]`, `[[class]]`) at or above `offset`.
fn table_at(text: &str, offset: usize) -> Option<String> {
    let (line_start, _) = line_at(text, offset);
    let end = text[line_start..]
        .find('\n')
        .map_or(text.len(), |i| line_start + i);
    text[..end].lines().rev().find_map(|l| {
        let t = l.trim();
        let header = t.split('#').next().unwrap_or("").trim();
        (header.starts_with('[') && header.ends_with(']')).then(|| header.to_owned())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_col_counts_lines_and_characters() {
        let text = "a = 1\nbé = 2\n";
        assert_eq!(LineCol::of_offset(text, 0), LineCol { line: 1, column: 1 });
        assert_eq!(LineCol::of_offset(text, 6), LineCol { line: 2, column: 1 });
        // 'é' is two bytes but one column.
        assert_eq!(LineCol::of_offset(text, 9), LineCol { line: 2, column: 3 });
        assert_eq!(
            LineCol::of_offset(text, 999),
            LineCol { line: 3, column: 1 }
        );
    }

    #[test]
    fn key_and_table_come_from_the_offending_line() {
        let text = "[server]\nlisten = 1\n\n[[class]] # c\ncpu = \"x\"\n";
        let at = text.find("\"x\"").unwrap();
        assert_eq!(key_at(text, at).as_deref(), Some("cpu"));
        assert_eq!(table_at(text, at).as_deref(), Some("[[class]]"));
        assert_eq!(key_at(text, 0), None);
        assert_eq!(table_at(text, 0).as_deref(), Some("[server]"));
    }
}
