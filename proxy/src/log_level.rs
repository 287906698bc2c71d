//! Envoy's log level as the agent keeps it: what the command line started Envoy with, changed
//! at run time through the admin API (`POST /logging`), and what the next Envoy starts with.
//!
//! # Theory of operation
//!
//! A level is written Istio's way (`--proxy-log-level`): `info`, or `warning,upstream:debug`
//! (a token without `:` is the global level, the last one wins; `component:level` tokens set
//! one logger each). [`LogLevel::parse`] reads a change strictly (an unknown level or a token
//! with two `:` is refused before Envoy is asked); [`LogLevel::from_flags`] reads the command
//! line as [`crate::envoy_args`] always has (leniently: Envoy itself refuses a bad `-l`).
//!
//! Envoy's `/logging` takes one kind of change per request: `?level=L` sets *every* logger
//! (components included), `?paths=a:L,b:L` the named ones, all or nothing (an unknown name
//! changes none). So a change with both ([`LogLevel::admin_queries`]) asks `paths` first
//! (Envoy checks the names: a refusal leaves everything as it was), then `level`, then `paths`
//! again (the `level` reset them). What is in force afterwards is [`LogLevel::then`]: a global
//! level clears the earlier component levels, as it does in Envoy.
//!
//! An Envoy started later (a hot restart's next epoch, a crash recovery's fresh Envoy) must
//! not silently fall back to the command line's level: [`LogLevelCell`] is shared by every
//! clone of a [`crate::ProxyConfig`], and [`crate::envoy_args`] takes its level when one was
//! set.

use std::sync::{Arc, RwLock};

/// The levels Envoy's `/logging` knows (spdlog's names); `warn` is read as `warning`, which
/// `-l` takes both ways and `/logging` only in full.
pub const LEVELS: [&str; 7] = [
    "trace", "debug", "info", "warning", "error", "critical", "off",
];

/// A log level, Istio style: a global level and component levels.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogLevel {
    /// Every logger's level; `None`: unchanged (for a change), Envoy's `warning` (at start).
    pub global: Option<String>,
    /// `(component, level)`, in order; a component appears once.
    pub components: Vec<(String, String)>,
}

/// Why a log level is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LogLevelError {
    /// Nothing was given.
    #[error("no log level given (e.g. `info`, or `warning,upstream:debug`)")]
    Empty,
    /// A level Envoy does not know.
    #[error(
        "{token:?}: {level:?} is not a level envoy knows (trace, debug, info, warning, error, critical, off)"
    )]
    UnknownLevel {
        /// The token it was in.
        token: String,
        /// The level.
        level: String,
    },
    /// A token that is neither `level` nor `component:level`.
    #[error("{0:?} is neither a level nor component:level")]
    Malformed(String),
}

/// The level as `/logging` takes it, if Envoy knows it.
fn level(token: &str, level: &str) -> Result<String, LogLevelError> {
    let lower = level.to_ascii_lowercase();
    let lower = if lower == "warn" {
        "warning".to_owned()
    } else {
        lower
    };
    if LEVELS.contains(&lower.as_str()) {
        Ok(lower)
    } else {
        Err(LogLevelError::UnknownLevel {
            token: token.to_owned(),
            level: level.to_owned(),
        })
    }
}

impl LogLevel {
    /// A change, strictly: every level must be one Envoy knows, every component name a word
    /// (`[A-Za-z0-9_]`; Envoy says whether it has such a logger).
    pub fn parse(text: &str) -> Result<LogLevel, LogLevelError> {
        let mut parsed = LogLevel::default();
        for token in text.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            match token.split_once(':') {
                None => parsed.global = Some(level(token, token)?),
                Some((name, lvl)) => {
                    let word = |s: &str| {
                        !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                    };
                    if !word(name) || lvl.contains(':') {
                        return Err(LogLevelError::Malformed(token.to_owned()));
                    }
                    parsed.set_component(name, level(token, lvl)?);
                }
            }
        }
        if parsed.global.is_none() && parsed.components.is_empty() {
            return Err(LogLevelError::Empty);
        }
        Ok(parsed)
    }

    /// The command line's level (`--proxy-log-level`, and `--proxy-component-log-level` when it
    /// names no component), read as Envoy's command line gets it ([`LogLevels`]).
    pub fn from_flags(log_level: &str, component_log_level: &str) -> LogLevel {
        let levels = LogLevels::parse(log_level);
        let components = if levels.components.is_empty() {
            LogLevels::parse(component_log_level).components
        } else {
            levels.components
        };
        let mut parsed = LogLevel {
            global: levels.global.map(str::to_owned),
            components: Vec::new(),
        };
        for token in components {
            if let Some((name, lvl)) = token.split_once(':') {
                parsed.set_component(name, lvl.to_owned());
            }
        }
        parsed
    }

    fn set_component(&mut self, name: &str, level: String) {
        match self.components.iter_mut().find(|(n, _)| n == name) {
            Some(entry) => entry.1 = level,
            None => self.components.push((name.to_owned(), level)),
        }
    }

    /// What is in force once `change` is applied over `self`: a global level resets every
    /// component (Envoy's `?level=` sets every logger), component levels replace theirs.
    pub fn then(&self, change: &LogLevel) -> LogLevel {
        let mut next = match &change.global {
            Some(global) => LogLevel {
                global: Some(global.clone()),
                components: Vec::new(),
            },
            None => self.clone(),
        };
        for (name, level) in &change.components {
            next.set_component(name, level.clone());
        }
        next
    }

    /// The `/logging` queries that apply this change, in order (see the module's docs).
    pub fn admin_queries(&self) -> Vec<String> {
        let paths = (!self.components.is_empty()).then(|| {
            let list: Vec<String> = self
                .components
                .iter()
                .map(|(name, level)| format!("{name}:{level}"))
                .collect();
            format!("paths={}", list.join(","))
        });
        match (&self.global, paths) {
            (Some(global), Some(paths)) => {
                vec![paths.clone(), format!("level={global}"), paths]
            }
            (Some(global), None) => vec![format!("level={global}")],
            (None, Some(paths)) => vec![paths],
            (None, None) => Vec::new(),
        }
    }

    /// `-l`'s value (Envoy's default `warning` when no global level is set).
    pub fn global_or_default(&self) -> &str {
        self.global.as_deref().unwrap_or("warning")
    }

    /// `--component-log-level`'s value, empty when no component is set.
    pub fn components_arg(&self) -> String {
        let list: Vec<String> = self
            .components
            .iter()
            .map(|(name, level)| format!("{name}:{level}"))
            .collect();
        list.join(",")
    }
}

