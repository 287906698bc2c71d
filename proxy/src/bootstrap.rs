//! Reading what the agent needs from an Envoy bootstrap: the admin address.
//!
//! Only the `admin.address` part (`socket_address` or `pipe`) is looked at; Envoy itself
//! validates the rest.
//! YAML and JSON bootstraps both parse (JSON is YAML).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::admin::Address as Address_;

/// Why the admin address could not be read from a bootstrap. Every variant names the file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BootstrapError {
    /// The file could not be read.
    #[error("cannot read bootstrap {path}: {source}")]
    Read {
        /// The bootstrap.
        path: PathBuf,
        /// The read error.
        source: std::io::Error,
    },
    /// The file is not YAML or JSON.
    #[error("bootstrap {path} is not valid YAML or JSON: {message}")]
    Parse {
        /// The bootstrap.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// No `admin.address.socket_address` or `admin.address.pipe` in the file.
    #[error(
        "bootstrap {path} has no admin address (admin.address.socket_address or \
         admin.address.pipe): the agent needs Envoy's admin API; add one, pass --admin-address, \
         or let the agent put it on its own socket (--envoy-admin socket)"
    )]
    NoAdmin {
        /// The bootstrap.
        path: PathBuf,
    },
    /// The admin address is not an IP and port.
    #[error(
        "bootstrap {path}: admin address {address:?} is not an IP address (IPv4 or IPv6, \
         without brackets: 127.0.0.1, ::1)"
    )]
    BadAddress {
        /// The bootstrap.
        path: PathBuf,
        /// What the file says.
        address: String,
    },
    /// The admin socket is an abstract name (`@name`): any process of the network namespace
    /// can reach it, and the agent does not.
    #[error(
        "bootstrap {path}: admin pipe {name:?} is an abstract socket, which any process of the \
         network namespace can reach: use a path (or --envoy-admin socket)"
    )]
    AbstractPipe {
        /// The bootstrap.
        path: PathBuf,
        /// The name.
        name: String,
    },
}

#[derive(Deserialize)]
struct Bootstrap {
    admin: Option<Admin>,
}

#[derive(Deserialize)]
struct Admin {
    address: Option<Address>,
}

#[derive(Deserialize)]
struct Address {
    socket_address: Option<SocketAddress>,
    pipe: Option<Pipe>,
}

#[derive(Deserialize)]
struct Pipe {
    path: String,
}

#[derive(Deserialize)]
struct SocketAddress {
    address: String,
    #[serde(default)]
    port_value: u16,
}

/// The address to reach the admin API of a bootstrap's Envoy. A wildcard bind (`0.0.0.0`,
/// `::`) is reached on loopback of the same family. Port 0 means "Envoy picks": see
/// [`crate::AdminAddress::FromFile`].
pub fn admin_address(path: &Path) -> Result<Address_, BootstrapError> {
    let read = |source| BootstrapError::Read {
        path: path.to_owned(),
        source,
    };
    let bytes = crate::read_config(path).map_err(read)?;
    let text = String::from_utf8(bytes)
        .map_err(|e| read(std::io::Error::new(std::io::ErrorKind::InvalidData, e)))?;
    admin_address_from_str(path, &text)
}

