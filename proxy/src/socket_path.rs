//! [`SocketPath`]: where a family's hot-restart channel lives. Its own module: the config
//! names it and the admin client reads it from `/server_info`, and neither needs the other.

use std::path::PathBuf;

/// Where an Envoy family's hot-restart channel lives: Envoy's `--socket-path`. Each epoch binds
/// `<path>_{parent,udp_parent}_<base_id * 10 + epoch % 3>` and its child the `_child_` names,
/// and acts on any datagram it receives there: `PassListenSocket` hands out a listening
/// socket, `Terminate` makes it exit (`docs/security.md#security-who-can-reach-what`). Who
/// can reach the names is who can steer the family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SocketPath {
    /// Abstract names (`@name`, Envoy's default `@envoy_domain_socket`): no permissions, any
    /// process of the network namespace (with hostNetwork, the node) can send to them.
    Abstract(String),
    /// File-system sockets `<prefix>_<role>_<n>`, created with `--socket-mode 600` in a
    /// directory only the agent's user can enter.
    File(PathBuf),
}

impl SocketPath {
    /// Envoy's default, `@envoy_domain_socket`.
    pub fn envoy_default() -> SocketPath {
        SocketPath::Abstract("envoy_domain_socket".to_owned())
    }

    /// As `--socket-path` takes it (and `/server_info` reports it): `@name` or a path.
    pub fn parse(text: &str) -> SocketPath {
        match text.strip_prefix('@') {
            Some(name) => SocketPath::Abstract(name.to_owned()),
            None => SocketPath::File(PathBuf::from(text)),
        }
    }

    /// Whether other users of the network namespace can reach it.
    pub fn is_abstract(&self) -> bool {
        matches!(self, SocketPath::Abstract(_))
    }

    /// The address of `role`'s socket (`parent`, `child`, `udp_parent`, `udp_child`) of the
    /// epoch whose id is `id` (`base_id * 10 + epoch % 3`), named as Envoy names it: an
    /// abstract name padded with NULs to the whole `sun_path`, or a path.
    pub fn address(&self, role: &str, id: u64) -> std::io::Result<std::os::unix::net::SocketAddr> {
        use std::os::linux::net::SocketAddrExt;
        match self {
            SocketPath::Abstract(name) => {
                let mut bytes = format!("{name}_{role}_{id}").into_bytes();
                bytes.resize(ABSTRACT_NAME_LEN, 0);
                std::os::unix::net::SocketAddr::from_abstract_name(bytes)
            }
            SocketPath::File(prefix) => {
                let mut path = prefix.clone().into_os_string();
                path.push(format!("_{role}_{id}"));
                std::os::unix::net::SocketAddr::from_pathname(path)
            }
        }
    }
}

impl std::fmt::Display for SocketPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SocketPath::Abstract(name) => write!(f, "@{name}"),
            SocketPath::File(path) => write!(f, "{}", path.display()),
        }
    }
}

/// `sun_path` on Linux, less the leading NUL of an abstract name.
const ABSTRACT_NAME_LEN: usize = 107;
