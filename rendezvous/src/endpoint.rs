//! An endpoint of the rendezvous service or of etcd, parsed once where it is given (`host:port`,
//! `http://host[:port]` or `https://host[:port]`, an IPv6 literal in brackets, with the path the
//! service sits under if any): every later use reads its scheme, host and port, and the URL a
//! request goes to is made from them at the call.

use std::fmt;
use std::net::Ipv6Addr;
use std::str::FromStr;

use rlaunch::contract::Host;

/// How an endpoint is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// In clear (also what an endpoint without a scheme means).
    Http,
    Https,
}

/// A checked endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    scheme: Scheme,
    host: Host,
    /// None: the scheme's default.
    port: Option<u16>,
    /// The path the service sits under: empty, or starting with '/' and not ending with one.
    path: String,
}

/// Why an endpoint was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{input}` is not an endpoint (host:port, http://host:port or https://host:port): {why}")]
pub struct EndpointError {
    pub input: String,
    pub why: &'static str,
}

impl Endpoint {
    pub fn scheme(&self) -> Scheme {
        self.scheme
    }

    pub fn host(&self) -> &Host {
        &self.host
    }

    pub fn port(&self) -> Option<u16> {
        self.port
    }

    /// The path the service sits under: empty, or starting with '/'.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The URL of `path` (starting with '/') at this endpoint.
    pub fn url(&self, path: &str) -> String {
        format!("{self}{path}")
    }
}

impl From<&rlaunch::contract::Endpoint> for Endpoint {
    /// An endpoint as the launcher checked it (`--rdzv-endpoint`): its scheme and address.
    fn from(e: &rlaunch::contract::Endpoint) -> Endpoint {
        Endpoint {
            scheme: if e.is_tls() { Scheme::Https } else { Scheme::Http },
            host: Host::from(&e.addr),
            port: Some(e.addr.port()),
            path: String::new(),
        }
    }
}

impl FromStr for Endpoint {
    type Err = EndpointError;

    fn from_str(input: &str) -> Result<Endpoint, EndpointError> {
        let bad = |why| EndpointError { input: input.chars().take(300).collect(), why };
        let given = input.trim().trim_end_matches('/');
        let (scheme, rest) = if let Some(rest) = given.strip_prefix("https://") {
            (Scheme::Https, rest)
        } else if let Some(rest) = given.strip_prefix("http://") {
            (Scheme::Http, rest)
        } else if given.contains("://") {
            return Err(bad("the scheme is neither http nor https"));
        } else {
            (Scheme::Http, given)
        };
        let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        let (host, port) = match authority.strip_prefix('[') {
            Some(inside) => {
                let (v6, after) = inside.split_once(']').ok_or_else(|| bad("unclosed bracket"))?;
                if v6.parse::<Ipv6Addr>().is_err() {
                    return Err(bad("no IPv6 address between the brackets"));
                }
                let port = match after {
                    "" => None,
                    _ => Some(after.strip_prefix(':').ok_or_else(|| bad("text after the closing bracket"))?),
                };
                (v6, port)
            }
            None => match authority.rsplit_once(':') {
                Some((host, _)) if host.contains(':') => return Err(bad("an IPv6 address needs brackets")),
                Some((host, port)) => (host, Some(port)),
                None => (authority, None),
            },
        };
        let port = port.map(|p| p.parse::<u16>().map_err(|_| bad("the port is not a number from 0 to 65535")));
        let host = host.parse::<Host>().map_err(|e| bad(e.why))?;
        Ok(Endpoint { scheme, host, port: port.transpose()?, path: path.to_owned() })
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = match self.scheme {
            Scheme::Http => "http",
            Scheme::Https => "https",
        };
        let host = self.host.as_str();
        if host.contains(':') {
            write!(f, "{scheme}://[{host}]")?;
        } else {
            write!(f, "{scheme}://{host}")?;
        }
        if let Some(port) = self.port {
            write!(f, ":{port}")?;
        }
        f.write_str(&self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(s: &str) -> Endpoint {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn an_endpoint_is_read_as_scheme_host_port_and_path_and_written_back_as_a_url() {
        for (given, scheme, host, port, written) in [
            ("svc:29400", Scheme::Http, "svc", Some(29400), "http://svc:29400"),
            (" http://10.0.0.5:29400/ ", Scheme::Http, "10.0.0.5", Some(29400), "http://10.0.0.5:29400"),
            ("https://rdzv.cluster", Scheme::Https, "rdzv.cluster", None, "https://rdzv.cluster"),
            ("[fe80::1]:5", Scheme::Http, "fe80::1", Some(5), "http://[fe80::1]:5"),
            ("https://[::1]", Scheme::Https, "::1", None, "https://[::1]"),
            ("http://proxy:80/rdzv/", Scheme::Http, "proxy", Some(80), "http://proxy:80/rdzv"),
        ] {
            let e = parsed(given);
            assert_eq!((e.scheme(), e.host().as_str(), e.port()), (scheme, host, port), "{given}");
            assert_eq!(e.to_string(), written, "{given}");
            assert_eq!(parsed(written), e, "{given}: written back, read the same");
        }
        assert_eq!(parsed("h:1/base").url("/v1/jobs"), "http://h:1/base/v1/jobs");
    }

    #[test]
    fn what_is_not_an_endpoint_is_refused_with_the_reason() {
        for (given, why) in [
            ("fe80::1:5", "brackets"),
            ("[fe80::1:5", "unclosed"),
            ("[not-v6]:5", "IPv6"),
            ("[::1]5", "after the closing bracket"),
            ("svc:http", "port"),
            ("svc:70000", "port"),
            ("ftp://svc:1", "scheme"),
            ("http://", "port"),
            ("http://:1", "empty host"),
            ("user@svc:1", "'@'"),
        ] {
            let e = given.parse::<Endpoint>().expect_err(given);
            // The reason itself: the message's fixed text names "port" and "http" whatever it is.
            assert!(e.why.contains(why) && e.to_string().contains(given), "{given}: {e}");
        }
    }
}