/// The admin address in bootstrap `text` (YAML or JSON); `path` names it in errors.
///
/// In bounded memory on a large bootstrap: JSON is read as it is parsed (nothing but the admin
/// section is kept), and of YAML only the top-level `admin:` section is parsed when there is
/// one (the YAML parser holds a document's every event: tens of MiB for thousands of
/// clusters). The whole document is parsed only when that finds no address (flow style, an
/// alias), so that a broken bootstrap is still named as such.
pub fn admin_address_from_str(path: &Path, text: &str) -> Result<Address_, BootstrapError> {
    let found = |b: &Bootstrap| {
        b.admin
            .as_ref()
            .and_then(|a| a.address.as_ref())
            .is_some_and(|a| a.socket_address.is_some() || a.pipe.is_some())
    };
    let json = text
        .trim_start()
        .starts_with('{')
        .then(|| serde_json::from_str::<Bootstrap>(text).ok())
        .flatten();
    let section = || {
        top_level_section(text, "admin")
            .and_then(|s| serde_yaml::from_str::<Bootstrap>(s).ok())
            .filter(found)
    };
    let bootstrap = match json.filter(found).or_else(section) {
        Some(b) => b,
        None => serde_yaml::from_str(text).map_err(|e| BootstrapError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })?,
    };
    let address = bootstrap
        .admin
        .and_then(|a| a.address)
        .filter(|a| a.socket_address.is_some() || a.pipe.is_some())
        .ok_or_else(|| BootstrapError::NoAdmin {
            path: path.to_owned(),
        })?;
    let socket = match (address.socket_address, address.pipe) {
        (Some(socket), _) => socket,
        (None, Some(pipe)) if pipe.path.starts_with('@') => {
            return Err(BootstrapError::AbstractPipe {
                path: path.to_owned(),
                name: pipe.path,
            });
        }
        (None, Some(pipe)) => return Ok(Address_::Unix(PathBuf::from(pipe.path))),
        (None, None) => {
            return Err(BootstrapError::NoAdmin {
                path: path.to_owned(),
            });
        }
    };
    // As Envoy takes it: an IP, IPv6 without brackets (Envoy refuses `[::1]`).
    let ip: IpAddr = socket
        .address
        .parse()
        .map_err(|_| BootstrapError::BadAddress {
            path: path.to_owned(),
            address: socket.address.clone(),
        })?;
    let ip = match ip {
        IpAddr::V4(v4) if v4.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(v6) if v6.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    Ok(Address_::Tcp(SocketAddr::new(ip, socket.port_value)))
}

