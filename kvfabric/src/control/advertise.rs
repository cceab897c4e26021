//! The address a process registers in discovery for other hosts to dial, given the address
//! it listens on. A listener on `0.0.0.0` or `::` accepts on every interface, but that is no
//! address to dial; a listener on `127.0.0.1` is reachable from its own host only. Neither may
//! reach discovery when the control plane is on another host: the deployment would look
//! healthy and every connection from elsewhere would fail (or dial the dialler's own
//! loopback).
//!
//! The rule, for each listening port:
//! 1. an address given (`--advertise HOST[:PORT]`) is registered as it is (a loopback one is
//!    warned about when the control plane is remote: the operator asked for it);
//! 2. else a specific listen address (`--listen 10.0.0.5:7000`) is registered, unless it is a
//!    loopback address and the control plane is on another host: then start fails;
//! 3. else (`0.0.0.0`, `::`) the address of the interface that routes to the control plane
//!    is registered (the kernel's choice of source address for that route: no packet is
//!    sent); with the control plane on this host only, loopback.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs, UdpSocket};

/// Why no address could be chosen to register.
#[derive(Debug, thiserror::Error)]
pub enum AdvertiseError {
    /// The address (or host name) given cannot be used.
    #[error("advertised address {given:?}: {reason}")]
    Invalid {
        /// What was given.
        given: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// What would be registered cannot be dialled from another host.
    #[error(
        "{what} listens on {listen}, which no other host can dial, while the control plane is \
         at {plane}: listen on this host's address (or 0.0.0.0) or give its address with \
         --advertise"
    )]
    Unreachable {
        /// Which port.
        what: String,
        /// Where it listens.
        listen: SocketAddr,
        /// The control plane's first remote endpoint.
        plane: SocketAddr,
    },
    /// No route to the control plane, so no interface to take the address from.
    #[error(
        "{what} listens on {listen}; no route to the control plane at {plane} to take this \
         host's address from ({source}): give it with --advertise"
    )]
    NoRoute {
        /// Which port.
        what: String,
        /// Where it listens.
        listen: SocketAddr,
        /// The control plane endpoint tried.
        plane: SocketAddr,
        /// The routing lookup's error.
        source: std::io::Error,
    },
}

/// An address to register: an IP, and a port when it differs from the one bound (a port
/// forwarded by a NAT or a proxy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Advertise {
    /// The IP others dial.
    pub ip: IpAddr,
    /// The port others dial (None: the port bound).
    pub port: Option<u16>,
}

impl Advertise {
    /// The address to register for a listener bound to `bound`.
    pub fn addr(&self, bound: SocketAddr) -> SocketAddr {
        SocketAddr::new(self.ip, self.port.unwrap_or(bound.port()))
    }

    /// The IP to register for a listener on `listen` (its port not yet bound, perhaps 0),
    /// given `given` (`--advertise`) and where the control plane is.
    pub fn resolve(
        what: &str,
        listen: SocketAddr,
        given: Option<Advertise>,
        plane: &Reach,
    ) -> Result<Advertise, AdvertiseError> {
        if let Some(a) = given {
            if a.ip.is_loopback() {
                if let Reach::Remote(p) = plane {
                    tracing::warn!(port = what, advertise = %a.ip, plane = %p[0],
                        "advertising a loopback address while the control plane is on another \
                         host: only processes on this host can dial it");
                }
            }
            return Ok(a);
        }
        let ip = listen.ip();
        let ip = if !ip.is_unspecified() {
            match plane {
                Reach::Remote(p) if ip.is_loopback() => {
                    return Err(AdvertiseError::Unreachable {
                        what: what.into(),
                        listen,
                        plane: p[0],
                    });
                }
                _ => ip,
            }
        } else {
            match plane {
                Reach::Local => match ip {
                    IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
                    IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
                },
                Reach::Remote(p) => route_source(p).map_err(|(plane, source)| {
                    AdvertiseError::NoRoute { what: what.into(), listen, plane, source }
                })?,
            }
        };
        Ok(Advertise { ip, port: None })
    }
}