impl std::fmt::Display for LogLevel {
    /// Istio style, as `--proxy-log-level` takes it: `warning,upstream:debug`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut tokens: Vec<String> = self.global.iter().cloned().collect();
        tokens.extend(self.components.iter().map(|(n, l)| format!("{n}:{l}")));
        write!(f, "{}", tokens.join(","))
    }
}

/// The level set at run time, shared by every clone of the [`crate::ProxyConfig`] it is in:
/// what each Envoy started from then on is given (`-l`, `--component-log-level`). Empty until
/// a level is set.
#[derive(Debug, Clone, Default)]
pub struct LogLevelCell(Arc<RwLock<Option<LogLevel>>>);

impl LogLevelCell {
    /// The level set, if any.
    pub fn get(&self) -> Option<LogLevel> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Sets it, for every Envoy started from now on.
    pub fn set(&self, level: LogLevel) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = Some(level);
    }
}

impl PartialEq for LogLevelCell {
    /// The same level set (or none): two configs that would start Envoy alike.
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.get() == other.get()
    }
}

/// Istio's log level string split into Envoy's two flags.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct LogLevels<'a> {
    /// The last token without `:`.
    pub global: Option<&'a str>,
    /// `component:level` tokens, in order.
    pub components: Vec<&'a str>,
    /// Tokens with more than one `:`.
    pub dropped: Vec<&'a str>,
}

impl<'a> LogLevels<'a> {
    /// Splits `warning,upstream:debug` into global `warning` and component `upstream:debug`.
    pub fn parse(s: &'a str) -> Self {
        let mut levels = LogLevels::default();
        for token in s.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            match token.matches(':').count() {
                0 => levels.global = Some(token),
                1 => levels.components.push(token),
                _ => levels.dropped.push(token),
            }
        }
        levels
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(text: &str) -> LogLevel {
        LogLevel::parse(text).unwrap()
    }

    #[test]
    fn a_change_reads_istio_style_and_names_what_envoy_would_refuse() {
        assert_eq!(
            parsed("info"),
            LogLevel {
                global: Some("info".into()),
                components: vec![]
            }
        );
        let both = parsed(" WARN , upstream:debug,http:trace,debug,upstream:info");
        assert_eq!(
            both.global.as_deref(),
            Some("debug"),
            "the last global wins"
        );
        assert_eq!(
            both.components,
            [
                ("upstream".to_owned(), "info".to_owned()),
                ("http".to_owned(), "trace".to_owned())
            ],
            "a component once, its last level"
        );
        assert_eq!(both.to_string(), "debug,upstream:info,http:trace");
        assert_eq!(parsed("warn").global.as_deref(), Some("warning"));
        assert_eq!(LogLevel::parse(""), Err(LogLevelError::Empty));
        assert_eq!(LogLevel::parse(" , "), Err(LogLevelError::Empty));
        assert!(matches!(
            LogLevel::parse("verbose"),
            Err(LogLevelError::UnknownLevel { .. })
        ));
        assert!(matches!(
            LogLevel::parse("upstream:loud"),
            Err(LogLevelError::UnknownLevel { .. })
        ));
        for malformed in ["a:b:c", ":debug", "up stream:debug", "a&level=x:debug"] {
            assert!(
                matches!(LogLevel::parse(malformed), Err(LogLevelError::Malformed(_))),
                "{malformed}"
            );
        }
    }

    #[test]
    fn a_global_level_resets_the_components_as_in_envoy() {
        let start = LogLevel::from_flags("warning", "upstream:info");
        assert_eq!(start.to_string(), "warning,upstream:info");
        let components = start.then(&parsed("http:debug,upstream:trace"));
        assert_eq!(components.to_string(), "warning,upstream:trace,http:debug");
        assert_eq!(components.then(&parsed("info")).to_string(), "info");
        assert_eq!(
            components.then(&parsed("error,misc:off")).components_arg(),
            "misc:off"
        );
        assert_eq!(LogLevel::from_flags("", "").global_or_default(), "warning");
    }

    #[test]
    fn both_kinds_check_the_names_first_then_reset_then_set() {
        assert_eq!(parsed("debug").admin_queries(), ["level=debug"]);
        assert_eq!(
            parsed("upstream:debug,http:info").admin_queries(),
            ["paths=upstream:debug,http:info"]
        );
        assert_eq!(
            parsed("info,upstream:debug").admin_queries(),
            ["paths=upstream:debug", "level=info", "paths=upstream:debug"]
        );
    }

    #[test]
    fn the_cell_is_shared_by_clones() {
        let cell = LogLevelCell::default();
        let clone = cell.clone();
        assert_eq!(clone.get(), None);
        cell.set(parsed("debug"));
        assert_eq!(clone.get(), Some(parsed("debug")));
    }
}