/// The lines of a YAML document's top-level `key:` block: the key's line and those after it
/// that are indented, blank or comments, up to the next top-level line.
fn top_level_section<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    let mut offset = 0;
    let mut start = None;
    for line in text.split_inclusive('\n') {
        let top = line.starts_with(|c: char| !c.is_whitespace() && c != '#');
        match start {
            None if top && line.strip_prefix(key).is_some_and(|r| r.starts_with(':')) => {
                start = Some(offset);
            }
            Some(s) if top => return text.get(s..offset),
            _ => {}
        }
        offset += line.len();
    }
    start.and_then(|s| text.get(s..))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<SocketAddr, BootstrapError> {
        admin_address_from_str(Path::new("b.yaml"), text)
            .map(|a| a.tcp().expect("a TCP admin address"))
    }

    #[test]
    fn yaml_admin_address() {
        let yaml =
            "admin:\n  address:\n    socket_address: { address: 127.0.0.1, port_value: 9901 }\n";
        assert_eq!(parse(yaml).unwrap(), "127.0.0.1:9901".parse().unwrap());
    }

    #[test]
    fn json_admin_address() {
        let json =
            r#"{"admin":{"address":{"socket_address":{"address":"::1","port_value":15000}}}}"#;
        assert_eq!(parse(json).unwrap(), "[::1]:15000".parse().unwrap());
    }

    #[test]
    fn wildcard_is_reached_on_loopback() {
        let yaml = "admin: {address: {socket_address: {address: 0.0.0.0, port_value: 1}}}";
        assert_eq!(parse(yaml).unwrap(), "127.0.0.1:1".parse().unwrap());
        let yaml = "admin: {address: {socket_address: {address: '::', port_value: 1}}}";
        assert_eq!(parse(yaml).unwrap(), "[::1]:1".parse().unwrap());
    }

    #[test]
    fn port_zero_is_kept() {
        let yaml = "admin: {address: {socket_address: {address: 127.0.0.1, port_value: 0}}}";
        assert_eq!(parse(yaml).unwrap().port(), 0);
        let yaml = "admin: {address: {socket_address: {address: 127.0.0.1}}}";
        assert_eq!(parse(yaml).unwrap().port(), 0);
    }

    #[test]
    fn missing_admin_is_named() {
        let err = parse("static_resources: {}").unwrap_err();
        assert!(matches!(err, BootstrapError::NoAdmin { .. }), "{err}");
        assert!(err.to_string().contains("b.yaml"), "{err}");
        let err = parse("admin: {access_log: []}").unwrap_err();
        assert!(matches!(err, BootstrapError::NoAdmin { .. }), "{err}");
    }

    #[test]
    fn a_pipe_is_a_unix_socket_and_an_abstract_one_is_refused() {
        let at = |text| admin_address_from_str(Path::new("b.yaml"), text);
        let yaml = "admin:\n  address:\n    pipe: {path: /run/envoy/admin.sock, mode: 384}\n";
        assert_eq!(
            at(yaml).unwrap(),
            Address_::Unix(PathBuf::from("/run/envoy/admin.sock"))
        );
        let json = r#"{"admin":{"address":{"pipe":{"path":"/a.sock"}}}}"#;
        assert_eq!(at(json).unwrap(), Address_::Unix(PathBuf::from("/a.sock")));
        let err = at("admin: {address: {pipe: {path: '@envoy_admin'}}}").unwrap_err();
        assert!(matches!(err, BootstrapError::AbstractPipe { .. }), "{err}");
        assert!(err.to_string().contains("@envoy_admin"), "{err}");
    }

    #[test]
    fn only_the_admin_section_of_a_yaml_bootstrap_is_needed() {
        let yaml = "# a comment\nnode: {id: x}\nadmin:\n  # inside\n\n  address:\n    socket_address: {address: 127.0.0.1, port_value: 7}\nstatic_resources:\n  clusters: []\n";
        assert_eq!(
            top_level_section(yaml, "admin"),
            Some(
                "admin:\n  # inside\n\n  address:\n    socket_address: {address: 127.0.0.1, port_value: 7}\n"
            )
        );
        assert_eq!(parse(yaml).unwrap().port(), 7);
        assert_eq!(top_level_section("administrator: 1\n", "admin"), None);
        // At the end of the document, and an alias the section alone cannot resolve.
        assert_eq!(
            parse("x: 1\nadmin: {address: {socket_address: {address: 127.0.0.1, port_value: 8}}}")
                .unwrap()
                .port(),
            8
        );
        let aliased = "a: &admin {address: {socket_address: {address: 127.0.0.1, port_value: 9}}}\nadmin: *admin\n";
        assert_eq!(parse(aliased).unwrap().port(), 9);
    }

    #[test]
    fn a_document_broken_outside_its_admin_section_is_left_to_envoy() {
        // The address is found; Envoy refuses the rest at its start, with its own reason,
        // which the agent reports (exit: Envoy's, or a pre-flight's rejection).
        let yaml = "admin:\n  address:\n    socket_address: {address: 127.0.0.1, port_value: 7}\nstatic_resources: [unclosed\n";
        assert_eq!(parse(yaml).unwrap().port(), 7);
    }

    #[test]
    fn garbage_is_a_parse_error() {
        let err = parse("admin: [unclosed").unwrap_err();
        assert!(matches!(err, BootstrapError::Parse { .. }), "{err}");
        let err = parse("admin: {address: {socket_address: {address: envoy.local}}}").unwrap_err();
        assert!(matches!(err, BootstrapError::BadAddress { .. }), "{err}");
    }

    /// Found by fuzzing: brackets were stripped from both ends, any number of them. Envoy
    /// 1.40 refuses a bracketed address (`malformed IP address: [::1]`); so does the agent,
    /// saying what it takes.
    #[test]
    fn a_bracketed_address_is_refused_as_envoy_refuses_it() {
        for address in ["'[::1]'", "'[[::1'", "']127.0.0.1['", "'[127.0.0.1]'"] {
            let yaml = format!(
                "admin: {{address: {{socket_address: {{address: {address}, port_value: 1}}}}}}"
            );
            let err = parse(&yaml).unwrap_err();
            assert!(matches!(err, BootstrapError::BadAddress { .. }), "{err}");
            assert!(err.to_string().contains("without brackets"), "{err}");
        }
    }
}