impl std::str::FromStr for Advertise {
    type Err = AdvertiseError;

    /// `IP`, `IP:PORT`, `[IPv6]:PORT`, `HOST` or `HOST:PORT` (a host name is resolved once,
    /// here: discovery holds addresses).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let invalid =
            |reason: &str| AdvertiseError::Invalid { given: s.into(), reason: reason.into() };
        let parsed = if let Ok(a) = s.parse::<SocketAddr>() {
            Advertise { ip: a.ip(), port: Some(a.port()) }
        } else if let Ok(ip) = s.trim_matches(['[', ']']).parse::<IpAddr>() {
            Advertise { ip, port: None }
        } else {
            let (host, port) = match s.rsplit_once(':') {
                Some((h, p)) => (h, Some(p.parse::<u16>().map_err(|_| invalid("bad port"))?)),
                None => (s, None),
            };
            if host.is_empty() {
                return Err(invalid("no host"));
            }
            let ip = (host, 0)
                .to_socket_addrs()
                .map_err(|e| invalid(&format!("cannot resolve it: {e}")))?
                .next()
                .ok_or_else(|| invalid("it resolves to no address"))?
                .ip();
            Advertise { ip, port }
        };
        if parsed.ip.is_unspecified() {
            return Err(invalid("an unspecified address (0.0.0.0, ::) cannot be dialled"));
        }
        if parsed.port == Some(0) {
            return Err(invalid("port 0 cannot be dialled"));
        }
        Ok(parsed)
    }
}

/// Where the control plane is, as far as reaching this process goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reach {
    /// Embedded, or every endpoint on loopback: only this host takes part.
    Local,
    /// Endpoints on other hosts (at least one address, the first remote one first).
    Remote(Vec<SocketAddr>),
}

impl Reach {
    /// From the control plane's endpoints (etcd endpoints and NATS URLs: `scheme://`, user
    /// information and paths are ignored; `default_port` applies to one without a port). An
    /// endpoint that does not resolve is skipped (connecting to it reports the error).
    pub fn of<'a>(endpoints: impl IntoIterator<Item = (&'a str, u16)>) -> Reach {
        let mut remote = Vec::new();
        for (url, default_port) in endpoints {
            let Some(addrs) = authority(url, default_port) else { continue };
            remote.extend(addrs.into_iter().filter(|a| !a.ip().is_loopback()));
        }
        if remote.is_empty() {
            Reach::Local
        } else {
            Reach::Remote(remote)
        }
    }
}

/// `host:port` of an endpoint URL, resolved.
fn authority(url: &str, default_port: u16) -> Option<Vec<SocketAddr>> {
    let rest = url.trim().split_once("://").map_or(url.trim(), |(_, r)| r);
    let rest = rest.split(['/', '?']).next()?;
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    if rest.is_empty() {
        return None;
    }
    let with_port = match rest.parse::<SocketAddr>() {
        Ok(a) => return Some(vec![a]),
        Err(_) if rest.ends_with(']') || !rest.contains(':') => {
            format!("{rest}:{default_port}")
        }
        Err(_) => rest.to_string(),
    };
    with_port.to_socket_addrs().ok().map(Iterator::collect)
}

/// The source address the kernel picks for a route to the first of `targets` that has one.
fn route_source(targets: &[SocketAddr]) -> Result<IpAddr, (SocketAddr, std::io::Error)> {
    let mut last = None;
    for t in targets {
        let any: SocketAddr = match t {
            SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
            SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
        };
        // A connected UDP socket sends nothing: connecting only picks the route.
        match UdpSocket::bind(any).and_then(|s| s.connect(t).and_then(|()| s.local_addr())) {
            Ok(a) if !a.ip().is_unspecified() => return Ok(a.ip()),
            Ok(_) => last = Some((*t, std::io::Error::other("no source address"))),
            Err(e) => last = Some((*t, e)),
        }
    }
    Err(last.unwrap_or_else(|| {
        (SocketAddr::from(([0, 0, 0, 0], 0)), std::io::Error::other("no endpoint"))
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn remote() -> Reach {
        // A documentation address (TEST-NET-3): routed by the default route if there is one,
        // never contacted.
        Reach::of([("http://203.0.113.7:2379", 2379)])
    }

    #[test]
    fn endpoints_on_loopback_or_none_are_local() {
        assert_eq!(Reach::of([]), Reach::Local);
        let local = [("http://127.0.0.1:2379", 2379), ("nats://u:p@localhost", 4222)];
        assert_eq!(Reach::of(local), Reach::Local);
        assert_eq!(
            Reach::of([("nats://user:pw@10.77.0.11:4222", 4222), ("127.0.0.1:1", 1)]),
            Reach::Remote(vec!["10.77.0.11:4222".parse().unwrap()])
        );
        assert_eq!(
            Reach::of([("tls://[fd00::1]", 4222)]),
            Reach::Remote(vec!["[fd00::1]:4222".parse().unwrap()])
        );
        assert_eq!(
            Reach::of([("10.0.0.2", 2379)]),
            Reach::Remote(vec!["10.0.0.2:2379".parse().unwrap()])
        );
    }

    #[test]
    fn an_unspecified_or_loopback_listener_never_registers_itself_for_remote_peers() {
        let any: SocketAddr = "0.0.0.0:7000".parse().unwrap();
        let lo: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        // With the control plane on this host, loopback is right.
        let a = Advertise::resolve("request port", any, None, &Reach::Local).unwrap();
        assert_eq!(a.addr(any), lo);
        assert_eq!(Advertise::resolve("p", lo, None, &Reach::Local).unwrap().addr(lo), lo);
        // Remote: loopback is refused, naming the port and the way out.
        let e = Advertise::resolve("request port", lo, None, &remote()).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("request port listens on 127.0.0.1:7000") && msg.contains("--advertise"),
            "{msg}"
        );
        // Remote, 0.0.0.0: the route's source address, or a clear error without a route.
        match Advertise::resolve("request port", any, None, &remote()) {
            Ok(a) => {
                assert!(!a.ip.is_unspecified() && !a.ip.is_loopback(), "{a:?}");
                assert_eq!(a.addr(any).port(), 7000);
            }
            Err(e) => assert!(matches!(e, AdvertiseError::NoRoute { .. }), "{e}"),
        }
        // A specific address is registered as it is.
        let own: SocketAddr = "10.77.0.12:7100".parse().unwrap();
        assert_eq!(Advertise::resolve("p", own, None, &remote()).unwrap().addr(own), own);
        // Given: as given, its port over the bound one.
        let given: Advertise = "192.0.2.1:9000".parse().unwrap();
        let a = Advertise::resolve("p", any, Some(given), &remote()).unwrap();
        assert_eq!(a.addr(any), "192.0.2.1:9000".parse::<SocketAddr>().unwrap());
        let given: Advertise = "192.0.2.1".parse().unwrap();
        assert_eq!(given.addr(any), "192.0.2.1:7000".parse::<SocketAddr>().unwrap());
    }

    #[test]
    fn given_addresses_parse_or_say_why_not() {
        assert_eq!(
            "[fd00::2]:80".parse::<Advertise>().unwrap(),
            Advertise { ip: "fd00::2".parse().unwrap(), port: Some(80) }
        );
        assert_eq!("fd00::2".parse::<Advertise>().unwrap().port, None);
        assert_eq!("localhost:81".parse::<Advertise>().unwrap().port, Some(81));
        for bad in ["0.0.0.0", "[::]:1", "10.0.0.1:0", "host:port", ":80", ""] {
            assert!(bad.parse::<Advertise>().is_err(), "{bad}");
        }
    }

    #[test]
    fn the_route_source_of_a_local_route_is_that_address() {
        assert_eq!(
            route_source(&["127.0.0.1:9".parse().unwrap()]).unwrap(),
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        );
    }
}
